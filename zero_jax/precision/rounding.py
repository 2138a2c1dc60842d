"""A traced step without the rounding no-ops that remat adds to it.

`jax.checkpoint` rounds every value it keeps for the backward pass to its
own dtype (`reduce_precision` with the dtype's exponent and mantissa bits),
so that the forward and the backward read the same value where XLA would
otherwise hold a 16-bit intermediate in float32 ("excess precision",
jax-ml/jax#22244). A float32 value has no excess precision on any backend:
rounding it to float32 is the identity. XLA:GPU deletes those ops itself,
after its last floating-point conversion pass; XLA:CPU keeps each one as a
copy of the kept activation, which it cannot fuse into the matmul, norm or
softmax that produced it (docs/observability.md, "What the step moves").

`without_no_op_rounding(fn)` traces `fn` to a jaxpr, drops each
`reduce_precision` whose operand is float32 or wider and whose bits are the
operand's own, in every nested jaxpr (scan and while bodies, remat, pjit,
shard_map), and evaluates the rest in its place. Roundings of 16-bit values
stay: those are the ones that change a value.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend import core


def without_no_op_rounding(fn: Callable) -> Callable:
    """`fn` (pytrees in, pytrees out, traceable), with its no-op roundings removed."""

    def stripped(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = core.jaxpr_as_fun(strip_closed(closed))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return stripped


def is_no_op(eqn: core.JaxprEqn) -> bool:
    """A `reduce_precision` of a float32-or-wider value to its own bits."""
    if eqn.primitive.name != "reduce_precision":
        return False
    dtype = eqn.invars[0].aval.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        return False
    info = jnp.finfo(dtype)
    return info.bits >= 32 and (eqn.params["exponent_bits"],
                                eqn.params["mantissa_bits"]) == (info.nexp, info.nmant)


def strip_closed(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
    return core.ClosedJaxpr(strip(closed.jaxpr, {}), closed.consts)


def strip(jaxpr: core.Jaxpr, memo: dict[int, Any]) -> core.Jaxpr:
    """`jaxpr` without no-op roundings: each one's uses read its operand."""
    if id(jaxpr) in memo:
        return memo[id(jaxpr)]
    alias: dict[core.Var, Any] = {}

    def read(v):
        return alias.get(v, v) if isinstance(v, core.Var) else v

    eqns = []
    for eqn in jaxpr.eqns:
        if is_no_op(eqn):
            alias[eqn.outvars[0]] = read(eqn.invars[0])
            continue
        eqns.append(eqn.replace(invars=[read(v) for v in eqn.invars],
                                params={k: _strip_param(p, memo) for k, p in eqn.params.items()}))
    out = jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])
    memo[id(jaxpr)] = out
    return out


def _strip_param(p: Any, memo: dict[int, Any]) -> Any:
    if isinstance(p, core.ClosedJaxpr):
        if id(p) not in memo:
            memo[id(p)] = core.ClosedJaxpr(strip(p.jaxpr, memo), p.consts)
        return memo[id(p)]
    if isinstance(p, core.Jaxpr):
        return strip(p, memo)
    if isinstance(p, tuple) and any(isinstance(x, (core.Jaxpr, core.ClosedJaxpr)) for x in p):
        return tuple(_strip_param(x, memo) for x in p)
    return p
