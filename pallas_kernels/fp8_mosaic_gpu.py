"""FP8 grouped matmuls on Hopper (Mosaic GPU): block-scaled e4m3/e5m2 operands, fp32
promotion per 128-deep K block, 16-bit outputs (the DeepSeek-V3 / DeepGEMM recipe).

The kernels are `mosaic_gpu`'s persistent, warp-specialized gmm and tgmm (one CTA per SM, a TMA
producer warpgroup, two wgmma consumer warpgroups), changed where fp8 needs it:
  * both operands K-major (Hopper's fp8 wgmma reads no transposed operand): the weights come as
    `[G, N, K]` (the forward reads the quantized `w^T`, the lhs gradient `w` as stored) and the
    weight gradient reads `x^T` and `dy^T` (`pallas_kernels.fp8`).
  * each pipeline step is one 128-deep K block: wgmma accumulates it into a scoped accumulator,
    which the consumer reads, multiplies by the tile scales (per row of the lhs tile, times the
    weight block's scalar; per row and per column in the weight gradient) and adds to an fp32
    register accumulator carried through the pipeline (DeepGEMM's promotion: Hopper's fp8
    tensor-core accumulation is too narrow to run over all of K).
  * CTA tile 128 x 128, halved between the two consumers (`SPLITS`): by columns (each owns
    128 x 64: `"cols"`) or by rows (64 x 128, DeepGEMM's layout: every wgmma is 128 columns
    wide, so it reads a quarter fewer shared-memory bytes per FLOP than at 64). Either way the
    carried and the scoped accumulators take 64 registers each per thread. `DEFAULT_SPLIT`
    holds the faster on an H200 for each kernel.
The per-row scales travel with their tiles by TMA (stored transposed, `[K / 128, M]`, so a
tile's scales are contiguous); the weight block's scale is one scalar load per step. The
K blocks reach shared memory on one of two pipelines (`PIPELINES`): jax's
`emit_pipeline_warp_specialized` once per tile, which fills its ring at the start of each tile
and drains it at the end ("per_tile"), or `mosaic_gpu.tile_stream`, one ring for all of the
CTA's tiles ("stream": the producer loads the next tile's first blocks while the consumers
finish a tile). At 128-deep fp8 steps a tile is short (32 steps at K = 4096; 4 in a weight
gradient over 512-row groups), so the refill is paid often. `DEFAULT_PIPELINE` holds what is
measured.

The operands these kernels read are quantized, both ways in one read, by
`fp8_quantizers`.

Groups must be aligned to 128 rows (`group_alignment`): the 128 x 1 scale tiles of the weight
gradient's operands must not straddle groups, and rows are never moved (that would need a
requantization). `fp8_ops` emulates where these conditions do not hold.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import metadata as md
from pallas_kernels import mgpu_compat, mosaic_gpu, vma
from pallas_kernels.mosaic_gpu import (
    _epilogue,
    _kernel,
    _out_smem,
    _transforms,
    gmm_schedule,
    num_sms,
    run_tiles,
)

TILE = 128  # tm = tk = tn: one scale block deep
HALF = TILE // 2  # a consumer warpgroup's rows ("rows") or columns ("cols") of the tile
SPLITS = ("cols", "rows")  # how the two consumers halve the CTA tile (module docstring)
# Each kernel's default split, the faster one on an H200 at all three shapes of
# `pallas_kernels.shapes` but one (BENCHMARKS.md): rows for fp8_gmm (forward and lhs gradient),
# columns for fp8_tgmm.
DEFAULT_SPLIT = {"fp8_gmm": "rows", "fp8_tgmm": "cols"}
# How K blocks reach shared memory (module docstring). Each kernel's default is the pipeline
# measured on an H200 (BENCHMARKS.md); "stream" is compiled for H100 and interpreted on CPU,
# and waits for a GPU to be timed.
PIPELINES = mosaic_gpu.PIPELINES
DEFAULT_PIPELINE = {"fp8_gmm": "per_tile", "fp8_tgmm": "per_tile"}
STAGES = 4  # shared memory ring: 4 x (16 + 16 KiB of fp8 + scales)
RASTER = 8
_E4M3, _E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def smem_bytes(kernel: str, out_dtype) -> int:
    """Shared memory of one CTA: `STAGES` slots of the two 128 x 128 fp8 tiles and their scale
    rows (one of 128 fp32 for fp8_gmm, two for fp8_tgmm), two "loaded"/"consumed" mbarriers per
    stage, and the epilogue's two 64 x 64 slots per consumer warpgroup."""
    scales = (1 if kernel == "fp8_gmm" else 2) * TILE * 4
    epilogue = 2 * 2 * 64 * 64 * jnp.dtype(out_dtype).itemsize
    return STAGES * (2 * TILE * TILE + scales + 2 * 8) + epilogue


