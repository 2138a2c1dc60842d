"""Grouped matrix products for dropless experts: rows sorted by group (an
expert), each group's rows times that group's matrix, `counts_G` rows each;
rows past the counts' sum come out zero.

Two implementations (`GEMMS`):

- `ragged_dot`: `jax.lax.ragged_dot`. On GPU and TPU jax lowers it to XLA's
  ragged-dot instruction, which is a grouped GEMM where the backend has a
  kernel for it (TPU; cuDNN's or hipBLASLt's grouped GEMM where they
  apply) and otherwise expanded to zero-padded dense matrices (XLA's CUDA
  default, as its own Triton ragged-dot work describes). On XLA:CPU jax
  lowers it densely itself. Dense, it is G times the routed rows' FLOPs.
- `tiled`: the rows cut into tiles of `tile` rows, each inside one group (a
  group's last tile partial), one small product per tile in a loop that
  runs only the tiles the counts fill: the routed rows' FLOPs plus at most
  one partial tile per group, whatever the buffer's worst-case size. This
  is what a grouped-GEMM kernel does (MegaBlocks, megablox) written as an
  XLA while loop, so any backend runs it. Its VJP is two more such loops:
  the rows' gradient (the same tiles times the transposed matrices) and
  each group's matrix gradient (its tiles' outer products summed).

`tile_rows` picks a tile that bounds the partial tiles' waste to 1/16 of
the rows a device expects; `executed_rows` is what the loop multiplies.
`auto` is `tiled` on every backend: its FLOPs are the routed ones wherever
it runs, which ragged_dot's are only where a grouped kernel takes it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

GEMMS = ("ragged_dot", "tiled")
MAX_TILE = 128  # rows: a GPU kernel's tile; CPU tiles are smaller where the rows are few


class Tiles(NamedTuple):
    """The tiles the loop runs, in row order: T_max slots, the first `count` used."""

    group_T: jax.Array  # int32: each tile's group
    start_T: jax.Array  # int32: its first row
    rows_T: jax.Array  # int32: its rows inside its group (tile, or fewer for a group's last)
    count: jax.Array  # int32 scalar: tiles the counts fill


def tile_rows(expected_rows: int, groups: int) -> int:
    """A power of two at most MAX_TILE that keeps the partial tiles' padding,
    at most groups x (tile - 1) rows, within 1/16 of `expected_rows`."""
    fit = max(1, expected_rows // (16 * max(groups, 1)))
    return min(MAX_TILE, 1 << (fit.bit_length() - 1))


def plan(counts_G: jax.Array, tile: int, rows: int) -> Tiles:
    """Tiles of `tile` rows over `rows` rows sorted by group (counts_G each):
    at most ceil(rows / tile) + G of them, each within one group."""
    G = counts_G.shape[0]
    counts = counts_G.astype(jnp.int32)
    per = (counts + tile - 1) // tile
    ends = jnp.cumsum(per)
    t = jnp.arange(-(-rows // tile) + G, dtype=jnp.int32)
    # Tile t's group: how many groups end at or before it. (Not jnp.searchsorted,
    # which jax 0.11.2 fails to trace inside a step's dispatch: an assertion on
    # the manual axes its operands vary over.)
    group = jnp.minimum(jnp.sum(ends[None, :] <= t[:, None], axis=1), G - 1).astype(jnp.int32)
    within = t - (ends - per)[group]
    start = (jnp.cumsum(counts) - counts)[group] + within * tile
    return Tiles(group, start, jnp.clip(counts[group] - within * tile, 0, tile), ends[-1])


def executed_rows(counts_G: jax.Array, tile: int) -> jax.Array:
    """Rows the tiled loop multiplies for these counts (its FLOPs over 2 K N)."""
    return jnp.sum((counts_G + tile - 1) // tile) * tile


def _varying_axes(x) -> frozenset:
    """The manual mesh axes x varies over (none outside shard_map)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return getattr(mat, "varying", frozenset())


def _varying(zeros: jax.Array, *like: jax.Array) -> jax.Array:
    """`zeros` marked varying over the manual mesh axes `like` vary over,
    so a loop's carry has the type its body gives it (inside shard_map)."""
    axes = set().union(*(_varying_axes(x) for x in like))
    return jax.lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


