"""Group and tile metadata for the grouped-matmul kernels, in pure jnp (traceable, jit-safe).

Rows of lhs `[M, K]` are sorted by group: group `g` owns rows `[offsets[g], offsets[g+1])`, and
rows from `offsets[G] = sum(group_sizes)` up to `M` belong to no group (their output is zero).

Tiles straddling a group boundary (masked revisit). The M axis is cut into `tm`-row tiles that
ignore group boundaries. A tile whose rows belong to several groups is computed once per group
it touches, each time with that group's weights, and each pass stores (gmm) or accumulates
(tgmm) only the rows of its own group (a row mask). This is what jax's megablox does.
Cost: each boundary that falls inside a tile costs one extra `tm x K x N` tile product, so the
FLOPs are at most `(M / tm + G - 1) / (M / tm)` times the useful ones, e.g. +6% for
M=16384, tm=128, G=8, but +100% for M=16384, tm=128, G=128 (fine-grained experts: use a smaller
tm there). Empty groups cost nothing in gmm; tgmm visits one tile per empty group to write its
zero gradient.

Two layouts are built here:
  * `make_group_metadata` (Pallas TPU): a flat list of (group, m-tile) visits, walked in order by
    a sequential grid axis; adapted from megablox.
  * `tile_group_ranges` / `group_tile_ranges` (Pallas Triton): per m-tile the range of groups it
    touches (gmm), and per group the range of m-tiles it spans (tgmm). Each program loops over
    its range, so no two programs write the same output tile (GPU programs run concurrently).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupMetadata(NamedTuple):
    """Flat visit list for the sequential TPU kernels. V = tiles_m + G - 1 (an upper bound).

    Attributes:
      group_offsets: [G + 1] int32, row at which group g starts; group_offsets[G] = sum(sizes).
      group_ids: [V] int32, group that grid step i works on.
      m_tile_ids: [V] int32, m-tile that grid step i works on.
    """

    group_offsets: jax.Array
    group_ids: jax.Array
    m_tile_ids: jax.Array


def _searchsorted(sorted_values: jax.Array, queries: jax.Array, *, side: str) -> jax.Array:
    """`jnp.searchsorted` as one dense comparison ([queries, G] booleans summed), int32. Why:
    the default binary search lowers to a `while` loop, which on GPU copies its condition to
    the host every iteration; these tables are small (tiles or rows times groups)."""
    return jnp.searchsorted(sorted_values, queries, side=side, method="compare_all").astype(
        jnp.int32
    )


def group_offsets(group_sizes: jax.Array) -> jax.Array:
    """Exclusive cumsum with the total appended: [G] -> [G + 1] int32, offsets[0] = 0."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


