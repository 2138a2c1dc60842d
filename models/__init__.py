"""Reference models for zero_jax. Each names logical axes only."""

from zero_jax.model import ModelFns

from models import gpt


def build(name: str, vocab_size: int) -> ModelFns:
    """A model by preset name, sized to the data's vocabulary."""
    if name in gpt.PRESETS:
        return gpt.model_fns(gpt.config(name, vocab_size))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(gpt.PRESETS)}")


def describe(name: str, vocab_size: int) -> str:
    c = gpt.config(name, vocab_size)
    return (f"{name}: {c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, "
            f"mlp {c.d_mlp}, vocab {c.vocab_size}, positions {c.max_seq_len}")
