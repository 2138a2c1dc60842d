"""Float32 master weights inside the sharded optimizer state (ZeRO-1 and 2).

Mixed precision as the ZeRO paper counts it, 2 + 2 + 12 bytes per parameter:
a working copy of the parameters in the compute dtype, the gradients, and in
the optimizer state the float32 master weights beside the moments. At ZeRO
stages 1 and 2 the parameters are replicated and the optimizer state is
sharded, so keeping the master copy in the optimizer state shards it too:

    stored parameters   the working copy, replicated (what the model reads)
    optimizer state     MasterState(master, inner): float32 weights and the
                        wrapped transformation's state, both sharded

Each device updates its shard of the master weights with any optax
transformation, casts the new shard to the working dtype and the working
copy is re-assembled by an all-gather of that narrow copy: 2 bytes per
parameter instead of 4.

Where parameters and optimizer state are stored alike (stage 0, both
replicated; stage 3, both sharded) a second copy would only add bytes: there
the float32 parameters are the master weights and are cast at use.

The working dtype of a parameter is the one the model uses it in
(`hooks.use_dtypes`): matrices and tables in the compute dtype, but
LayerNorm scales and biases, which the model asks for in float32, stay
float32. So a ZeRO stage changes where bytes live, never the model's
arithmetic.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import optax


class MasterState(NamedTuple):
    master: Any  # the float32 parameters, laid out like the optimizer state
    inner: Any  # the wrapped transformation's state


def wrap(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` applied to float32 master weights kept in its state.

    `init` takes the float32 parameters. `update` steps the master weights
    and returns the updates it applied; the caller casts the new working
    copy from the state's new masters (`apply`), since adding updates to a
    narrow copy would round differently from casting the new master.
    """

    def init(params):
        return MasterState(params, tx.init(params))

    def update(grads, state, params=None):
        del params  # the master weights are the parameters being optimised
        updates, inner = tx.update(grads, state.inner, state.master)
        return updates, MasterState(optax.apply_updates(state.master, updates), inner)

    return optax.GradientTransformation(init, update)


def apply(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
          to_working: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(new parameters, new optimizer state) after one update.

    With master weights the parameters are the working copy cast from the
    new master weights (`to_working`); otherwise optax's updates are added.
    """
    updates, opt_state = tx.update(grads, opt_state, params)
    if isinstance(opt_state, MasterState):
        return to_working(opt_state.master), opt_state
    return optax.apply_updates(params, updates), opt_state


def cast_to(dtypes: Any) -> Callable[[Any], Any]:
    """Casts a parameter tree leaf by leaf to `dtypes` (a tree of dtypes)."""
    return lambda tree: jax.tree.map(lambda x, d: x.astype(d), tree, dtypes)