def make_group_metadata(
    group_sizes: jax.Array, *, m: int, tm: int, visit_empty_groups: bool
) -> tuple[GroupMetadata, jax.Array]:
    """Visit list of (group, m-tile) pairs for a grid that walks them in order.

    Adapted from jax `pallas/ops/tpu/megablox/gmm.py::make_group_metadata` (Apache-2.0).
    Changes: no expert sharding (`start_group`/`num_nonzero_groups` removed, so no roll);
    `sum(group_sizes)` may be < m (tiles wholly past it are never visited; callers zero those
    rows); per-tile visit counts use a scatter-add instead of `jnp.histogram`.

    Args:
      group_sizes: [G] int32, rows per group, sum(group_sizes) <= m.
      m: rows of lhs; must be a multiple of tm (callers pad).
      tm: m-tile size.
      visit_empty_groups: visit one tile per empty group (tgmm needs it to write zeros).

    Returns:
      (GroupMetadata, num_tiles): num_tiles (int32 scalar) is how many leading entries of the
      visit list are real; the grid runs over all V entries and skips the rest.

    Invariants (tested): for i < num_tiles, m_tile_ids is non-decreasing (an output tile is only
    revisited consecutively), group_ids is non-decreasing, and tile m_tile_ids[i] intersects the
    rows of group group_ids[i] (or, for an empty group, is the tile holding its offset).
    """
    if m % tm:
        raise ValueError(f"m={m} must be a multiple of tm={tm}")
    num_groups = group_sizes.shape[0]
    tiles_m = m // tm
    visits = tiles_m + num_groups - 1
    group_sizes = group_sizes.astype(jnp.int32)
    offsets = group_offsets(group_sizes)
    starts, ends = offsets[:-1], offsets[1:]

    # (1) Tiles per group: round each group's start down and end up to a tile boundary.
    #     Invariant: sum over non-empty groups is in [tiles_used, tiles_used + G - 1].
    rounded_sizes = (ends + tm - 1) // tm * tm - starts // tm * tm
    group_tiles = jnp.where(group_sizes == 0, 0, rounded_sizes // tm)
    if visit_empty_groups:
        group_tiles = jnp.where(group_sizes == 0, 1, group_tiles)

    # (2) Group id of each visit, in group order. `total_repeat_length` pads with the last group;
    #     entries past num_tiles are never computed.
    group_ids = jnp.repeat(
        jnp.arange(num_groups, dtype=jnp.int32), group_tiles, total_repeat_length=visits
    )

    # (3) Visits per m-tile: 1 for the group owning the tile's first row (or for no group, if the
    #     tile is past the sum; such tiles come last and are never reached) plus 1 for every group
    #     that starts strictly inside the tile. Empty groups count as starting inside the tile
    #     holding their offset when they are visited. Groups without an extra visit, and an
    #     empty group at offset m (past the last tile), go to a dump slot `tiles_m` that is
    #     dropped; the repeat below pads with the last tile id, which is where that visit goes.
    starts_inside = (starts % tm) != 0
    extra = jnp.where(group_sizes == 0, bool(visit_empty_groups), starts_inside)
    extra_tile = jnp.where(extra, starts // tm, tiles_m)  # starts // tm <= tiles_m
    tile_visits = jnp.ones((tiles_m + 1,), jnp.int32).at[extra_tile].add(1)[:tiles_m]

    # (4) m-tile id of each visit. Output tiles are revisited only consecutively, which the
    #     sequential ("arbitrary") grid axis needs to keep a tile resident across revisits.
    m_tile_ids = jnp.repeat(
        jnp.arange(tiles_m, dtype=jnp.int32), tile_visits, total_repeat_length=visits
    )
    num_tiles = group_tiles.sum().astype(jnp.int32)
    return GroupMetadata(offsets, group_ids, m_tile_ids), num_tiles


def tile_group_ranges(group_sizes: jax.Array, *, m: int, tm: int) -> tuple[jax.Array, jax.Array]:
    """Per m-tile, the half-open range of groups whose rows it holds (gmm on GPU).

    Args:
      group_sizes: [G] int32, sum <= m.
      m: rows of (padded) lhs, a multiple of tm.
      tm: m-tile size.

    Returns:
      (first, stop): two [m // tm] int32 arrays. Tile i must be computed with groups
      first[i] <= g < stop[i]. Invariants: stop - first >= 0; a tile wholly past sum(sizes) has
      an empty range; the range may include empty groups inside the tile (their mask is empty).
    """
    offsets = group_offsets(group_sizes)
    starts, ends = offsets[:-1], offsets[1:]
    tile_lo = jnp.arange(m // tm, dtype=jnp.int32) * tm
    # (1) first group that ends after the tile's first row.
    first = _searchsorted(ends, tile_lo, side="right")
    # (2) groups that start before the tile's end.
    stop = _searchsorted(starts, tile_lo + tm, side="left")
    # (3) a tile past the sum gets first = G >= stop: clamp to an empty range.
    stop = jnp.maximum(stop, first)
    return first, stop


def group_tile_ranges(group_sizes: jax.Array, *, tm: int) -> tuple[jax.Array, jax.Array]:
    """Per group, the half-open range of m-tiles holding its rows (tgmm on GPU).

    Args:
      group_sizes: [G] int32.
      tm: m-tile size.

    Returns:
      (lo, hi): two [G] int32 arrays; group g's rows lie in tiles lo[g] <= i < hi[g]. Empty
      groups get lo = hi = 0 (no work; their gradient is the zero accumulator).
    """
    offsets = group_offsets(group_sizes)
    starts, ends = offsets[:-1], offsets[1:]
    nonempty = group_sizes > 0
    lo = jnp.where(nonempty, starts // tm, 0).astype(jnp.int32)
    hi = jnp.where(nonempty, (ends + tm - 1) // tm, 0).astype(jnp.int32)
    return lo, hi


def aligned_tile_groups(group_sizes: jax.Array, *, m: int, tm: int) -> jax.Array:
    """The group of each m-tile when every group size is a multiple of tm (Mosaic GPU gmm).

    Args:
      group_sizes: [G] int32, each a multiple of tm, sum <= m.
      m: rows of lhs, a multiple of tm.
      tm: m-tile size.

    Returns:
      [m // tm] int32: tile i holds rows of group result[i] only; G for tiles past the sum.
      Empty groups own no tile.
    """
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    tile_lo = jnp.arange(m // tm, dtype=jnp.int32) * tm
    # The first group that ends after the tile's first row (empty groups end where they start).
    return _searchsorted(ends, tile_lo, side="right")


def largest_first(group_sizes: jax.Array, *, tm: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tgmm schedule for groups aligned to tm: groups by size, largest first.

    Args:
      group_sizes: [G] int32, each a multiple of tm.
      tm: rows contracted per step.

    Returns:
      (order, first, steps), three [G] int32 arrays: order[i] is the i-th largest group (ties
      by index), first[g] its first m-tile, steps[g] its number of m-tiles (0 when empty).
    """
    sizes = group_sizes.astype(jnp.int32)
    order = jnp.argsort(-sizes, stable=True).astype(jnp.int32)
    first = (jnp.cumsum(sizes) - sizes) // tm
    return order, first.astype(jnp.int32), sizes // tm


class AlignedRows(NamedTuple):
    """Rows of unaligned groups moved so that every group starts on a tile (Mosaic GPU).

    Attributes:
      group_sizes: [G] int32, each group's size rounded up to the tile.
      source: [R] int32, the original row each aligned row holds; M for padding rows.
      dest: [M] int32, the aligned row of each original row; R for rows past sum(sizes).
    """

    group_sizes: jax.Array
    source: jax.Array
    dest: jax.Array


def aligned_rows_bound(m: int, num_groups: int, tm: int) -> int:
    """Static R >= the rows of any aligned layout of M rows in G groups: each non-empty group
    adds less than one tile, and at most min(G, M) groups are non-empty."""
    return (m // tm + min(num_groups, m)) * tm


def align_rows(group_sizes: jax.Array, *, m: int, tm: int) -> AlignedRows:
    """Pads every group to a multiple of tm rows (the layout `aligned_tile_groups` needs).

    Args:
      group_sizes: [G] int32, sum <= m.
      m: rows of lhs.
      tm: the row tile.

    Returns:
      An `AlignedRows` over R = `aligned_rows_bound(m, G, tm)` rows: gather lhs rows by
      `source` (zeros for padding), run the aligned kernel, gather output rows back by `dest`.
      Invariants: group g's rows keep their order and start at a multiple of tm; padding and
      rows past the groups read row M (out of range: zero with `mode="fill"`).
    """
    num_groups = group_sizes.shape[0]
    r = aligned_rows_bound(m, num_groups, tm)
    sizes = group_sizes.astype(jnp.int32)
    padded = (sizes + tm - 1) // tm * tm
    starts = jnp.cumsum(sizes) - sizes
    aligned_starts = jnp.cumsum(padded) - padded
    rows = jnp.arange(m, dtype=jnp.int32)
    group = _searchsorted(jnp.cumsum(sizes), rows, side="right")  # G past the groups
    inside = group < num_groups
    g = jnp.minimum(group, num_groups - 1)
    dest = jnp.where(inside, aligned_starts[g] + rows - starts[g], r).astype(jnp.int32)
    source = jnp.full((r,), m, jnp.int32).at[dest].set(rows, mode="drop")
    return AlignedRows(padded, source, dest)
