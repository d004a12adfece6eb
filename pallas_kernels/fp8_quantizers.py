"""Fused fp8 quantizers on Hopper (Mosaic GPU): each reads its 16-bit (or fp32) inputs once and
writes the two quantized copies the fp8 grouped matmuls of `fp8_mosaic_gpu` read, bit for bit
the quantization of `pallas_kernels.fp8` (XLA reads each input twice, once per layout).

  * `quantize_both`: an activation `x` as `fp8.quantize_rows(x)` and `fp8.quantize_cols(x)`,
    its rows past the groups zeroed on the way (`live_rows=`).
  * `quantize_blocks_both`: the weights `w` (16-bit or fp32 master weights) as
    `fp8.quantize_blocks(w)` and its transpose.
  * `quantize_swiglu` and `quantize_swiglu_grad`: the SwiGLU activation, or its gradients,
    computed and quantized both ways in the same pass (`fp8_ops.fp8_swiglu_ffn`).

One CTA per 128 x 128 tile (a scale block), one warpgroup each: TMA brings the tiles to shared
memory, the warpgroup loads them into registers as they are and transposed, and TMA stores the
fp8 tiles and their scales. Every scale covers one whole tile's row, column or block, so each
CTA's results are final. They need a Mosaic GPU that loads tiles transposed (jax 0.11+).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import fp8, mgpu_compat, vma
from pallas_kernels.mosaic_gpu import _transforms

TILE = fp8.BLOCK  # one scale's 128 elements along each quantized axis
HALF = TILE // 2  # the 64 x 64 quarters an elementwise function runs on
_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


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
        and jnp.dtype(dtype) in _FP8
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

    interpret = mgpu_compat.interpret_mode(interpret)
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


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
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


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
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


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
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


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
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
