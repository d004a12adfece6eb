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

`quantize_both` and `quantize_blocks_both` are the quantizations these kernels read, fused:
one read of a 16-bit activation `x` gives `fp8.quantize_rows(x)` and `fp8.quantize_cols(x)`
(its rows past the groups zeroed on the way, `live_rows=`), one read of the weights `w` (16-bit
or fp32) gives `fp8.quantize_blocks(w)` and its transpose, bit for bit (XLA needs two passes).
`quantize_swiglu` and `quantize_swiglu_grad` compute the SwiGLU activation, or its gradients,
and quantize them both ways in the same pass (`fp8_ops.fp8_swiglu_ffn`).

Groups must be aligned to 128 rows (`group_alignment`): the 128 x 1 scale tiles of the weight
gradient's operands must not straddle groups, and rows are never moved (that would need a
requantization). `fp8_ops` emulates where these conditions do not hold.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import fp8, mgpu_compat, mosaic_gpu, vma
from pallas_kernels import metadata as md
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


def quantize_supports(x, dtype) -> bool:
    """Whether `quantize_both` runs for `x` on the installed jax: a 16-bit float `[M, K]`, both
    multiples of 128, an fp8 format, and a Mosaic GPU that loads tiles transposed (jax 0.11+)."""
    return x.ndim == 2 and _quantizes(x, dtype)


def quantize_blocks_supports(w, dtype) -> bool:
    """Whether `quantize_blocks_both` runs for `w`: as `quantize_supports`, for `[G, K, N]`,
    and fp32 too (master weights, quantized without a 16-bit copy)."""
    return w.ndim == 3 and _quantizes(w, dtype, _WIDE)


_NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_WIDE = (*_NARROW, jnp.dtype(jnp.float32))


def _quantizes(x, dtype, floats=_NARROW) -> bool:
    return (
        mgpu_compat.LOADS_TRANSPOSED
        and x.shape[-2] % TILE == 0
        and x.shape[-1] % TILE == 0
        and jnp.dtype(x.dtype) in floats
        and jnp.dtype(dtype) in (_E4M3, _E5M2)
    )


def _quantized_tile(x, scale, big, dtype):
    """An fp32 tile over its scale (`[128]`, one per row, or one for the tile), clipped and
    cast: the arithmetic of `fp8._quantize` (so the bits match)."""
    y = x / (scale if scale.ndim == 0 else lax.broadcast_in_dim(scale, x.shape, [0]))
    return jnp.clip(y, -big, big).astype(dtype)


def _load_f32(src, interpret):
    return mgpu_compat.load(src, layout=plgpu.Layout.WGMMA, interpret=interpret).astype(jnp.float32)


def _quantizer(body, x, dtype, *, scratch, out_type, grid, grid_names, name, interpret,
               inputs=None, extra=()):  # fmt: skip
    """`plgpu.kernel` of a quantizer: one warpgroup per CTA, `body(*in_gmems, *extra_gmems,
    *out_gmems, *scratch_refs, barrier)` on one 128 x 128 tile of each input (`inputs`, default
    `[x]`, all shaped as `x`; `extra`: small arrays the body reads itself); `scratch` holds the
    inputs' shared-memory tiles first, and the barrier expects one TMA load per input."""
    inputs = [x] if inputs is None else inputs

    def kernel_body(*gmems):
        pl.run_scoped(
            functools.partial(body, *gmems), *scratch, plgpu.Barrier(num_arrivals=len(inputs))
        )

    interpret = _interpret(interpret)
    if interpret is True:
        interpret = mgpu_compat.interpret_params()
    in_bytes = sum(a.size * a.dtype.itemsize for a in (*inputs, *extra))
    out_bytes = sum(o.size * jnp.dtype(o.dtype).itemsize for o in out_type)
    kernel = mgpu_compat.kernel(
        kernel_body,
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=in_bytes + out_bytes
        ),
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        kernel_name=name,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret or None,
    )
    axes = vma.varying_axes(x)
    return tuple(vma.cast_varying(a, axes) for a in kernel(*inputs, *extra))


def _check_quantizable(x, dtype, supported: bool, name: str, shape: str) -> None:
    if not supported:
        raise ValueError(
            f"{name} takes a 16-bit {shape} with its last two dims multiples of {TILE} on jax "
            f">= 0.11, got {x.dtype}{list(x.shape)} to {dtype} on jax {jax.__version__}"
        )


