"""Greedy decoding, to compare a model's text with another framework's.

No key/value cache: each step runs the model over a fixed-length buffer of
prompt plus the tokens so far. Attention is causal, so the logits at a
position do not depend on the (padding) tokens after it, and one compiled
program serves every step.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def greedy(apply: Callable[[Any, jax.Array], jax.Array], params: Any, prompt_BxP: np.ndarray,
           new_tokens: int) -> np.ndarray:
    """The `new_tokens` most likely next tokens, one at a time, after each
    row of the prompt; `apply(params, tokens) -> logits`."""
    B, P = prompt_BxP.shape
    buffer = jnp.zeros((B, P + new_tokens), jnp.int32).at[:, :P].set(prompt_BxP)

    @jax.jit
    def step(params, buffer, at):
        logits = apply(params, buffer)
        token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, at - 1, 1, keepdims=False), -1)
        return jax.lax.dynamic_update_index_in_dim(buffer, token.astype(jnp.int32), at, 1)

    for at in range(P, P + new_tokens):
        buffer = step(params, buffer, at)
    return np.asarray(buffer[:, P:])
