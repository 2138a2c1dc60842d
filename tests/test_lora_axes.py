"""LoRA beside what else a run does: dropout on the adapters' input, drawn
alike on every layout; a mixture of experts, whose selection biases train
beside the adapters. (tests/test_lora.py has the layouts, checkpoints and
exports; context parallelism and FP8 are there too.)"""

import dataclasses

import jax
import numpy as np

from tests.test_lora import _train
from zero_jax.model import lora
from zero_jax.model.hooks import Hooks


def test_lora_on_a_mixture_of_experts_moves_its_selection_biases(corpus):
    """deepseek-tiny (latent attention, a mixture with aux-loss-free
    selection biases, an MTP module), adapters on `o`: four steps on
    expert=4,data=2 give one device's losses, adapters and biases to 1e-5;
    the biases are trained beside the adapters and move as a full run's do,
    the experts and the router stay frozen."""
    extra = dict(model="deepseek-tiny", lora_targets="o", steps=4)
    losses, adapters, frozen, base = _train(corpus, "expert=4,data=2", 3, **extra)
    ref_losses, ref_adapters, _, _ = _train(corpus, "fsdp=1", 3, devices=jax.devices()[:1],
                                            **extra)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 adapters, ref_adapters)
    assert np.any(adapters["blocks"]["moe"]["expert_bias"])  # moved from zero
    assert "expert_bias" not in frozen["blocks"]["moe"]
    jax.tree.map(np.testing.assert_array_equal, frozen, base)


def test_dropout_draws_the_same_masks_on_every_layout(corpus):
    """--lora-dropout 0.3: ten steps on fsdp=8 at ZeRO-3 give one device's
    losses and adapters to 1e-5 (the masks are drawn over the global
    activations), and differ from the run without dropout once the
    adapters are nonzero (the first step's B = 0 hides them)."""
    losses, adapters, _, _ = _train(corpus, "fsdp=8", 3, lora_dropout=0.3)
    ref_losses, ref_adapters, _, _ = _train(corpus, "fsdp=1", 3, devices=jax.devices()[:1],
                                            lora_dropout=0.3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 adapters, ref_adapters)
    no_dropout = _train(corpus, "fsdp=1", 3, devices=jax.devices()[:1])[0]
    assert ref_losses[0] == no_dropout[0]  # both on one device
    assert np.abs(ref_losses[1:] - no_dropout[1:]).min() > 1e-6


def test_dropout_keeps_the_adapter_term_unbiased():
    """peft's lora_dropout: the input's elements dropped with probability
    p and the rest scaled by 1 / (1 - p), so over many masks the adapter's
    term averages to the term without dropout; without a dropout stream
    (evaluation) it is that term exactly; two streams draw two masks."""
    spec = lora.Lora(4, 8.0, ("q",), dropout=0.5)
    hooks = Hooks(lora=spec)
    module = lora.Adapter(hooks, "btd,df->btf", (16, 12), ("embed", "mlp"))
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    params = module.init(jax.random.key(1), x)
    params = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape), params)
    clean = module.apply(params, x)
    without = lora.Adapter(Hooks(lora=dataclasses.replace(spec, dropout=0.0)), "btd,df->btf",
                           (16, 12), ("embed", "mlp"))
    np.testing.assert_array_equal(clean, without.apply(params, x))
    draws = jax.vmap(lambda k: module.apply(params, x, rngs={lora.DROPOUT: k}))(
        jax.random.split(jax.random.key(3), 4000))
    assert not np.allclose(draws[0], draws[1]) and not np.allclose(draws[0], clean)
    spread = np.std(np.asarray(draws), axis=0) / np.sqrt(len(draws))
    assert np.all(np.abs(np.mean(np.asarray(draws), axis=0) - clean) < 5 * spread + 1e-6)