def supports(lhs_dtype, rhs_dtype) -> bool:
    """Whether the kernels take this operand pair on the installed jax: e4m3 x e4m3 and
    e5m2 x e5m2 always; a mixed e4m3/e5m2 pair where Mosaic GPU's wgmma mixes them."""
    a, b = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
    if a not in (_E4M3, _E5M2) or b not in (_E4M3, _E5M2):
        return False
    return a == b or mgpu_compat.WGMMA_MIXES_FP8


def _scaled_step(carry, a_smem, b_smem_kmajor, scale, *, barrier: bool = False):
    """carry + (a @ b^T) * scale(), the product of one K block in a scoped accumulator.

    `scale()` (its loads and products) is traced after the wgmma call, so the wgmmas are
    issued first and the scale is computed in their shadow, before the wait. ptxas may still
    hoist the scale's loads and multiplies between the wgmmas, stalling their issue (it did
    for the weight gradient's 64 products per thread, at some shapes): `barrier` puts a
    warpgroup barrier (`commit_smem`) between the two, which no load crosses.
    """

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem_kmajor.T)
        if barrier:
            plgpu.commit_smem()
        s = scale()
        return acc_ref[...], s

    part, s = pl.run_scoped(mma, plgpu.ACC(carry.shape, jnp.float32))
    return carry + part * s


def _halves(split: str, wg):
    """`(rows, cols)` of the CTA tile that consumer `wg` owns, and its accumulator shape."""
    if split == "rows":
        return pl.ds(wg * HALF, HALF), slice(None), (HALF, TILE)
    return slice(None), pl.ds(wg * HALF, HALF), (TILE, HALF)


def _check_split(split: str | None, kernel: str) -> str:
    """`split`, or `kernel`'s default where it is None."""
    split = DEFAULT_SPLIT[kernel] if split is None else split
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


def _check_pipeline(pipeline: str | None, kernel: str) -> str:
    """`pipeline`, or `kernel`'s default where it is None."""
    pipeline = DEFAULT_PIPELINE[kernel] if pipeline is None else pipeline
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    return pipeline


def _zeros(shape, interpret):
    zeros = jnp.zeros(shape, jnp.float32)
    return mgpu_compat.layout_cast(zeros, plgpu.Layout.WGMMA, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "split", "pipeline"))