def _tile_of(x_pad, tiles: Tiles, t, tile: int):
    """Tile t's rows of x (padded by `tile` rows), rows past its group zeroed."""
    rows = jax.lax.dynamic_slice_in_dim(x_pad, tiles.start_T[t], tile)
    keep = jnp.arange(tile) < tiles.rows_T[t]
    return jnp.where(keep[:, None], rows, jnp.zeros_like(rows))


def _products(x_RxK, w_GxKxN, tiles: Tiles, tile: int) -> jax.Array:
    """Each tile times its group's matrix, written in row order: a group's
    partial last tile writes zeros past its rows, which the next group's
    first tile then overwrites (tiles run in row order)."""
    R = x_RxK.shape[0]
    x_pad = jnp.pad(x_RxK, ((0, tile), (0, 0)))
    out = _varying(jnp.zeros((R + tile, w_GxKxN.shape[2]), x_RxK.dtype), x_RxK, w_GxKxN,
                   *tiles)

    def body(t, out):
        y = jnp.dot(_tile_of(x_pad, tiles, t, tile), w_GxKxN[tiles.group_T[t]],
                    preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), tiles.start_T[t], 0)

    return jax.lax.fori_loop(0, tiles.count, body, out)[:R]


def _matrix_grads(x_RxK, dy_RxN, tiles: Tiles, tile: int, G: int) -> jax.Array:
    """Each group's sum over its tiles of x_tile^T dy_tile, in float32."""
    x_pad = jnp.pad(x_RxK, ((0, tile), (0, 0)))
    dy_pad = jnp.pad(dy_RxN, ((0, tile), (0, 0)))
    dw = _varying(jnp.zeros((G, x_RxK.shape[1], dy_RxN.shape[1]), jnp.float32), x_RxK, dy_RxN,
                  *tiles)

    def body(t, dw):
        g = tiles.group_T[t]
        dy = jax.lax.dynamic_slice_in_dim(dy_pad, tiles.start_T[t], tile)
        part = jnp.dot(_tile_of(x_pad, tiles, t, tile).T, dy, preferred_element_type=jnp.float32)
        return dw.at[g].add(part)

    return jax.lax.fori_loop(0, tiles.count, body, dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tiled(x_RxK: jax.Array, w_GxKxN: jax.Array, counts_G: jax.Array, tile: int) -> jax.Array:
    """x (rows sorted by group) times each group's matrix, tile by tile."""
    x_RxK, w_GxKxN = jnp.asarray(x_RxK), jnp.asarray(w_GxKxN)
    return _products(x_RxK, w_GxKxN, plan(counts_G, tile, x_RxK.shape[0]), tile)


def _tiled_fwd(x, w, counts, tile):
    return tiled(x, w, counts, tile), (x, w, counts)


def _tiled_bwd(tile, residuals, dy):
    x, w, counts = residuals
    tiles = plan(counts, tile, x.shape[0])
    dx = _products(dy.astype(x.dtype), jnp.swapaxes(w, 1, 2), tiles, tile)
    dw = _matrix_grads(x, dy, tiles, tile, w.shape[0])
    return _summed_like(dx, x), _summed_like(dw, w).astype(w.dtype), None


def _summed_like(ct, primal):
    """A cotangent summed over the manual axes it varies over and its primal
    does not (a weight the same on every device of `data` gets the sum of
    their gradients), as autodiff of an implicit broadcast would."""
    extra = _varying_axes(ct) - _varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


tiled.defvjp(_tiled_fwd, _tiled_bwd)


def resolve(choice: str) -> str:
    """The implementation `choice` names; `auto`: tiled (see above)."""
    if choice == "auto":
        return "tiled"
    if choice not in GEMMS:
        raise ValueError(f"--expert-gemm {choice}: expected auto or one of {', '.join(GEMMS)}")
    return choice


def product(gemm: str, counts_G: jax.Array, expected_rows: int):
    """`fn(x, w)`: the grouped product `gemm` names over these counts."""
    if gemm == "ragged_dot":
        return lambda x, w: jax.lax.ragged_dot(x, w, counts_G)
    if gemm == "tiled":
        tile = tile_rows(expected_rows, counts_G.shape[0])
        return lambda x, w: tiled(x, w, counts_G, tile)
    raise ValueError(f"grouped GEMM {gemm!r}: expected one of {', '.join(GEMMS)}")

