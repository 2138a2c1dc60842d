"""The two calls a model makes to place its tensors: `act` and `weight`.

A model names logical axes and nothing else; these hooks turn the names into
sharding constraints for the current mesh and rules. Without a mesh they are
the identity, so a model runs unchanged on one device.

Constraining each activation to the batch split tells XLA to move weights
rather than activations, and constraining each weight to its compute layout
at the point of use is what makes a ZeRO-3 parameter, stored sharded, get
all-gathered one layer at a time inside the scanned stack.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from zero_jax.rules import AxisRules


@dataclasses.dataclass(frozen=True)
class Hooks:
    """Sharding constraints by logical name; identity when `mesh` is None."""

    mesh: Mesh | None = None  # the mesh the step runs on
    rules: AxisRules | None = None  # logical -> mesh axes

    def _constrain(self, x: jax.Array, names: Sequence[str | None], what: str) -> jax.Array:
        if self.mesh is None:
            return x
        spec = self.rules.spec(names, x.shape, dict(self.mesh.shape), what=what)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def act(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """An activation, laid out by the rules (batch over the data axes)."""
        return self._constrain(x, names, f"activation {tuple(names)}")

    def weight(self, w: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """A parameter at its point of use, in its compute layout."""
        return self._constrain(w, names, f"weight {tuple(names)}")