def gmm_kernel(lhs, lhs_scale_t, rhs, rhs_scale, tile_group, *, out_dtype, interpret,
               split, pipeline):  # fmt: skip
    """out[rows of g] = (lhs * scales)[rows of g] @ (rhs[g] * scales)^T, groups 128-aligned.

    Args:
      lhs: `[M, K]` fp8, M and K multiples of 128.
      lhs_scale_t: `[K / 128, M]` fp32: the scale of each row's 128-column tile, transposed.
      rhs: `[G, N, K]` fp8 (K-major), N a multiple of 128.
      rhs_scale: `[G, N / 128, K / 128]` fp32 block scales.
      tile_group: `[M / 128]` int32, each m-tile's group, G past the groups.
      out_dtype: output dtype.
      interpret: False, or Mosaic GPU interpreter params.
      split: how the consumers halve the tile (`SPLITS`).
      pipeline: how the K blocks reach shared memory (`PIPELINES`).

    Returns:
      `[M, N]` out_dtype; tiles past the groups are zero.
    """
    m, k = lhs.shape
    num_groups, n, _ = rhs.shape
    load = functools.partial(mgpu_compat.load, interpret=bool(interpret))
    m_iters, n_iters, k_iters = m // TILE, n // TILE, k // TILE
    rings = [
        ((TILE, TILE), lhs.dtype, _transforms(TILE, lhs.dtype)),
        ((TILE, TILE), rhs.dtype, _transforms(TILE, rhs.dtype)),
        ((1, TILE), jnp.float32, ()),
    ]

    def body(tile_group_gmem, lhs_gmem, scale_gmem, rhs_gmem, rhs_scale_gmem, out_gmem):
        tile, steps = gmm_schedule(tile_group_gmem, (m_iters, n_iters), RASTER, num_groups, k_iters)

        def views(t):  # the tile's operands along K, in the rings' order
            mi, ni, g, _ = t
            rows = pl.ds(mi * TILE, TILE)
            return [lhs_gmem.at[rows, :], rhs_gmem.at[g, pl.ds(ni * TILE, TILE), :],
                    scale_gmem.at[:, rows]]  # fmt: skip

        def blocks(_, kk):  # step kk's block of each view
            return [(0, kk), (0, kk), (kk, 0)]

        def scope(out_smem):
            wg = lax.axis_index("wg")
            wg_rows, wg_cols, acc_shape = _halves(split, wg)

            def step(t, kk, slots, carry):
                _, ni, g, _ = t
                lhs_smem, rhs_smem, scale_smem = slots

                def scale():
                    row = load(scale_smem.at[0, wg_rows], layout=plgpu.Layout.WGMMA.reduce(1))
                    return lax.broadcast_in_dim(row * rhs_scale_gmem[g, ni, kk], carry.shape, [0])

                return _scaled_step(carry, lhs_smem.at[wg_rows, :], rhs_smem.at[wg_cols, :], scale)

            def finish(t, acc):
                mi, ni, _, _ = t
                out = out_gmem.at[pl.ds(mi * TILE, TILE), pl.ds(ni * TILE, TILE)]
                _epilogue(acc, out_smem, out.at[wg_rows, wg_cols], wg, out_dtype)

            run_tiles(
                pipeline, (m_iters * n_iters,), rings, [lhs_gmem, rhs_gmem.at[0], scale_gmem],
                tile=tile, steps=steps, views=views, blocks=blocks, step=step,
                context=lambda t, run: finish(t, run(_zeros(acc_shape, interpret))),
                stages=STAGES if pipeline == "stream" else min(STAGES, k_iters),
            )  # fmt: skip

        pl.run_scoped(scope, _out_smem(*_halves(split, 0)[2], out_dtype), collective_axes="wg")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=m * k * n_iters + rhs.size * m_iters // num_groups
        + m * n * jnp.dtype(out_dtype).itemsize,
    )  # fmt: skip
    kernel = _kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), name="fp8_gmm",
        interpret=interpret, cost=cost, sms=num_sms(),
    )  # fmt: skip
    out = kernel(tile_group, lhs, lhs_scale_t, rhs, rhs_scale)
    return vma.cast_varying(out, vma.varying_axes(lhs))


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "split", "pipeline"))
def tgmm_kernel(lhs_t, lhs_scale, rhs_t, rhs_scale, group_sizes, *, out_dtype, interpret,
                split, pipeline):  # fmt: skip
    """out[g] = (lhs_t * scales)[:, rows of g] @ ((rhs_t * scales)[:, rows of g])^T.

    Args:
      lhs_t: `[K, M]` fp8 (x^T), K and M multiples of 128.
      lhs_scale: `[M / 128, K]` fp32: the scale of each 128-row tile of each column of x.
      rhs_t: `[N, M]` fp8 (dy^T), N a multiple of 128.
      rhs_scale: `[M / 128, N]` fp32, likewise for dy.
      group_sizes: `[G]` int32, multiples of 128, sum <= M.
      out_dtype: output dtype.
      interpret: False, or Mosaic GPU interpreter params.
      split: how the consumers halve the output tile (`SPLITS`).
      pipeline: how the row blocks reach shared memory (`PIPELINES`).

    Returns:
      `[G, K, N]` out_dtype; empty groups are zero.
    """
    k, m = lhs_t.shape
    n = rhs_t.shape[0]
    load = functools.partial(mgpu_compat.load, interpret=bool(interpret))
    num_groups = group_sizes.shape[0]
    k_iters, n_iters = k // TILE, n // TILE
    per_group = k_iters * n_iters
    order, first_block, steps = md.largest_first(group_sizes, tm=TILE)
    rings = [
        ((TILE, TILE), lhs_t.dtype, _transforms(TILE, lhs_t.dtype)),
        ((TILE, TILE), rhs_t.dtype, _transforms(TILE, rhs_t.dtype)),
        ((1, TILE), jnp.float32, ()),
        ((1, TILE), jnp.float32, ()),
    ]

    def body(order_gmem, first_gmem, steps_gmem, a_gmem, sa_gmem, b_gmem, sb_gmem, out_gmem):
        def tile(info):
            (lin,) = info.index
            g = order_gmem[lax.div(lin, per_group)]  # largest groups first
            ki, ni = plgpu.planar_snake(lax.rem(lin, per_group), (k_iters, n_iters), 0, RASTER)
            return g, ki, ni, first_gmem[g]

        def views(t):  # the tile's operands along M, in the rings' order
            _, ki, ni, _ = t
            ks, ns = pl.ds(ki * TILE, TILE), pl.ds(ni * TILE, TILE)
            return [a_gmem.at[ks, :], b_gmem.at[ns, :], sa_gmem.at[:, ks], sb_gmem.at[:, ns]]

        def blocks(t, r):  # 128-row block r of the group, from its first on
            r = t[3] + r
            return [(0, r), (0, r), (r, 0), (r, 0)]

        def scope(out_smem):
            wg = lax.axis_index("wg")
            wg_rows, wg_cols, acc_shape = _halves(split, wg)

            def step(_, r, slots, carry):
                a_smem, b_smem, sa_smem, sb_smem = slots

                def scale():
                    row = load(sa_smem.at[0, wg_rows], layout=plgpu.Layout.WGMMA.reduce(1))
                    col = load(sb_smem.at[0, wg_cols], layout=plgpu.Layout.WGMMA.reduce(0))
                    return lax.broadcast_in_dim(row, carry.shape, [0]) * lax.broadcast_in_dim(
                        col, carry.shape, [1]
                    )

                a, b = a_smem.at[wg_rows, :], b_smem.at[wg_cols, :]
                return _scaled_step(carry, a, b, scale, barrier=True)

            def finish(t, acc):  # zeros for an empty group
                g, ki, ni, _ = t
                out = out_gmem.at[g, pl.ds(ki * TILE, TILE), pl.ds(ni * TILE, TILE)]
                _epilogue(acc, out_smem, out.at[wg_rows, wg_cols], wg, out_dtype)

            run_tiles(
                pipeline, (num_groups * per_group,), rings, [a_gmem, b_gmem, sa_gmem, sb_gmem],
                tile=tile, steps=lambda t: steps_gmem[t[0]], views=views, blocks=blocks,
                step=step, context=lambda t, run: finish(t, run(_zeros(acc_shape, interpret))),
                stages=STAGES,
            )  # fmt: skip

        pl.run_scoped(scope, _out_smem(*_halves(split, 0)[2], out_dtype), collective_axes="wg")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=lhs_t.size * n_iters + rhs_t.size * k_iters
        + num_groups * k * n * jnp.dtype(out_dtype).itemsize,
    )  # fmt: skip
    kernel = _kernel(
        body, out_type=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype), name="fp8_tgmm",
        interpret=interpret, cost=cost, sms=num_sms(),
    )  # fmt: skip
    out = kernel(order, first_block, steps, lhs_t, lhs_scale, rhs_t, rhs_scale)
    return vma.cast_varying(out, vma.varying_axes(lhs_t))


