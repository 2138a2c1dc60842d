"""Mixed precision: which dtype each model state and computation uses.

One policy, applied in three places: `Hooks` cast a parameter to the compute
dtype before it is gathered and its gradient to the gradient dtype before it
is reduced; the stored parameters are created in the parameter dtype
(`cast_tree`, state.py); `with_state_dtype` keeps the optimizer state in its
dtype.

The ZeRO paper counts 2 + 2 + 12 = 16 bytes per parameter for bf16 training
with Adam: a bf16 working copy, bf16 gradients, and float32 master weights,
momentum and variance. Where parameters and optimizer state are stored
alike (ZeRO-0 and ZeRO-3) the float32 parameters are the master weights and
are cast at use: 4 + gradient bytes + 8. At ZeRO-1 and 2 a working copy is
stored beside float32 masters kept in the sharded optimizer state
(master.py). analysis/memory.py reads the bytes per parameter off the
abstract state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# name -> (params, compute, grads, opt_state)
PRESETS: dict[str, tuple[str, str, str, str]] = {
    "fp32": ("float32", "float32", "float32", "float32"),
    "bf16": ("float32", "bfloat16", "float32", "float32"),
    "fp16": ("float32", "float16", "float32", "float32"),
    "fp8": ("float32", "bfloat16", "float32", "float32"),  # bf16, the blocks' projections in FP8
}
FP8 = ("fp8",)  # the presets whose blocks' projections multiply in FP8


@dataclasses.dataclass(frozen=True)
class Policy:
    params: str = "float32"  # stored (master) parameters
    compute: str = "float32"  # matmuls and activations; parameters are cast to it at use
    grads: str = "float32"  # gradients: reduced, accumulated and held in this dtype
    opt_state: str = "float32"  # floating optimizer-state leaves (moments)
    fp8: bool = False  # the blocks' projections multiply in FP8 (model/fp8.py)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.name == "fp8":
                continue
            value = getattr(self, field.name)
            if value not in DTYPES:
                raise ValueError(f"{field.name} dtype {value!r}: choose from {', '.join(DTYPES)}")

    def dtype(self, which: str):
        return DTYPES[getattr(self, which)]

    @property
    def needs_loss_scaling(self) -> bool:
        return self.compute == "float16" or self.grads == "float16"

    def describe(self) -> str:
        return (f"parameters {self.params}, compute {self.compute}, gradients {self.grads}, "
                f"optimizer state {self.opt_state}"
                + (", the blocks' projections in FP8 (e4m3 forward, e5m2 gradients)"
                   if self.fp8 else ""))


def resolve(name: str, platform: str, **overrides: str) -> Policy:
    """A preset by name ("auto": bf16 on accelerators, fp32 on CPU), then overrides."""
    if name == "auto":
        name = "fp32" if platform == "cpu" else "bf16"
    if name not in PRESETS:
        raise ValueError(f"--precision {name!r}: choose auto or one of {', '.join(PRESETS)}")
    fields = dict(zip(("params", "compute", "grads", "opt_state"), PRESETS[name]))
    fields.update({k: v for k, v in overrides.items() if v})
    return Policy(**fields, fp8=name in FP8)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def cast_tree(tree: Any, dtype) -> Any:
    """Floating leaves to `dtype`; integer leaves (counts) unchanged."""
    return jax.tree.map(lambda x: x.astype(dtype) if _is_float(x) else x, tree)


def with_state_dtype(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`tx` whose floating state is stored in `dtype` and updated in float32.

    Wrapped for float32 too: optax makes its moments in the parameters'
    dtype, so bfloat16 parameters would get bfloat16 moments at init and
    float32 ones after the first update (its arithmetic promotes), and the
    state the step was compiled for would not be the state it is given."""
    def init(params):
        return cast_tree(tx.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = tx.update(updates, cast_tree(state, jnp.float32), params)
        return updates, cast_tree(state, dtype)

    return optax.GradientTransformation(init, update)
