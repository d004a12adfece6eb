"""Pallas TPU (Mosaic) grouped-matmul kernels: gmm and tgmm over a scalar-prefetched visit list.

Adapted from jax `pallas/ops/tpu/megablox/gmm.py` (Apache-2.0). Changes: callers pad M, K, N to
tile multiples (so no in-kernel K-remainder masking); no expert sharding (`group_offset`) and no
`existing_out`; `sum(group_sizes) < M` is allowed (rows past it are zeroed here); the metadata
comes from `metadata.make_group_metadata`. The grid is (n-tiles, visits, k-tiles) for gmm and
(n-tiles, k-tiles, visits) for tgmm; the visit axis is sequential ("arbitrary") so a revisited
output tile stays resident in VMEM between its consecutive visits (see metadata.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import metadata as md
from pallas_kernels import vma
from pallas_kernels.config import KERNEL_PRECISION


def _row_mask(meta: md.GroupMetadata, visit, tm: int, width: int) -> jax.Array:
    """[tm, width] bool: rows of this visit's m-tile that belong to this visit's group."""
    group = meta.group_ids[visit]
    lo, hi = meta.group_offsets[group], meta.group_offsets[group + 1]
    rows = lax.broadcasted_iota(jnp.int32, (tm, width), 0) + meta.m_tile_ids[visit] * tm
    return (rows >= lo) & (rows < hi)


@functools.partial(jax.jit, static_argnames=("tiles", "transpose_rhs", "out_dtype", "interpret"))
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: tuple[int, int, int],
    transpose_rhs: bool,
    out_dtype,
    interpret,
) -> jax.Array:
    """out[rows of g] = lhs[rows of g] @ rhs[g] on TPU.

    Args:
      lhs: [M, K], M % tm == 0 and K % tk == 0.
      rhs: [G, K, N] ([G, N, K] if transpose_rhs), N % tn == 0.
      group_sizes: [G] int32, sum <= M.
      tiles: (tm, tk, tn).
      transpose_rhs: contract with rhs's last axis.
      out_dtype: output dtype (accumulation is fp32).
      interpret: passed to pallas_call (False, True or a `pltpu.InterpretParams`).

    Returns:
      [M, N] of out_dtype; rows past sum(group_sizes) are zero.
    """
    tm, tk, tn = tiles
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tiles_k, tiles_n = k // tk, n // tn
    meta, num_tiles = md.make_group_metadata(group_sizes, m=m, tm=tm, visit_empty_groups=False)

    def kernel(meta_ref, lhs_ref, rhs_ref, out_ref, acc_ref):
        meta = md.GroupMetadata(*meta_ref)
        visit, k_i = pl.program_id(1), pl.program_id(2)

        @pl.when(k_i == 0)
        def _zero():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
        acc_ref[...] += lax.dot_general(
            lhs_ref[...],
            rhs_ref[...],
            dims,
            precision=KERNEL_PRECISION,
            preferred_element_type=jnp.float32,
        )

        @pl.when(k_i == tiles_k - 1)
        def _store():
            # Keep rows of other groups: they were (or will be) stored by their own visit.
            mask = _row_mask(meta, visit, tm, tn)
            kept = out_ref[...].astype(jnp.float32)
            out_ref[...] = lax.select(mask, acc_ref[...], kept).astype(out_ref.dtype)

    # Index maps get the grid indices, then the scalar-prefetch ref: the metadata triple
    # (group_offsets, group_ids, m_tile_ids), so meta[1] is group_ids and meta[2] m_tile_ids.
    def lhs_map(n_i, visit, k_i, meta):
        return meta[2][visit], k_i  # the [tm, tk] block of this visit's m-tile

    def rhs_map(n_i, visit, k_i, meta):
        if transpose_rhs:  # rhs is [G, N, K]
            return meta[1][visit], n_i, k_i
        return meta[1][visit], k_i, n_i  # the [tk, tn] block of this visit's group

    def out_map(n_i, visit, k_i, meta):
        return meta[2][visit], n_i  # revisited only by consecutive visits

    rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    itemsize = jnp.dtype(out_dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=lhs.size * lhs.dtype.itemsize * tiles_n
        + meta.group_ids.size * k * n * rhs.dtype.itemsize
        + m * n * itemsize,
    )
    call = pl.pallas_call(
        kernel,
        out_shape=vma.out_struct((m, n), out_dtype, lhs, vma.varying_axes(lhs)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(tiles_n, num_tiles, tiles_k),
            in_specs=[
                pl.BlockSpec((tm, tk), lhs_map),
                pl.BlockSpec(rhs_block, rhs_map),
            ],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="gmm_t" if transpose_rhs else "gmm",
    )
    out = call(tuple(meta), lhs, rhs)
    # Tiles wholly past sum(group_sizes) are never visited, and rows past it inside the last
    # visited tile are never stored: zero both (megablox's `_zero_uninitialized_memory`).
    valid = jnp.arange(m, dtype=jnp.int32) < meta.group_offsets[-1]
    return jnp.where(valid[:, None], out, jnp.zeros((), out_dtype))


@functools.partial(jax.jit, static_argnames=("tiles", "out_dtype", "interpret"))
def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: tuple[int, int, int],
    out_dtype,
    interpret,
) -> jax.Array:
    """out[g] = lhs[rows of g]^T @ rhs[rows of g] on TPU.

    Args:
      lhs: [M, K], M % tm == 0, K % tk == 0.
      rhs: [M, N], N % tn == 0.
      group_sizes: [G] int32, sum <= M.
      tiles: (tm, tk, tn).
      out_dtype: output dtype (accumulation is fp32).
      interpret: passed to pallas_call.

    Returns:
      [G, K, N] of out_dtype; empty groups are zero.
    """
    tm, tk, tn = tiles
    m, k = lhs.shape
    n = rhs.shape[1]
    num_groups = group_sizes.shape[0]
    meta, num_tiles = md.make_group_metadata(group_sizes, m=m, tm=tm, visit_empty_groups=True)

    def kernel(meta_ref, lhs_ref, rhs_ref, out_ref, acc_ref):
        meta = md.GroupMetadata(*meta_ref)
        visit, last = pl.program_id(2), pl.num_programs(2) - 1
        group = meta.group_ids[visit]
        prev_group = meta.group_ids[jnp.maximum(visit - 1, 0)]
        next_group = meta.group_ids[jnp.minimum(visit + 1, last)]

        @pl.when((visit == 0) | (group != prev_group))
        def _zero():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        size = meta.group_offsets[group + 1] - meta.group_offsets[group]

        @pl.when(size > 0)
        def _accumulate():
            # Zero the rows of other groups in both operands so they add nothing.
            x = jnp.where(_row_mask(meta, visit, tm, tk), lhs_ref[...], 0)
            y = jnp.where(_row_mask(meta, visit, tm, tn), rhs_ref[...], 0)
            acc_ref[...] += lax.dot_general(
                x, y, (((0,), (0,)), ((), ())), precision=KERNEL_PRECISION,
                preferred_element_type=jnp.float32,
            )  # fmt: skip

        @pl.when((visit == last) | (group != next_group))
        def _store():
            out_ref[...] = acc_ref[...].astype(out_ref.dtype)

    def lhs_map(n_i, k_i, visit, meta):
        return meta[2][visit], k_i  # [tm, tk] block of this visit's m-tile

    def rhs_map(n_i, k_i, visit, meta):
        return meta[2][visit], n_i  # [tm, tn] block of the same m-tile

    def out_map(n_i, k_i, visit, meta):
        return meta[1][visit], k_i, n_i  # group g's [tk, tn] block, written when g ends

    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=lhs.size * lhs.dtype.itemsize * (n // tn)
        + rhs.size * rhs.dtype.itemsize * (k // tk)
        + num_groups * k * n * jnp.dtype(out_dtype).itemsize,
    )
    call = pl.pallas_call(
        kernel,
        out_shape=vma.out_struct((num_groups, k, n), out_dtype, lhs, vma.varying_axes(lhs)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n // tn, k // tk, num_tiles),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((tm, tn), rhs_map)],
            out_specs=pl.BlockSpec((None, tk, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="tgmm",
    )
    return call(tuple(meta), lhs, rhs)


__all__ = ["gmm", "tgmm"]