def _pad_to(x, multiples, value=0):
    widths = [(0, -d % t) for d, t in zip(x.shape, multiples, strict=True)]
    return jnp.pad(x, widths, constant_values=value) if any(w for _, w in widths) else x


def _check_aligned(group_alignment: int) -> None:
    if group_alignment % TILE:
        raise ValueError(
            f"the fp8 Mosaic GPU kernels need group_alignment a multiple of {TILE}, got "
            f"{group_alignment} (fp8_ops emulates for unaligned groups)"
        )


def fp8_gmm(lhs, lhs_scale, rhs, rhs_scale, group_sizes, *, out_dtype, group_alignment,
            interpret=False, split=None, pipeline=None):  # fmt: skip
    """`lhs @ rhs[g]^T` per group from `fp8.quantize_rows` / `quantize_blocks` operands.

    Args:
      lhs: `[M, Kc]` fp8; lhs_scale `[M, ceil(Kc / 128)]`.
      rhs: `[G, N, Kc]` fp8 (K-major); rhs_scale `[G, ceil(N / 128), ceil(Kc / 128)]`.
      group_sizes: `[G]` int32, multiples of `group_alignment` (a multiple of 128).
      out_dtype: output dtype.
      group_alignment: the callers' static promise on the group sizes.
      interpret: run in the Mosaic GPU interpreter.
      split: how the two consumer warpgroups halve the 128 x 128 tile (`SPLITS`; None:
        `DEFAULT_SPLIT`).
      pipeline: how K blocks reach shared memory (`PIPELINES`; None: `DEFAULT_PIPELINE`).

    Returns:
      `[M, N]` out_dtype; rows past the groups are zero.
    """
    _check_aligned(group_alignment)
    split = _check_split(split, "fp8_gmm")
    pipeline = _check_pipeline(pipeline, "fp8_gmm")
    m, n = lhs.shape[0], rhs.shape[1]
    lhs_p = _pad_to(lhs, (TILE, TILE))
    scale_t = _pad_to(lhs_scale, (TILE, 1), 1.0).T
    rhs_p = _pad_to(rhs, (1, TILE, TILE))
    tile_group = md.aligned_tile_groups(group_sizes, m=lhs_p.shape[0], tm=TILE)
    out = gmm_kernel(
        lhs_p, scale_t, rhs_p, rhs_scale, tile_group, out_dtype=jnp.dtype(out_dtype),
        interpret=mgpu_compat.interpret_mode(interpret), split=split, pipeline=pipeline,
    )  # fmt: skip
    return out[:m, :n]


