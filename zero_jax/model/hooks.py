"""What a model calls to place, cast and name its tensors, and to use its
parameters.

A model names logical axes and nothing else; these hooks turn the names into
sharding constraints for the current mesh and rules, apply the precision
policy, and carry the activation-checkpointing policy. Without a mesh they
only cast, so a model runs unchanged on one device.

Constraining each activation to the batch split tells XLA to move weights
rather than activations. A parameter is used through one of three calls:

    dense(eq, x, w, names)   w in a matrix product (einsum `eq`, x first)
    lookup(w, ids, names)    rows of w (an embedding table)
    weight(w, names, dtype)  w in elementwise work (LayerNorm, biases)

and `gathered(w, names)` gathers w once for several of these (a tied
embedding's lookup and head).

Each casts w to the compute dtype (LoRA's quantized base: dequantizes it),
gathers it into its compute layout and, in the backward pass, computes and
reduces its gradient in the gradient dtype into the stored layout
(param_use.py, the custom VJPs that do it).

`per_shard(axes)` gives the hooks for the rows of one shard of the batch
over some data-parallel axes, run under `vmap` over those shards
(accumulate.py): the batch is split only over the other data-parallel axes,
and gradients are reduced over those only, so what comes out is this
device's partial sum over `axes`, to be reduced once per optimizer step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zero_jax.model import base_quant, fp8_dense, param_use
from zero_jax.context import attention as context_attention
from zero_jax.context import order as context_order
from zero_jax.context.order import Context
from zero_jax.model.lora import Lora
from zero_jax.model.param_use import ManualRows, Tapped, Use, block_rows, inside_only, psum, put
from zero_jax.model.remat import DOT, WEIGHT, Remat
from zero_jax.sharding.rules import AxisRules
from zero_jax.sharding.specs import entry_axes
from zero_jax.sharding.zero import Placement


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """Tables whose rows are split in contiguous blocks over a manual mesh
    axis (a pipeline, inside `shard_map`): each device holds block
    `axis_index(axis)` of every table whose rows `tables` names, and of the
    logits over the vocabulary's; the other tables are whole."""

    axis: str
    size: int  # the axis's size: the number of blocks
    widen: bool = False  # sum bf16 in float32 (`psum`)
    tables: tuple[str, ...] = ("vocab",)  # logical names of the row dimensions split

    def splits(self, names: Sequence[str | None]) -> bool:
        """Whether a table with logical axes `names` is held in row blocks."""
        return names[0] in self.tables

    def block(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one device's block of a table of `shape`."""
        return (shape[0] // self.size, *shape[1:])

    def offset(self, rows: int) -> jax.Array:
        """The global index of this device's first row, of `rows` per device."""
        return jax.lax.axis_index(self.axis) * rows

    def sum(self, x: jax.Array) -> jax.Array:
        return psum(x, self.axis, self.widen)


class Gathered(NamedTuple):
    """A parameter gathered once (Hooks.gathered), for `lookup` and `dense`."""

    table: jax.Array  # in the compute layout, in the gradient dtype; split: (shards, ...)
    names: tuple  # its logical axes
    axes: tuple | None  # the batch axes of the leading per-shard dimension, if split


@dataclasses.dataclass(frozen=True)
class Hooks:
    """Sharding, precision and rematerialisation, by logical name."""

    mesh: Mesh | None = None  # the mesh the step runs on (None: one device, no constraints)
    rules: AxisRules | None = None  # logical -> mesh axes
    compute_dtype: str = "float32"  # parameters are cast to this at use
    grad_dtype: str = "float32"  # parameter gradients are computed and reduced in this dtype
    remat: Remat = Remat()  # which block activations the backward pass keeps
    stored: Placement | None = None  # ZeRO split of stored parameters (stage 3), else None
    partial_grads: bool = False  # leave gradients unreduced in the compute layout (per_shard)
    rows: RowSplit | None = None  # tables are row blocks over a manual axis (lookup, vocab_ids)
    host_params: bool = False  # stored parameters are in host memory, fetched at each use
    attention: str = "xla"  # layers.attention: xla (written out) | cudnn (fused)
    scan_layers: bool = True  # False: the layer stack is unrolled (one copy of each layer in the program)
    context: Context | None = None  # the sequence split over `context`: strategy and order
    vmapped: tuple[str, ...] = ()  # mesh axes a vmap over batch shards maps to (per_shard)
    # The products that ask (`dense(fp8=True)`) multiply in FP8 (fp8.py), with
    # "current" or "delayed" scaling; "": none do. Delayed: histories this long.
    fp8: str = ""
    fp8_history: int = 1024
    # A mixture's dropless experts: grouped.GEMMS and exchange.EXCHANGES, or auto.
    expert_gemm: str = "auto"
    expert_exchange: str = "auto"
    expert_node: int = 0  # devices of the expert axis per node, two hops (exchange.node_size); 0: one
    # > 0: stored-sharded (ZeRO-3) parameters are gathered in int8 blocks of about
    # this many elements (ZeRO++'s qwZ, sharding/quantized.py)
    int8_gather_block: int = 0
    # > 0: weight gradients reduced on the spot (ZeRO-3) go through int8 blocks
    # of about this many elements (ZeRO++'s qgZ, sharding/quantized.py)
    int8_reduce_block: int = 0
    lora: Lora | None = None  # the projections that carry low-rank adapters (None: none)

    def per_shard(self, axes: Sequence[str]) -> "Hooks":
        """These hooks for one shard of the batch over the data-parallel mesh
        `axes`, under `vmap` over the shards (its spmd axes: `axes`).

        The batch stays split over the other data-parallel axes. A stored
        (ZeRO-3) gradient is still reduce-scattered into its shard over the
        ZeRO axes, unless they are among `axes`; then it is left unreduced.
        """
        batch = tuple(a for a in self.rules.mesh_axes("batch") if a not in axes)
        crosses = self.stored is not None and bool(set(self.stored.axes) & set(axes))
        return dataclasses.replace(self, rules=self.rules.replace(batch=batch),
                                   partial_grads=crosses, vmapped=(*self.vmapped, *axes))

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)

    def _sharding(self, shape, names: Sequence[str | None], what: str):
        if self.mesh is None:
            return None
        spec = self.rules.spec(names, shape, dict(self.mesh.shape), what=what)
        return NamedSharding(self.mesh, spec)

    def _use(self, w, names, dtype=None) -> Use:
        compute = self._sharding(w.shape, names, f"weight {tuple(names)}")
        stored = None
        if compute is not None and self.stored is not None:
            stored = NamedSharding(self.mesh, self.stored.spec(w.shape, compute.spec, names))
        return Use(stored, compute, jnp.dtype(dtype or self.dtype), jnp.dtype(self.grad_dtype),
                   w.dtype, None if self.partial_grads else stored,
                   fetch=stored if self.host_params else None, flat_rows=self._rows_merge(),
                   manual_rows=self._manual_rows(compute), int8_block=self.int8_gather_block,
                   int8_reduce_block=self.int8_reduce_block, batch_axes=self._batch_axes())

    def _batch_axes(self) -> tuple[str, ...]:
        """The mesh axes of size > 1 the batch is split over (qgZ's partial sums)."""
        if self.mesh is None or self.rules is None or not self.int8_reduce_block:
            return ()
        return tuple(a for a in self.rules.mesh_axes("batch") if self.mesh.shape[a] > 1)

    def _manual_rows(self, compute: NamedSharding | None) -> ManualRows | None:
        """Inside a pipeline's shard_map (`rows`), the mesh axes of size > 1
        that split a table's rows in its compute layout, which a lookup
        splits by hand (param_use.ManualRows); elsewhere None."""
        if self.rows is None or compute is None or not compute.spec:
            return None
        axes = tuple(a for a in entry_axes(compute.spec[0]) if self.mesh.shape[a] > 1)
        return ManualRows(axes, self._widen_local, self.vmapped) if axes else None

    def _rows_merge(self) -> bool:
        """Whether a weight gradient may merge its operands' batch and
        sequence dimensions into one: not when the sequence is split over
        devices as well as the batch, a split a merged dimension cannot hold."""
        if self.mesh is None:
            return True
        sizes = dict(self.mesh.shape)
        return all(sizes[a] == 1 for a in self.rules.mesh_axes("seq"))

    def act(self, x: jax.Array, names: Sequence[str | None], name: str | None = None) -> jax.Array:
        """An activation, laid out by the rules; `name` tags it for remat policies."""
        x = put(x, self._sharding(x.shape, names, f"activation {tuple(names)}"))
        return checkpoint_name(x, name) if name else x

    def weight(self, w: jax.Array, names: Sequence[str | None], dtype=None) -> jax.Array:
        """A parameter for elementwise use, in `dtype` (default: the compute dtype)."""
        if isinstance(w, Tapped):  # only a product's weights have taps: nothing to record
            w = w.w
        w = param_use.weight(self._use(w, names, dtype), w)
        return checkpoint_name(w, WEIGHT)  # never kept for backward: gathered again

    def dense(self, eq: str, x: jax.Array, w: jax.Array, names: Sequence[str | None],
              fp8: bool = False, history: jax.Array | None = None) -> jax.Array:
        """einsum(eq, x, w) with w in the compute dtype and layout. `fp8`: a
        projection of a block, which multiplies in FP8 where the precision
        policy says so; the embedding, head and router never ask. Under
        delayed scaling `history` is its amax history (`fp8_history`)."""
        if isinstance(w, base_quant.Quantized):  # LoRA's frozen base, stored quantized
            return checkpoint_name(self._frozen_dense(eq, x, w, names), DOT)
        fp8 = fp8 and bool(self.fp8)
        if fp8 and isinstance(w, (Gathered, Tapped)):  # train/checks.py refuses both
            raise ValueError("an FP8 product on a table or under a split backward")
        if fp8:
            if self.fp8 == "current":
                history = None
            elif history is None:
                raise ValueError(f"delayed FP8 scaling: the product of weight {tuple(names)} "
                                 "has no amax history (models/common/layers.py projection)")
            else:
                history = self.weight(history, (None,) * history.ndim, jnp.float32)
            return checkpoint_name(fp8_dense.dense(self._use(w, names), eq, x, w, history), DOT)
        if isinstance(w, Gathered):
            y = self._on_gathered(lambda use, x, t: param_use.dense(use, eq, x, t), w, names, x)
        elif isinstance(w, Tapped):  # a split backward (pipeline/weight_grad.py)
            use = self._use(w.w, names)
            if w.x is None:  # finding the products: record this one
                y = param_use.dense(use, eq, x, w.w)
                w.seen.record(eq, tuple(names), x, y)
            else:
                y = param_use.tapped_dense(use, eq, x, w.w, w.x, w.y)
        else:
            y = param_use.dense(self._use(w, names), eq, x, w)
        return checkpoint_name(y, DOT)  # a matrix product, for dots_saveable

    def _frozen_dense(self, eq: str, x: jax.Array, w: base_quant.Quantized, names) -> jax.Array:
        """einsum(eq, x, w) of a quantized frozen w (not gathered by qwZ: quantized)."""
        scale_names = base_quant.names(w.fmt, tuple(names), w.codes.shape, self.rules,
                                       dict(self.mesh.shape) if self.mesh else {})
        uses = tuple(dataclasses.replace(self._use(a, n, a.dtype), int8_block=0)
                     for a, n in ((w.codes, names), (w.scale, scale_names)))
        return base_quant.frozen_dense(uses, eq, w.fmt, self.dtype, x, w.codes, w.scale)

    def dense_weight_grad(self, eq: str, x: jax.Array, g: jax.Array, w: jax.ShapeDtypeStruct,
                          names: Sequence[str | None]) -> jax.Array:
        """The gradient of w in `dense(eq, x, w, names)` from x and the
        product's output gradient g, as the product's backward makes it."""
        return param_use.dense_weight_grad(self._use(w, names), eq, x, g)

    def lookup(self, w: jax.Array, ids: jax.Array, names: Sequence[str | None],
               out_dtype=None) -> jax.Array:
        """Rows `ids` of the table w, gathered in the compute dtype and returned
        in `out_dtype` (default: the compute dtype). Rows returned in float32
        get a float32 gradient: a sum over the batch that then reaches the
        reduction across devices unrounded."""
        out_dtype = jnp.dtype(out_dtype or self.dtype)
        if isinstance(w, Gathered):
            return self._on_gathered(lambda use, i, t: param_use.lookup(use, out_dtype, t, i),
                                     w, names, ids)
        if self.rows is not None and self.rows.splits(names):
            # This device's block of rows: each id is read where it is
            # stored, zeros elsewhere, and the blocks' results summed (one
            # nonzero term each, so the sum is exact in any dtype).
            at, inside = block_rows(ids, self.rows.offset(w.shape[0]), w.shape[0])
            y = param_use.lookup(self._use(w, names), out_dtype, w, at)
            return self.rows.sum(inside_only(y, inside))
        return param_use.lookup(self._use(w, names), out_dtype, w, ids)

    def table_shape(self, shape: tuple[int, ...], names: Sequence[str | None]) -> tuple[int, ...]:
        """The shape a table parameter of `shape` and logical axes `names`
        has here: this device's block of rows where `rows` splits it, else
        the whole."""
        return self.rows.block(shape) if self.rows is not None and self.rows.splits(names) else shape

    def vocab_ids(self, n: int) -> jax.Array:
        """Global indices of the last dimension's n entries of logits over a
        table's rows: 0..n-1, or this device's block under `rows`."""
        ids = jnp.arange(n)
        split = self.rows is not None and self.rows.splits(("vocab",))
        return ids + self.rows.offset(n) if split else ids

    @property
    def _widen_local(self) -> bool:
        """XLA:CPU aborts on a bf16 all-reduce inside shard_map (`psum`)."""
        return isinstance(self.mesh, Mesh) and self.mesh.devices.flat[0].platform == "cpu"

    def axis_of(self, logical: str) -> str | tuple[str, ...] | None:
        """The mesh axes (of size > 1) that split the logical axis, for a
        collective inside `local`: one name, a tuple, or None if unsplit."""
        if self.mesh is None:
            return None
        axes = tuple(a for a in self.rules.mesh_axes(logical) if self.mesh.shape[a] > 1)
        return axes[0] if len(axes) == 1 else (axes or None)

    def local(self, fn, in_names: Sequence[Sequence[str | None]],
              out_names: Any) -> Callable:
        """`fn` run on each device's blocks of its arguments (shard_map),
        the arguments and results laid out by logical names (`in_names`
        one tuple per argument, `out_names` a tree of tuples like the
        results). The mesh axes those names split are manual inside, where
        `fn` may use them in collectives (`axis_of`); the others stay
        automatic. Without a mesh, `fn` itself.

        An argument unsplit over a manual axis has its gradient summed over
        it, where it first meets a value split there. On CPU every floating
        argument is marked as varying over those axes on entry, a 16-bit
        one in float32 and cast back after, so that the sums run at the
        entry in float32 (XLA:CPU aborts on a bf16 all-reduce there, `psum`)."""
        if self.mesh is None:
            return fn
        sizes = dict(self.mesh.shape)

        def spec(names):
            return PartitionSpec(*(self.axis_of(n) if n else None for n in names))

        def axes(spec):
            return {a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))}

        def run(*args):
            in_specs = tuple(self.rules.spec(n, a.shape, sizes, what=f"{fn.__name__} input")
                             for n, a in zip(in_names, args))
            out_specs = jax.tree.map(spec, out_names, is_leaf=lambda n: isinstance(n, tuple))
            manual = set().union(*map(axes, in_specs), *map(axes, jax.tree.leaves(
                out_specs, is_leaf=lambda s: isinstance(s, PartitionSpec))))
            vary = [self._widen_local and jnp.issubdtype(a.dtype, jnp.floating)
                    and bool(manual - axes(s)) for a, s in zip(args, in_specs)]

            def body(*xs):
                return fn(*(jax.lax.pcast(x, tuple(sorted(manual - axes(s))), to="varying")
                            .astype(a.dtype) if v else x
                            for x, a, s, v in zip(xs, args, in_specs, vary)))

            wide = [a.astype(jnp.float32) if v and a.dtype.itemsize < 4 else a
                    for a, v in zip(args, vary)]
            return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                                 axis_names=manual)(*wide)

        return run

    # -- the sequence over `context` (zero_jax/context) ----------------------
    def sequence_order(self, T: int):
        """The natural index of each slot of a laid-out sequence of T
        tokens (context/order.py), or None where the order is natural."""
        if self.context is None or self.context.size == 1:
            return None
        return self.context.order(T)

    def positions(self, T: int, segments_BxT=None):
        """Each laid-out token's position ((1 or B) x T) under a context
        split; None without one (the model's own positions apply)."""
        order = self.sequence_order(T)
        return None if order is None else context_order.positions(order, T, segments_BxT)

    def attend(self, attention: Callable, q, k, v, *, window: int = 0,
               keep: Callable = lambda p: p, segments_BxT=None):
        """Causal attention: `attention(q, k, v, implementation, window,
        keep, segments_BxT)`, the model's, or across `context` where the
        sequence is split over it (context/attention.py)."""
        if self.mesh is None or self.context is None or self.context.size == 1:
            return attention(q, k, v, self.attention, window, keep=keep, segments_BxT=segments_BxT)
        return context_attention.attend(self, self.context, attention, q, k, v, window,
                                        segments_BxT)

    def gathered(self, w: jax.Array, names: Sequence[str | None]) -> "Gathered":
        """w gathered once for several uses (a tied embedding's lookup and
        head): `lookup` and `dense` take the result in place of w, with the
        batch as the leading dimension of their other operand.

        The copy is gathered in the compute dtype and kept until its last
        use, as FSDP keeps its root module's parameters through the forward
        pass. The uses' gradients are summed on the device, in the gradient
        dtype, and reduced once instead of once per use: where the gradient
        is reduced on the spot (ZeRO-3, per microbatch), each batch shard's
        copy gets its own partial sum, a full-size gradient held through the
        backward pass, as FSDP holds its root's unsharded gradient.
        """
        use = self._use(w, names)
        axes = self._split_axes()
        split = None
        if axes:
            compute = use.compute.spec if use.compute is not None else ()
            split = NamedSharding(self.mesh, PartitionSpec(axes, *compute))
        return Gathered(param_use.gather_once(use, split, w), tuple(names), axes)

    def _split_axes(self) -> tuple[str, ...] | None:
        """The batch axes over which a gathered table's uses keep per-shard
        gradients: where this device's gradients are reduced on the spot."""
        if self.mesh is None or self.stored is None or self.partial_grads:
            return None
        axes = tuple(a for a in self.rules.mesh_axes("batch") if self.mesh.shape[a] > 1)
        return axes or None

    def _on_gathered(self, fn, g: "Gathered", names, x):
        """fn(use, x, table) for a table from `gathered`; x's leading dimension is the batch."""
        if tuple(names) != g.names:
            raise ValueError(f"a table gathered as {g.names} is used as {tuple(names)}")
        shape = g.table.shape[1:] if g.axes else g.table.shape
        compute = self._sharding(shape, names, f"weight {tuple(names)}")
        # Already in the compute layout: no gather here, and no reduction.
        use = Use(None, compute, self.dtype, jnp.dtype(self.grad_dtype), g.table.dtype,
                  None, gathered=True)
        if not g.axes:
            return fn(use, x, g.table)
        n = g.table.shape[0]
        if x.shape[0] % n:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into {n} shards")
        x_n = put(x.reshape(n, x.shape[0] // n, *x.shape[1:]),
                  NamedSharding(self.mesh, PartitionSpec(g.axes)))
        y_n = jax.vmap(functools.partial(fn, use), spmd_axis_name=g.axes)(x_n, g.table)
        return y_n.reshape(x.shape[0], *y_n.shape[2:])
