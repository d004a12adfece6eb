"""Pallas GPU (Triton lowering) grouped-matmul kernels: gmm and tgmm.

Unlike the TPU kernels (one sequential walk over a visit list), GPU programs run concurrently,
so two programs must never write the same output tile. Each program therefore owns one output
tile and loops over what touches it:
  * gmm: grid (m-tiles, n-tiles); program (i, j) loops over the groups whose rows lie in m-tile
    i (`metadata.tile_group_ranges`) and, per group, over K; the masked revisit of a straddling
    tile happens inside the program, in registers.
  * tgmm: grid (G, k-tiles, n-tiles); program (g, a, b) loops over the m-tiles of group g
    (`metadata.group_tile_ranges`); an empty group writes its zero accumulator.
Operands are passed whole (no BlockSpec blocking) and sliced with `pl.ds` at tile offsets
computed from the metadata, because the tile a program reads depends on data (the group).
Callers pad M, K, N to tile multiples; tiles are powers of two (Triton's requirement).

Status: correct in interpret mode on CPU (tests); compiled for H100 on CPU (deviceless, the
`accelerator` tests: PTX with Hopper `wgmma`, registers and spills in BENCHMARKS.md); not yet
timed on a GPU.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import metadata as md
from pallas_kernels import vma
from pallas_kernels.config import KERNEL_PRECISION, Config

# jax 0.11 deprecated the Pallas-Triton backend (each lowering warns). These kernels stay the
# fallback for GPUs before Hopper while the backend exists; the message is filtered here, where
# we call it, and only this message.
warnings.filterwarnings(
    "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
)


def _compiler_params(config: Config):
    return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


@functools.partial(
    jax.jit, static_argnames=("tiles", "config", "transpose_rhs", "out_dtype", "interpret")
)
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: tuple[int, int, int],
    config: Config,
    transpose_rhs: bool,
    out_dtype,
    interpret: bool,
    row_index: jax.Array | None = None,
    row_weight: jax.Array | None = None,
) -> jax.Array:
    """out[rows of g] = lhs[rows of g] @ rhs[g] on GPU, optionally with MoE fusions.

    Args:
      lhs: [M, K], M % tm == 0, K % tk == 0; with row_index, any [T, K] (K % tk == 0).
      rhs: [G, K, N] ([G, N, K] if transpose_rhs), N % tn == 0.
      group_sizes: [G] int32, sum <= M.
      tiles: (tm, tk, tn), powers of two.
      config: supplies num_warps and num_stages.
      transpose_rhs: contract with rhs's last axis.
      out_dtype: output dtype (accumulation is fp32).
      interpret: run with the Pallas interpreter (CPU).
      row_index: optional [M] int32 in [0, T): row r of the grouped lhs is lhs[row_index[r]],
        gathered inside the kernel (no [M, K] permuted copy in memory).
      row_weight: optional [M] float32: row r of the output is scaled by it in the epilogue.

    Returns:
      [M, N] of out_dtype; rows past sum(group_sizes) are zero (their tiles have no groups).
    """
    tm, tk, tn = tiles
    m = lhs.shape[0] if row_index is None else row_index.shape[0]
    k = lhs.shape[1]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tiles_k = k // tk
    first, stop = md.tile_group_ranges(group_sizes, m=m, tm=tm)
    offsets = md.group_offsets(group_sizes)
    extras = [a for a in (row_index, row_weight) if a is not None]

    def kernel(first_ref, stop_ref, offsets_ref, *refs):
        *extra_refs, lhs_ref, rhs_ref, out_ref = refs
        index_ref = extra_refs.pop(0) if row_index is not None else None
        weight_ref = extra_refs.pop(0) if row_weight is not None else None
        i, j = pl.program_id(0), pl.program_id(1)
        # Fused gather: this tile's lhs rows, read straight from the unpermuted [T, K] array.
        lhs_rows = pl.ds(i * tm, tm) if index_ref is None else index_ref[pl.ds(i * tm, tm)]

        def k_loop(g, acc, row_mask):
            def k_body(kk, acc):
                x = lhs_ref[lhs_rows, pl.ds(kk * tk, tk)]
                if row_mask is not None:  # rows of other groups may hold anything, even inf
                    x = jnp.where(row_mask, x, 0)
                if transpose_rhs:
                    w = rhs_ref[g, pl.ds(j * tn, tn), pl.ds(kk * tk, tk)].T
                else:
                    w = rhs_ref[g, pl.ds(kk * tk, tk), pl.ds(j * tn, tn)]
                return acc + jnp.dot(
                    x, w, precision=KERNEL_PRECISION, preferred_element_type=jnp.float32
                )

            return lax.fori_loop(0, tiles_k, k_body, acc)

        def group_body(g, acc):
            # One fp32 accumulator: a tile wholly inside group g (most tiles) multiplies its
            # lhs rows as they are; a straddling tile zeroes the other groups' lhs rows first,
            # so each output row only ever sums its own group's product (two [tm, tn]
            # accumulators, a group's part and the tile's sum, spill at 128 x 256 tiles).
            start, end = offsets_ref[g], offsets_ref[g + 1]
            whole = (start <= i * tm) & (i * tm + tm <= end)
            rows = i * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
            in_group = (rows >= start) & (rows < end)
            return lax.cond(
                whole, lambda a: k_loop(g, a, None), lambda a: k_loop(g, a, in_group), acc
            )

        acc = lax.fori_loop(first_ref[i], stop_ref[i], group_body, jnp.zeros((tm, tn), jnp.float32))
        if weight_ref is not None:  # fused routing weight, applied once in the epilogue
            acc = acc * weight_ref[pl.ds(i * tm, tm)][:, None]
        out_ref[...] = acc.astype(out_ref.dtype)

    whole = pl.BlockSpec(memory_space=pl.ANY)  # sliced in the kernel at data-dependent offsets
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=m * k * lhs.dtype.itemsize * (n // tn)
        + rhs.size * rhs.dtype.itemsize * (m // tm)
        + m * n * jnp.dtype(out_dtype).itemsize,
    )
    return pl.pallas_call(
        kernel,
        out_shape=vma.out_struct((m, n), out_dtype, lhs, vma.varying_axes(lhs)),
        grid=(m // tm, n // tn),
        in_specs=[whole] * (5 + len(extras)),
        # Output tile (i, j) of [M, N] belongs to program (i, j) alone.
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        compiler_params=_compiler_params(config),
        interpret=interpret,
        cost_estimate=cost,
        name="gather_gmm" if row_index is not None else ("gmm_t" if transpose_rhs else "gmm"),
    )(first, stop, offsets, *extras, lhs, rhs)


@functools.partial(jax.jit, static_argnames=("tiles", "config", "out_dtype", "interpret"))
def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: tuple[int, int, int],
    config: Config,
    out_dtype,
    interpret: bool,
) -> jax.Array:
    """out[g] = lhs[rows of g]^T @ rhs[rows of g] on GPU.

    Args:
      lhs: [M, K], M % tm == 0, K % tk == 0.
      rhs: [M, N], N % tn == 0.
      group_sizes: [G] int32, sum <= M.
      tiles: (tm, tk, tn), powers of two.
      config: supplies num_warps and num_stages.
      out_dtype: output dtype (accumulation is fp32).
      interpret: run with the Pallas interpreter (CPU).

    Returns:
      [G, K, N] of out_dtype; empty groups are zero.
    """
    tm, tk, tn = tiles
    m, k = lhs.shape
    n = rhs.shape[1]
    num_groups = group_sizes.shape[0]
    lo, hi = md.group_tile_ranges(group_sizes, tm=tm)
    offsets = md.group_offsets(group_sizes)

    def kernel(lo_ref, hi_ref, offsets_ref, lhs_ref, rhs_ref, out_ref):
        g, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        start, end = offsets_ref[g], offsets_ref[g + 1]

        def product(t, acc, masked):
            x = lhs_ref[pl.ds(t * tm, tm), pl.ds(a * tk, tk)]
            y = rhs_ref[pl.ds(t * tm, tm), pl.ds(b * tn, tn)]
            if masked:  # mask both operands: rows of other groups may hold anything, even inf
                rows = t * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
                in_group = (rows >= start) & (rows < end)
                x, y = jnp.where(in_group, x, 0), jnp.where(in_group, y, 0)
            return acc + jnp.dot(
                x.T, y, precision=KERNEL_PRECISION, preferred_element_type=jnp.float32
            )

        # Only a group's first and last m-tiles can hold other groups' rows: three loops (the
        # first tile masked, the middle ones as they are, the last masked) keep the masks out
        # of the middle loop, whose operands go from shared memory to the tensor cores
        # untouched. (A branch inside one loop would stop Triton pipelining its loads.)
        lo, hi = lo_ref[g], hi_ref[g]
        masked = lambda t, acc: product(t, acc, True)  # noqa: E731
        acc = jnp.zeros((tk, tn), jnp.float32)
        acc = lax.fori_loop(lo, jnp.minimum(lo + 1, hi), masked, acc)
        acc = lax.fori_loop(lo + 1, hi - 1, lambda t, c: product(t, c, False), acc)
        acc = lax.fori_loop(jnp.maximum(hi - 1, lo + 1), hi, masked, acc)
        out_ref[...] = acc.astype(out_ref.dtype)

    whole = pl.BlockSpec(memory_space=pl.ANY)
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=lhs.size * lhs.dtype.itemsize * (n // tn)
        + rhs.size * rhs.dtype.itemsize * (k // tk)
        + num_groups * k * n * jnp.dtype(out_dtype).itemsize,
    )
    return pl.pallas_call(
        kernel,
        out_shape=vma.out_struct((num_groups, k, n), out_dtype, lhs, vma.varying_axes(lhs)),
        grid=(num_groups, k // tk, n // tn),
        in_specs=[whole] * 5,
        # Output block (g, a, b) of [G, K, N] belongs to program (g, a, b) alone.
        out_specs=pl.BlockSpec((None, tk, tn), lambda g, a, b: (g, a, b)),
        compiler_params=_compiler_params(config),
        interpret=interpret,
        cost_estimate=cost,
        name="tgmm",
    )(lo, hi, offsets, lhs, rhs)