def fp8_tgmm(lhs_t, lhs_scale, rhs_t, rhs_scale, group_sizes, *, out_dtype, group_alignment,
             interpret=False, split=None, pipeline=None):  # fmt: skip
    """Per group `lhs_t[:, rows] @ rhs_t[:, rows]^T` from `fp8.quantize_cols` operands.

    Args:
      lhs_t: `[K, M]` fp8; lhs_scale `[K, ceil(M / 128)]`.
      rhs_t: `[N, M]` fp8; rhs_scale `[N, ceil(M / 128)]`.
      group_sizes: `[G]` int32, multiples of `group_alignment` (a multiple of 128).
      out_dtype, group_alignment, interpret, split, pipeline: as for `fp8_gmm`.

    Returns:
      `[G, K, N]` out_dtype.
    """
    _check_aligned(group_alignment)
    split = _check_split(split, "fp8_tgmm")
    pipeline = _check_pipeline(pipeline, "fp8_tgmm")
    k, n = lhs_t.shape[0], rhs_t.shape[0]
    a = _pad_to(lhs_t, (TILE, TILE))
    b = _pad_to(rhs_t, (TILE, TILE))
    sa = _pad_to(lhs_scale, (TILE, 1), 1.0).T
    sb = _pad_to(rhs_scale, (TILE, 1), 1.0).T
    out = tgmm_kernel(
        a, sa, b, sb, group_sizes, out_dtype=jnp.dtype(out_dtype),
        interpret=mgpu_compat.interpret_mode(interpret), split=split, pipeline=pipeline,
    )  # fmt: skip
    return out[:, :k, :n]
