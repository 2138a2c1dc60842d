"""Reference models for zero_jax. Each names logical axes only."""

from zero_jax.model import ModelFns

from models import gpt


def build(name: str, vocab_size: int, vocab_multiple: int = 1) -> ModelFns:
    """A model by preset name, sized to the data's vocabulary."""
    return gpt.model_fns(gpt.config(name, vocab_size, vocab_multiple=vocab_multiple))


def builder(name: str, vocab_size: int):
    """`vocab_multiple -> ModelFns`, checking the name now."""
    gpt.config(name, vocab_size)
    return lambda vocab_multiple: build(name, vocab_size, vocab_multiple)


def describe(name: str, vocab_size: int, vocab_multiple: int = 1) -> str:
    c = gpt.config(name, vocab_size, vocab_multiple=vocab_multiple)
    vocab = f"{c.vocab_size}" + (f" padded to {c.padded_vocab}" if c.padded_vocab != c.vocab_size else "")
    return (f"{name}: {c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, "
            f"mlp {c.d_mlp}, vocab {vocab}, positions {c.max_seq_len}")
