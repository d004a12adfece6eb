"""The differentiable fp8 grouped matmul of the DeepSeek-V3 recipe (`fp8_grouped_matmul`), and
the SwiGLU expert FFN built on its products with each quantization fused into the pass that
produces its operand (`fp8_swiglu_ffn`).

Forward `out = x @ w[g]`, lhs gradient `dx = dy @ w[g]^T`, weight gradient `dw[g] = x_g^T dy_g`,
each with block-scaled fp8 operands (`pallas_kernels.fp8`):
  * x: e4m3, 1 x 128 tiles along K (forward); the weight gradient reads x^T quantized along the
    rows (128 x 1 tiles of x), which is what the forward keeps for the backward (in fp8).
  * w: e4m3, 128 x 128 blocks, quantized once: the forward reads the transposed copy, the lhs
    gradient the weights as stored (both K-major).
  * dy: `grad_format` (e4m3 as DeepSeek-V3, or e5m2), 1 x 128 along N for the lhs gradient and
    128 x 1 (dy^T along the rows) for the weight gradient.
Each product is fp32-accumulated and returned in the output dtype (the operands' for gradients).

Two ways to run the three products, same numerics up to fp32 summation order:
  * "emulated": dequantize to fp32 and multiply with float grouped matmuls (`Matmuls`: the
    reference `ragged_dot` ones by default; `moejax` passes its own). Any backend.
  * "pallas_mosaic_gpu": the fp8 Mosaic GPU kernels (`fp8_mosaic_gpu`, Hopper): the tensor
    cores accumulate each 128-deep K block of fp8 products, promoted into an fp32 accumulator
    times the two tiles' scales.
Where the kernels run, each activation (x in the forward, dy in the backward) is quantized both
ways in one read (`fp8_quantizers.quantize_both`: the bits of the XLA quantization, which reads
x twice per layout), and so are the weights (`fp8_quantizers.quantize_blocks_both`: `w` and
`w^T` from one read, where XLA reads w twice).
"auto" picks the kernels when compiled for a Hopper GPU with 128-aligned groups and operand
formats the installed jax's wgmma takes (`kernel_supports`), and emulates elsewhere (decided at
lowering, like `ops`).

Rows past `sum(group_sizes)` are zeroed before the rows are quantized in 128-row tiles (by the
fused quantizers as they read them), so
padding never sets a tile's scale; groups that are not 128-aligned share boundary tiles
(which only coarsens the scale of those tiles).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import fp8, targets
from pallas_kernels.ops import same_varying_axes
from pallas_kernels.reference import reference_gmm, reference_tgmm
from pallas_kernels.vma import match_varying

FP8_BACKENDS = ("auto", "emulated", "pallas_mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class Matmuls:
    """Float grouped matmuls the emulated path runs on dequantized fp32 operands.

    gmm: `(lhs [M, K], rhs [G, K, N], group_sizes) -> [M, N]`.
    gmm_t: `(lhs [M, N], rhs [G, K, N], group_sizes) -> lhs @ rhs[g]^T [M, K]`.
    tgmm: `(lhs [M, K], rhs [M, N], group_sizes) -> [G, K, N]`.
    """

    gmm: Callable
    gmm_t: Callable
    tgmm: Callable


REFERENCE_MATMULS = Matmuls(
    gmm=functools.partial(reference_gmm, preferred_element_type=jnp.float32),
    gmm_t=functools.partial(reference_gmm, transpose_rhs=True, preferred_element_type=jnp.float32),
    tgmm=functools.partial(reference_tgmm, preferred_element_type=jnp.float32),
)


def _mask_rows(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    live = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(live[:, None], x, jnp.zeros((), x.dtype))


# The three products on quantized operands. `lhs`: (q [M, Kc], scale [M, Kc/128]) rowwise;
# `rhs_kmajor`: (q [G, Nout, Kc], scale [G, Nout/128, Kc/128]) blocks, contracted on its last axis.
def _gmm_q(lhs, rhs_kmajor, group_sizes, *, backend, matmuls, out_dtype, alignment, interpret,
           split, pipeline):  # fmt: skip
    def emulated():  # rows past the groups zeroed, as the kernel leaves them
        x = fp8.dequantize_rows(*lhs)
        w = fp8.dequantize_blocks(*rhs_kmajor)
        return _mask_rows(matmuls.gmm_t(x, w, group_sizes).astype(out_dtype), group_sizes)

    def kernel():
        from pallas_kernels import fp8_mosaic_gpu

        return fp8_mosaic_gpu.fp8_gmm(
            *lhs, *rhs_kmajor, group_sizes, out_dtype=out_dtype, group_alignment=alignment,
            interpret=interpret, split=split, pipeline=pipeline,
        )  # fmt: skip

    return _on_target(backend, emulated, kernel, lhs[0].dtype, rhs_kmajor[0].dtype, alignment)


# lhs_t: (q [K, M], scale [K, M/128]), rhs_t: (q [N, M], scale [N, M/128]): both along the rows.
def _tgmm_q(lhs_t, rhs_t, group_sizes, *, backend, matmuls, out_dtype, alignment, interpret,
            split, pipeline):  # fmt: skip
    def emulated():
        x = fp8.dequantize_rows(*lhs_t).T
        dy = fp8.dequantize_rows(*rhs_t).T
        return matmuls.tgmm(x, dy, group_sizes).astype(out_dtype)

    def kernel():
        from pallas_kernels import fp8_mosaic_gpu

        return fp8_mosaic_gpu.fp8_tgmm(
            *lhs_t, *rhs_t, group_sizes, out_dtype=out_dtype, group_alignment=alignment,
            interpret=interpret, split=split, pipeline=pipeline,
        )  # fmt: skip

    return _on_target(backend, emulated, kernel, lhs_t[0].dtype, rhs_t[0].dtype, alignment)


def kernel_supports(lhs_dtype, rhs_dtype, group_alignment: int) -> bool:
    """Whether the fp8 Mosaic GPU kernels run this product on the installed jax: groups
    aligned to their 128-row tile, and an operand pair Mosaic GPU's wgmma takes (a mixed
    e4m3/e5m2 pair from jax 0.11 on)."""
    from pallas_kernels import fp8_mosaic_gpu

    return group_alignment % fp8_mosaic_gpu.TILE == 0 and fp8_mosaic_gpu.supports(
        lhs_dtype, rhs_dtype
    )


def _quantize_both(x, dtype, group_sizes, **kw):
    """`(fp8.quantize_rows(x), fp8.quantize_cols(x))` of x with its rows past the groups zeroed
    (so that they set no scale of the 128 x 1 tiles): where the kernels run, one read of x that
    zeroes them as it goes (`fp8_quantizers.quantize_both`, the same bits), else XLA's
    masking pass and two passes per layout."""
    from pallas_kernels import fp8_quantizers

    def xla():
        masked = _mask_rows(x, group_sizes)
        return fp8.quantize_rows(masked, dtype), fp8.quantize_cols(masked, dtype)

    def kernel():
        return fp8_quantizers.quantize_both(
            x, dtype, live_rows=jnp.sum(group_sizes), interpret=kw["interpret"]
        )

    supported = fp8_quantizers.quantize_supports(x, fp8.fp8_dtype(dtype))
    return _fused_where_kernels_run(xla, kernel, supported, **kw)


def _quantize_weights(w, **kw):
    """`(wq, wq^T)`: the e4m3 block quantization of `w [G, K, N]` as stored (the lhs gradient
    reads it) and transposed (the forward's K-major copy). Where the kernels run, one read of w
    (`fp8_quantizers.quantize_blocks_both`, the same bits), else XLA's two passes."""
    from pallas_kernels import fp8_quantizers

    def xla():
        wq = fp8.quantize_blocks(w, "e4m3")
        return wq, fp8.transpose_blocks(*wq)

    def kernel():
        return fp8_quantizers.quantize_blocks_both(w, "e4m3", interpret=kw["interpret"])

    supported = fp8_quantizers.quantize_blocks_supports(w, fp8.fp8_dtype("e4m3"))
    return _fused_where_kernels_run(xla, kernel, supported, **kw)


def _quantize_swiglu(gate, up, **kw):
    """`quantize_both` of `fp8.swiglu(gate, up)` in gate's dtype (e4m3): where the kernels run,
    computed and quantized in one kernel (`fp8_quantizers.quantize_swiglu`), else by XLA (the
    same fp32 expression, up to XLA's and the kernel's fp32 evaluation order)."""
    from pallas_kernels import fp8_quantizers

    def xla():
        h = fp8.swiglu(gate, up).astype(gate.dtype)
        return fp8.quantize_rows(h, "e4m3"), fp8.quantize_cols(h, "e4m3")

    def kernel():
        return fp8_quantizers.quantize_swiglu(gate, up, "e4m3", interpret=kw["interpret"])

    supported = fp8_quantizers.quantize_supports(gate, fp8.fp8_dtype("e4m3"))
    return _fused_where_kernels_run(xla, kernel, supported, **kw)


def _quantize_swiglu_grad(dh, gate, up, dtype, **kw):
    """`quantize_both` of each of `fp8.swiglu_grad(dh, gate, up)` in dh's dtype: where the
    kernels run, in one kernel (`fp8_quantizers.quantize_swiglu_grad`), else by XLA."""
    from pallas_kernels import fp8_quantizers

    def xla():
        return tuple(
            (fp8.quantize_rows(d, dtype), fp8.quantize_cols(d, dtype))
            for d in fp8.swiglu_grad(dh, gate, up)
            for d in [d.astype(dh.dtype)]
        )

    def kernel():
        return fp8_quantizers.quantize_swiglu_grad(dh, gate, up, dtype, interpret=kw["interpret"])

    supported = fp8_quantizers.quantize_supports(dh, fp8.fp8_dtype(dtype))
    return _fused_where_kernels_run(xla, kernel, supported, **kw)


def _fused_where_kernels_run(xla, kernel, supported, *, backend, alignment, **_):
    """A fused quantizer's `kernel()` where the fp8 kernels run and it takes the operand
    (`supported`), else the `xla()` quantization (the same bits)."""
    from pallas_kernels import fp8_mosaic_gpu

    if backend == "emulated" or alignment % fp8_mosaic_gpu.TILE or not supported:
        return xla()
    if backend == "pallas_mosaic_gpu":
        return kernel()
    kind = targets.gpu_kind()
    if kind is not None and not targets.is_hopper(kind):
        return xla()
    return jax.lax.platform_dependent(cuda=kernel, default=xla)


def _on_target(backend, emulated, kernel, lhs_dtype, rhs_dtype, alignment):
    if backend == "emulated":
        return emulated()
    supported = kernel_supports(lhs_dtype, rhs_dtype, alignment)
    if backend == "pallas_mosaic_gpu":
        if not supported:
            raise ValueError(
                f"the fp8 Mosaic GPU kernels do not run {lhs_dtype} x {rhs_dtype} operands with "
                f"group_alignment={alignment} on jax {jax.__version__} (they need groups "
                "aligned to 128, and jax >= 0.11 to mix e4m3 with e5m2): use backend='auto'"
            )
        return kernel()
    # "auto": the kernels when lowering for a Hopper GPU (a GPU target that names no device
    # counts as one, as in `ops.gpu_backend`), emulated on every other platform.
    kind = targets.gpu_kind()
    if not supported or (kind is not None and not targets.is_hopper(kind)):
        return emulated()
    return jax.lax.platform_dependent(cuda=kernel, default=emulated)


def _options(backend, matmuls, opts) -> dict:
    """The products' keywords from `_fp8_gmm`'s static arguments."""
    alignment, interpret, split, pipeline = opts
    return dict(
        backend=backend, matmuls=matmuls, alignment=alignment, interpret=interpret, split=split,
        pipeline=pipeline,
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _fp8_gmm(lhs, rhs, group_sizes, grad_format, out_dtype, backend, matmuls, opts):
    out, _ = _fwd(lhs, rhs, group_sizes, grad_format, out_dtype, backend, matmuls, opts)
    return out


def _fwd(lhs, rhs, group_sizes, grad_format, out_dtype, backend, matmuls, opts):
    kw = _options(backend, matmuls, opts)
    wq, wq_t = _quantize_weights(rhs, **kw)
    # Rows past the groups are zeroed as they are quantized: they then set no scale of the
    # 128 x 1 tiles, and the forward's products leave them out either way.
    x, x_t = _quantize_both(lhs, "e4m3", group_sizes, **kw)
    out = _gmm_q(x, wq_t, group_sizes, out_dtype=out_dtype, **kw)
    # Kept for the backward, in fp8: x^T along the rows and the block-quantized weights.
    return out, (x_t, wq, group_sizes, lhs, rhs)


def _bwd(grad_format, out_dtype, backend, matmuls, opts, residuals, dout):
    x_t, wq, group_sizes, lhs, rhs = residuals
    kw = _options(backend, matmuls, opts)
    dout, dout_t = _quantize_both(dout, grad_format, group_sizes, **kw)
    dlhs = _gmm_q(dout, wq, group_sizes, out_dtype=lhs.dtype, **kw)
    drhs = _tgmm_q(x_t, dout_t, group_sizes, out_dtype=rhs.dtype, **kw)
    return match_varying(dlhs, lhs), match_varying(drhs, rhs), None


def _fwd_rule(lhs, rhs, group_sizes, grad_format, out_dtype, backend, matmuls, opts):
    out, (x_t, wq, group_sizes, *_) = _fwd(
        lhs, rhs, group_sizes, grad_format, out_dtype, backend, matmuls, opts
    )
    # The backward needs lhs and rhs only for their dtypes and varying axes: zero-size slices.
    return out, (x_t, wq, group_sizes, lhs.reshape(-1)[:0], rhs.reshape(-1)[:0])


_fp8_gmm.defvjp(_fwd_rule, _bwd)


def _check_options(backend, grad_format, split, pipeline) -> None:
    if backend not in FP8_BACKENDS:
        raise ValueError(f"backend must be one of {FP8_BACKENDS}, got {backend!r}")
    fp8.fp8_dtype(grad_format)  # validates the name
    from pallas_kernels import fp8_mosaic_gpu

    if split is not None and split not in fp8_mosaic_gpu.SPLITS:
        raise ValueError(f"split must be one of {fp8_mosaic_gpu.SPLITS}, got {split!r}")
    if pipeline is not None and pipeline not in fp8_mosaic_gpu.PIPELINES:
        raise ValueError(f"pipeline must be one of {fp8_mosaic_gpu.PIPELINES}, got {pipeline!r}")


def fp8_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    grad_format: str = "e4m3",
    preferred_element_type=None,
    backend: str = "auto",
    matmuls: Matmuls = REFERENCE_MATMULS,
    group_alignment: int = 1,
    interpret=False,
    split: str | None = None,
    pipeline: str | None = None,
) -> jax.Array:
    """Differentiable grouped matmul `lhs[rows of g] @ rhs[g]` in block-scaled fp8 (module
    docstring), safe inside `shard_map(check_vma=True)` (as `ops.grouped_matmul`).

    Args:
      lhs: `[M, K]` float, rows sorted by group.
      rhs: `[G, K, N]` float (master weights: quantized on each call).
      group_sizes: `[G]` integer, sum <= M; not differentiated.
      grad_format: fp8 format of the output gradient, "e4m3" (DeepSeek-V3) or "e5m2".
      preferred_element_type: output dtype (None: lhs.dtype); gradients take their operands'.
      backend: "auto", "emulated" or "pallas_mosaic_gpu" (module docstring).
      matmuls: the float matmuls of the emulated path.
      group_alignment: every group size is a multiple of this (the kernels' row alignment).
      interpret: run the Mosaic GPU kernels in their interpreter.
      split: how the kernels' two consumer warpgroups halve a tile
        (`fp8_mosaic_gpu.SPLITS`; None: each kernel's `fp8_mosaic_gpu.DEFAULT_SPLIT`).
      pipeline: how the kernels bring K blocks to shared memory (`fp8_mosaic_gpu.PIPELINES`;
        None: each kernel's `fp8_mosaic_gpu.DEFAULT_PIPELINE`).

    Returns:
      `[M, N]`; rows past sum(group_sizes) are zero.
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"lhs [M, K] and rhs [G, K, N] expected, got {lhs.shape}, {rhs.shape}")
    _check_options(backend, grad_format, split, pipeline)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    lhs, rhs, group_sizes = same_varying_axes(lhs, rhs, group_sizes)
    return _fp8_gmm(
        lhs, rhs, group_sizes, grad_format, out_dtype, backend, matmuls,
        (group_alignment, interpret, split, pipeline),
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fp8_swiglu_ffn(x, w_gate, w_up, w_down, group_sizes, grad_format, backend, matmuls, opts):
    out, _ = _ffn_fwd(x, w_gate, w_up, w_down, group_sizes, grad_format, backend, matmuls, opts)
    return out


def _ffn_fwd(x, w_gate, w_up, w_down, group_sizes, grad_format, backend, matmuls, opts):
    kw = _options(backend, matmuls, opts)
    dtype = x.dtype
    weights = [_quantize_weights(w, **kw) for w in (w_gate, w_up, w_down)]
    (wg, wg_t), (wu, wu_t), (wd, wd_t) = weights
    xq, xq_t = _quantize_both(x, "e4m3", group_sizes, **kw)
    # Rows past the groups come out of the products as zeros (and so does dh's in the
    # backward): they set no scale of h^T (dgate^T, dup^T), with no masking pass over [M, F].
    gate = _gmm_q(xq, wg_t, group_sizes, out_dtype=dtype, **kw)
    up = _gmm_q(xq, wu_t, group_sizes, out_dtype=dtype, **kw)
    h, h_t = _quantize_swiglu(gate, up, **kw)
    out = _gmm_q(h, wd_t, group_sizes, out_dtype=dtype, **kw)
    return out, (xq_t, h_t, gate, up, wg, wu, wd, group_sizes)


def _ffn_fwd_rule(x, w_gate, w_up, w_down, group_sizes, grad_format, backend, matmuls, opts):
    out, res = _ffn_fwd(x, w_gate, w_up, w_down, group_sizes, grad_format, backend, matmuls, opts)
    # The backward needs the inputs only for their dtypes and varying axes: zero-size slices.
    return out, (*res, *(a.reshape(-1)[:0] for a in (x, w_gate, w_up, w_down)))


def _ffn_bwd(grad_format, backend, matmuls, opts, residuals, dout):
    xq_t, h_t, gate, up, wg, wu, wd, group_sizes, x, w_gate, w_up, w_down = residuals
    kw = _options(backend, matmuls, opts)
    dout, dout_t = _quantize_both(dout, grad_format, group_sizes, **kw)
    dh = _gmm_q(dout, wd, group_sizes, out_dtype=x.dtype, **kw)
    # The weight gradients in x's dtype (what a 16-bit weight's would be), then widened to the
    # weights' own (fp32 master weights): the kernels write half the bytes.
    dw_down = _tgmm_q(h_t, dout_t, group_sizes, out_dtype=x.dtype, **kw).astype(w_down.dtype)
    (dgate, dgate_t), (dup, dup_t) = _quantize_swiglu_grad(dh, gate, up, grad_format, **kw)
    # In x's dtype each, then summed, as autodiff sums the two projections' input gradients.
    dx = _gmm_q(dgate, wg, group_sizes, out_dtype=x.dtype, **kw) + _gmm_q(
        dup, wu, group_sizes, out_dtype=x.dtype, **kw
    )
    dw_gate = _tgmm_q(xq_t, dgate_t, group_sizes, out_dtype=x.dtype, **kw).astype(w_gate.dtype)
    dw_up = _tgmm_q(xq_t, dup_t, group_sizes, out_dtype=x.dtype, **kw).astype(w_up.dtype)
    grads = zip((dx, dw_gate, dw_up, dw_down), (x, w_gate, w_up, w_down), strict=True)
    return (*(match_varying(g, like) for g, like in grads), None)


_fp8_swiglu_ffn.defvjp(_ffn_fwd_rule, _ffn_bwd)


def fp8_swiglu_ffn(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    group_sizes: jax.Array,
    *,
    grad_format: str = "e4m3",
    backend: str = "auto",
    matmuls: Matmuls = REFERENCE_MATMULS,
    group_alignment: int = 1,
    interpret=False,
    split: str | None = None,
    pipeline: str | None = None,
) -> jax.Array:
    """Differentiable grouped SwiGLU FFN `(silu(x @ w_gate[g]) * (x @ w_up[g])) @ w_down[g]` with
    all nine of its matmuls (three projections, forward and both gradients) in block-scaled
    fp8 (as `fp8_grouped_matmul`), the quantizations fused into what produces their operands:
      * x is quantized once for both projections (both layouts: the weight gradients read x^T);
      * the hidden activation `h = swiglu(gate, up)` is computed (fp32, rounded to x's dtype as
        a 16-bit producer would write it) and quantized in one pass
        (`fp8_quantizers.quantize_swiglu` where the kernels run): h is never written to memory;
      * in the backward, the gradients of gate and up are computed from `dh`, gate and up and
        quantized in one pass likewise (`quantize_swiglu_grad`).
    The weights are quantized from what they are (fp32 master weights with no 16-bit copy:
    `fp8_quantizers.quantize_blocks_both` reads fp32). The residuals are what the three
    `fp8_grouped_matmul` calls and the activation keep: x^T and h^T in fp8, the quantized
    weights, and gate and up in x's dtype.

    Args:
      x: `[M, D]` float, rows sorted by group.
      w_gate, w_up: `[G, D, F]` float; w_down: `[G, F, D]`: quantized on each call, fp32
        master weights as they are (no 16-bit copy is made; their gradients are rounded to x's
        dtype, as a 16-bit copy's would be, and returned in theirs).
      group_sizes: `[G]` integer, sum <= M; not differentiated.
      grad_format, backend, matmuls, group_alignment, interpret, split, pipeline: as for
        `fp8_grouped_matmul`.

    Returns:
      `[M, D]` in x's dtype; rows past sum(group_sizes) are zero.
    """
    g, d, f = w_gate.shape
    if x.ndim != 2 or x.shape[1] != d or w_up.shape != (g, d, f) or w_down.shape != (g, f, d):
        raise ValueError(
            "x [M, D], w_gate and w_up [G, D, F], w_down [G, F, D] expected, got "
            f"{x.shape}, {w_gate.shape}, {w_up.shape}, {w_down.shape}"
        )
    _check_options(backend, grad_format, split, pipeline)
    group_sizes = group_sizes.astype(jnp.int32)
    x, w_gate, w_up, w_down, group_sizes = same_varying_axes(x, w_gate, w_up, w_down, group_sizes)
    return _fp8_swiglu_ffn(
        x, w_gate, w_up, w_down, group_sizes, grad_format, backend, matmuls,
        (group_alignment, interpret, split, pipeline),
    )  # fmt: skip