def _quantize_map(fn, inputs, dtype, *, results: int, name: str, interpret, live_rows=None):
    """`quantize_both` of each of `fn`'s `results` arrays, rounded to the inputs' dtype, from
    one read of each 16-bit input `[M, K]` (all one shape and dtype). `fn` maps fp32 tiles of
    the inputs to fp32 tiles elementwise (None: the one input itself).

    One CTA per 128 x 128 tile. `fn` runs once per element, on 64-row halves, and its results
    are stored over the first `results` input tiles in shared memory, rounded to the inputs'
    dtype (the value a 16-bit producer would have written); each result is then quantized as
    `quantize_both` quantizes its input: loaded as it is (1 x 128 tiles) and transposed (128 x
    1), into one pair of fp8 tiles that TMA stores, reused by the next result once TMA has read
    it. The input tiles no result is stored over are dead by then: that pair of fp8 tiles
    shares their memory, so a CTA holds its inputs, 1 KiB of scales, and nothing more.

    `live_rows` (an int32 scalar, or None for all): the rows from it on are quantized as zeros
    (they may hold anything, NaN included), as if zeroed before.

    Returns `results` pairs `((q [M, K], scale [M, K / 128]), (q_t [K, M], scale_t [K, M / 128]))`.
    """
    dtype = fp8.fp8_dtype(dtype)
    x = inputs[0]
    for a in inputs:
        same = a.shape == x.shape and a.dtype == x.dtype
        _check_quantizable(a, dtype, quantize_supports(a, dtype) and same, name,
                           f"[M, K] (all inputs {x.dtype}{list(x.shape)})")  # fmt: skip
    m, k = x.shape
    big = fp8.fmax(dtype)
    n_in = len(inputs)
    shared = fn is not None and results < n_in  # the fp8 tiles over the last, dead input

    extra = () if live_rows is None else (jnp.reshape(live_rows, (1,)).astype(jnp.int32),)

    def body(*refs):
        in_gmems, refs = refs[:n_in], refs[n_in:]
        extra_gmems, refs = refs[: len(extra)], refs[len(extra) :]
        out_gmems, refs = refs[: 4 * results], refs[4 * results :]
        if shared:
            *in_smems, (last, (q_smem, qt_smem)), s_smem, st_smem, barrier = refs
            in_smems.append(last)
        else:
            *in_smems, q_smem, qt_smem, s_smem, st_smem, barrier = refs
        i, j = lax.axis_index("m"), lax.axis_index("k")
        rows, cols = pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)
        for src, dst in zip(in_gmems, in_smems, strict=True):
            plgpu.copy_gmem_to_smem(src.at[rows, cols], dst, barrier)
        plgpu.barrier_wait(barrier)
        if fn is not None:  # on 64 x 64 quarters: each thread rewrites the elements it loaded
            for quarter in itertools.product(range(TILE // HALF), repeat=2):
                at = tuple(pl.ds(q * HALF, HALF) for q in quarter)
                outs = fn(*[_load_f32(s.at[at], interpret) for s in in_smems])
                for out, s in zip(outs, in_smems, strict=False):
                    s[at] = out.astype(s.dtype)
            plgpu.commit_smem()  # the warpgroup's stores, before the transposed loads
        for r in range(results):
            if r:  # TMA has read the previous result's tiles
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            src = in_smems[r]
            for dim, tile_ref, q_ref, s_ref in ((0, src, q_smem, s_smem),
                                                (1, src.T, qt_smem, st_smem)):  # fmt: skip
                tile = _load_f32(tile_ref, interpret)
                if extra_gmems:  # x's rows are the tile's rows, or its columns transposed
                    row = lax.broadcasted_iota(jnp.int32, (TILE,), 0)
                    layout = plgpu.Layout.WGMMA.reduce(1 - dim)
                    row = mgpu_compat.layout_cast(row, layout, interpret=interpret)
                    live = (row < extra_gmems[0][0] - i * TILE).astype(jnp.float32)
                    keep = lax.broadcast_in_dim(live, tile.shape, [dim]) > 0
                    tile = jnp.where(keep, tile, 0.0)
                scale = fp8.tile_scale(jnp.max(jnp.abs(tile), axis=1), dtype)
                q_ref[...], s_ref[...] = _quantized_tile(tile, scale, big, dtype), scale
            plgpu.commit_smem()
            q_gmem, s_gmem, qt_gmem, st_gmem = out_gmems[4 * r : 4 * r + 4]
            plgpu.copy_smem_to_gmem(q_smem, q_gmem.at[rows, cols])
            plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[j, rows])
            plgpu.copy_smem_to_gmem(qt_smem, qt_gmem.at[cols, rows])
            plgpu.copy_smem_to_gmem(st_smem, st_gmem.at[i, cols])
        plgpu.wait_smem_to_gmem(0)

    def tile(dt):
        return plgpu.SMEM((TILE, TILE), dt, transforms=_transforms(TILE, dt))

    in_tiles = [tile(a.dtype) for a in inputs]
    fp8_tiles = [tile(dtype), tile(dtype)]
    if shared:
        tiles = [*in_tiles[:-1], plgpu.RefUnion(in_tiles[-1], fp8_tiles)]
    else:
        tiles = [*in_tiles, *fp8_tiles]
    outs = _quantizer(
        body, x, dtype,
        scratch=[*tiles, plgpu.SMEM((TILE,), jnp.float32), plgpu.SMEM((TILE,), jnp.float32)],
        out_type=[
            jax.ShapeDtypeStruct(s, d)
            for _ in range(results)
            for s, d in (((m, k), dtype), ((k // TILE, m), jnp.float32), ((k, m), dtype),
                         ((m // TILE, k), jnp.float32))
        ],
        grid=(m // TILE, k // TILE), grid_names=("m", "k"), name=name, interpret=interpret,
        inputs=list(inputs), extra=extra,
    )  # fmt: skip
    return tuple(
        ((q, s_t.T), (q_t, st_t.T))
        for q, s_t, q_t, st_t in (outs[4 * r : 4 * r + 4] for r in range(results))
    )


def quantize_both(x, dtype="e4m3", *, live_rows=None, interpret=False):
    """`(fp8.quantize_rows(x, dtype), fp8.quantize_cols(x, dtype))` from one read of `x`.

    One CTA per 128 x 128 tile: TMA brings the tile to shared memory; the warpgroup loads it
    into registers as it is (its rows' 1 x 128 maxima, the row-quantized tile) and transposed
    (its columns' 128 x 1 maxima, the tile of `x^T` quantized along its rows), and TMA stores
    both fp8 tiles and their scales. Every scale tile is a whole 128 x 128 tile's row or column,
    so each CTA's results are final.

    Args:
      x: `[M, K]` bf16 or fp16, M and K multiples of 128 (`quantize_supports`).
      dtype: "e4m3" or "e5m2" (or the jnp dtype).
      live_rows: None, or an int32 scalar: x's rows from it on are quantized as zeros, as if
        x were zeroed there first (rows past a grouped matmul's groups), in the same pass.
      interpret: run in the Mosaic GPU interpreter.

    Returns:
      `((q [M, K], scale [M, K / 128]), (q_t [K, M], scale_t [K, M / 128]))`.
    """
    (both,) = _quantize_map(
        None, [x], dtype, results=1, name="fp8_quantize", interpret=interpret, live_rows=live_rows
    )
    return both


def quantize_swiglu(gate, up, dtype="e4m3", *, interpret=False):
    """`quantize_both` of `fp8.swiglu(gate, up)` rounded to the inputs' dtype, from one read of
    `gate` and `up`: the expert FFN's hidden activation quantized in the kernel that computes
    it (it is never written to memory in 16 bits).

    Args:
      gate, up: `[M, F]` bf16 or fp16 (the gate and up projections), M and F multiples of 128.
      dtype: "e4m3" or "e5m2".
      interpret: run in the Mosaic GPU interpreter.

    Returns:
      `((q [M, F], scale [M, F / 128]), (q_t [F, M], scale_t [F, M / 128]))`.
    """
    (both,) = _quantize_map(
        lambda g, u: (fp8.swiglu(g, u),), [gate, up], dtype, results=1,
        name="fp8_quantize_swiglu", interpret=interpret,
    )  # fmt: skip
    return both


def quantize_swiglu_grad(dh, gate, up, dtype="e4m3", *, interpret=False):
    """`quantize_both` of each of `fp8.swiglu_grad(dh, gate, up)` (the gradients of the gate
    and up projections) rounded to the inputs' dtype, from one read of `dh`, `gate` and `up`.

    Args:
      dh: `[M, F]` the hidden activation's gradient; gate, up: `[M, F]`, as saved by the
        forward. 16-bit floats, M and F multiples of 128.
      dtype: "e4m3" or "e5m2" (the recipe's gradient format).
      interpret: run in the Mosaic GPU interpreter.

    Returns:
      `(dgate, dup)`, each as `quantize_both` returns.
    """
    return _quantize_map(
        fp8.swiglu_grad, [dh, gate, up], dtype, results=2, name="fp8_quantize_swiglu_grad",
        interpret=interpret,
    )  # fmt: skip


def quantize_blocks_both(w, dtype="e4m3", *, interpret=False):
    """`(fp8.quantize_blocks(w, dtype), fp8.transpose_blocks(*fp8.quantize_blocks(w, dtype)))`
    from one read of `w`: the weights as the lhs gradient reads them and transposed, as the
    forward does, bit for bit (XLA reads `w` twice: its block maxima, then the two copies).

    One CTA per 128 x 128 block: TMA brings it to shared memory; the warpgroup loads it into
    registers, takes its maximum (the rows' maxima, then theirs: one value per block), and
    quantizes it as it is and, loaded again transposed, as `w^T`. An fp32 block (which Mosaic
    GPU does not load transposed) is quantized once: the fp8 values, exact in fp16, are staged
    in fp16 over the dead fp32 tile and loaded from there transposed. The scale goes out as a
    row of 128 equal values per block (`[G, K / 128, N / 128, 128]`: TMA stores whole vectors),
    of which the first is kept.

    Args:
      w: `[G, K, N]` bf16, fp16 or fp32, K and N multiples of 128 (`quantize_blocks_supports`).
      dtype: "e4m3" or "e5m2" (or the jnp dtype).
      interpret: run in the Mosaic GPU interpreter.

    Returns:
      `((q [G, K, N], scale [G, K / 128, N / 128]),
      (q_t [G, N, K], scale_t [G, N / 128, K / 128]))`.
    """
    dtype = fp8.fp8_dtype(dtype)
    supported = quantize_blocks_supports(w, dtype)
    _check_quantizable(w, dtype, supported, "quantize_blocks_both", "[G, K, N] (or fp32)")
    g, k, n = w.shape
    big = fp8.fmax(dtype)
    wide = jnp.dtype(w.dtype).itemsize == 4

    def body(w_gmem, q_gmem, qt_gmem, s_gmem, w_tile, q_smem, qt_smem, s_smem, barrier):
        w_smem, staged = w_tile if wide else (w_tile, None)
        e, i, j = lax.axis_index("g"), lax.axis_index("k"), lax.axis_index("n")
        rows, cols = pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)
        plgpu.copy_gmem_to_smem(w_gmem.at[e, rows, cols], w_smem, barrier)
        plgpu.barrier_wait(barrier)
        block = _load_f32(w_smem, interpret)
        scale = fp8.tile_scale(jnp.max(jnp.max(jnp.abs(block), axis=1)), dtype)
        q = _quantized_tile(block, scale, big, dtype)
        q_smem[...] = q
        if wide:
            plgpu.commit_smem()  # every thread has loaded the fp32 tile before it is reused
            staged[...] = q.astype(jnp.float16)
            plgpu.commit_smem()
            loaded = mgpu_compat.load(staged.T, layout=plgpu.Layout.WGMMA, interpret=interpret)
            qt_smem[...] = loaded.astype(dtype)
        else:
            qt_smem[...] = _quantized_tile(_load_f32(w_smem.T, interpret), scale, big, dtype)
        s_smem[...] = jnp.broadcast_to(scale, (TILE,))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, q_gmem.at[e, rows, cols])
        plgpu.copy_smem_to_gmem(qt_smem, qt_gmem.at[e, cols, rows])
        plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[e, i, j])
        plgpu.wait_smem_to_gmem(0)

    def tile(dt):
        return plgpu.SMEM((TILE, TILE), dt, transforms=_transforms(TILE, dt))

    w_tile = plgpu.RefUnion(tile(w.dtype), tile(jnp.float16)) if wide else tile(w.dtype)
    q, q_t, scale = _quantizer(
        body, w, dtype,
        out_type=(
            jax.ShapeDtypeStruct((g, k, n), dtype),
            jax.ShapeDtypeStruct((g, n, k), dtype),
            jax.ShapeDtypeStruct((g, k // TILE, n // TILE, TILE), jnp.float32),
        ),
        scratch=[w_tile, tile(dtype), tile(dtype), plgpu.SMEM((TILE,), jnp.float32)],
        grid=(g, k // TILE, n // TILE), grid_names=("g", "k", "n"),
        name="fp8_quantize_blocks", interpret=interpret,
    )  # fmt: skip
    scale = scale[..., 0]
    return (q, scale), (q_t, jnp.swapaxes(scale, 1, 2))


def _pad_to(x, multiples, value=0):
    widths = [(0, -d % t) for d, t in zip(x.shape, multiples, strict=True)]
    return jnp.pad(x, widths, constant_values=value) if any(w for _, w in widths) else x


def _check_aligned(group_alignment: int) -> None:
    if group_alignment % TILE:
        raise ValueError(
            f"the fp8 Mosaic GPU kernels need group_alignment a multiple of {TILE}, got "
            f"{group_alignment} (fp8_ops emulates for unaligned groups)"
        )


def _interpret(interpret):
    if not interpret:
        return False
    return interpret if type(interpret).__name__ == "InterpretGPUParams" else True


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
        interpret=_interpret(interpret), split=split, pipeline=pipeline,
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
        interpret=_interpret(interpret), split=split, pipeline=pipeline,
    )  # fmt: skip
    return out[:, :k, :n]
