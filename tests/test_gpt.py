"""The reference GPT: sizes, causality, FLOPs."""

import flax.linen as nn
import jax
import numpy as np

from models import gpt
from zero_jax.model.hooks import Hooks


def _init(name, vocab):
    model = gpt.model.model_fns(gpt.model.config(name, vocab))
    return model, nn.unbox(jax.eval_shape(model.init, jax.random.key(0)))


def test_param_count_formula_matches_the_built_model():
    for name in ("gpt-tiny", "gpt-small"):
        _, params = _init(name, 50257)
        assert (sum(p.size for p in jax.tree.leaves(params))
                == gpt.model.config(name, 50257).param_count)
    # Hugging Face's GPT-2 small has 124,439,808 parameters; ours lacks the 12 x 768
    # key biases, which the softmax cancels.
    assert gpt.model.config("gpt-small", 50257).param_count == 124_439_808 - 12 * 768


def test_logits_are_causal():
    model = gpt.model.model_fns(gpt.model.config("gpt-tiny", 256))
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 1) % 256)
    apply = jax.jit(lambda p, t: model.apply(p, t, Hooks()))  # one compile, not op by op
    a = np.asarray(apply(params, tokens))
    b = np.asarray(apply(params, changed))
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_flops_per_token_is_the_palm_formula():
    cfg = gpt.model.config("gpt-small", 50257)
    n = 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 50257 * 768
    assert cfg.flops_per_token(1024) == 6 * n + 12 * 12 * 12 * 64 * 1024
