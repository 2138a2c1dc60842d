"""The XLA options a step asks for, spelled as the running XLA spells them.

zero_jax asks XLA for a few scheduling behaviours (overlap.py, offload.py).
XLA names them by compile options, and those names move between releases:
jaxlib 0.11.1 replaced `xla_gpu_enable_pipelined_all_gather = true` with
`xla_gpu_pipeline_all_gather = "COLLECTIVE_PIPELINING_MODE_ON"`, and an XLA
rejects a name it does not know for every backend ("No such compile option"),
so a stale name fails every compile, not only the GPU's. Each behaviour is
therefore a `Want`: the backend it applies to and its spellings, newest
first. `spell` keeps the wants of the running backend (other backends ignore
them, and leaving them out keeps those programs' cache keys free of them) and
takes, for each, the first spelling this XLA compiles with, found once per
process by compiling an empty program (`accepted`). A want that no spelling
of fits this XLA is left out with a warning: it is a schedule, not a result,
so the step still runs, slower, and the warning says which option to look up.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import jaxlib

Value = bool | int | str


@dataclasses.dataclass(frozen=True)
class Want:
    """A behaviour asked of XLA: the backend it applies to, and the options
    that ask for it in each XLA release, newest first."""

    backend: str  # the platform whose compiler reads it (jax.default_backend()'s name)
    spellings: tuple[tuple[str, Value], ...]  # (option, value), newest XLA first


# Each want lists the spellings of the releases pyproject.toml admits (jaxlib
# 0.11.2 and later); a rename in a new release goes in front of its want.
_ON = "COLLECTIVE_PIPELINING_MODE_ON"

# XLA:GPU's collective pipeliner on the all-gathers inside a loop: each
# iteration's gather issued an iteration early (overlap.py).
PIPELINE_ALL_GATHER = Want("gpu", (("xla_gpu_pipeline_all_gather", _ON),))
# ... and on the reductions: each finished an iteration late (overlap.py).
PIPELINE_REDUCE_SCATTER = Want("gpu", (("xla_gpu_pipeline_reduce_scatter", _ON),))
# A while loop unrolled in pairs, so the next iteration's host-to-device copy
# starts while this one computes (offload.py).
WHILE_LOOP_DOUBLE_BUFFERING = Want("gpu", (("xla_gpu_enable_while_loop_double_buffering", True),))


def spell(wants: tuple[Want, ...], backend: str | None = None) -> dict[str, Value] | None:
    """The compile options for `wants` on `backend` (the running one by
    default), one accepted spelling each; None when none applies."""
    backend = backend or jax.default_backend()
    options: dict[str, Value] = {}
    for want in wants:
        if want.backend == backend and (spelling := accepted(want)) is not None:
            options[spelling[0]] = spelling[1]
    return options or None


@functools.cache
def accepted(want: Want) -> tuple[str, Value] | None:
    """The first of `want`'s spellings that this XLA compiles with, or None
    (with a warning naming them and the jaxlib release)."""
    empty = jax.jit(lambda x: x).lower(jax.ShapeDtypeStruct((), jnp.float32))
    for name, value in want.spellings:
        try:
            empty.compile(compiler_options={name: value})
        except Exception as error:  # XLA raises its own status error type
            if name not in str(error):
                raise
            continue
        return name, value
    names = ", ".join(f"{n}={v!r}" for n, v in want.spellings)
    warnings.warn(f"this XLA (jaxlib {jaxlib.__version__}) accepts none of {names}; the step "
                  f"compiles without it. Look up its current name in XLA's debug_options_flags.cc "
                  f"and add it to zero_jax/runtime/xla_options.py.", RuntimeWarning, stacklevel=2)
    return None
