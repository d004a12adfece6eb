"""The fp8 Mosaic GPU kernels (pallas_kernels.fp8_mosaic_gpu) in the Mosaic GPU interpreter on
CPU, against the dequantize-then-matmul reference, and which kernels `fp8_ops` runs where.

The kernels sum exact fp8 products per 128-deep K block in fp32, then scale; the reference
multiplies the dequantized (fp32) operands. Both are fp32 sums of the same real products, so
they differ by fp32 rounding only: elementwise within 2 (depth + 2) 2^-24 (|a| @ |b|) of each
other (each within (depth + 2) 2^-24 (|a| @ |b|) of the exact sum, Higham's gamma_n, plus the
rounding of the two scale multiplications), which is what the tests check, at depths where fp8
rounding (2^-4) would be far outside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8, fp8_mosaic_gpu, fp8_ops, introspect, mgpu_compat, targets

SIZES = [128, 0, 256]  # an empty group; rows 384..511 are past the groups


def _x(m, k, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    rows = jnp.exp2(jax.random.randint(keys[0], (m, 1), -3, 3).astype(jnp.float32))
    return jax.random.normal(keys[1], (m, k)) * rows


def _fp32_close(got, a, b, depth, product):
    """|got - want| <= 2 (depth + 2) 2^-24 (|a| @ |b|), with want and the bound from `product`."""
    want = product(np.asarray(a, np.float64), np.asarray(b, np.float64))
    bound = 2 * (depth + 2) * 2.0**-24 * product(np.abs(np.asarray(a, np.float64)),
                                                  np.abs(np.asarray(b, np.float64)))  # fmt: skip
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound + 1e-30), float(np.max(err - bound))


def _group_rows(m, sizes=SIZES):
    g = np.full(m, -1)
    start = 0
    for i, s in enumerate(sizes):
        g[start : start + s] = i
        start += s
    return g


def _gmm_t(a, b, sizes=SIZES):  # rows of group i times b[i]^T
    g, out = _group_rows(a.shape[0], sizes), np.zeros((a.shape[0], b.shape[1]))
    for i in range(b.shape[0]):
        out[g == i] = a[g == i] @ b[i].T
    return out


def _tgmm(a_t, b_t, sizes=SIZES):  # per group a_t[:, rows] @ b_t[:, rows]^T
    g = _group_rows(a_t.shape[1], sizes)
    return np.stack([a_t[:, g == i] @ b_t[:, g == i].T for i in range(len(sizes))])


@pytest.mark.parametrize("pipeline", fp8_mosaic_gpu.PIPELINES)
@pytest.mark.parametrize("split", fp8_mosaic_gpu.SPLITS)
def test_fp8_gmm_matches_dequantized_reference(split, pipeline):
    m, k, n = 512, 256, 128  # two K blocks with different scales, a tile past the groups
    sizes = jnp.array(SIZES, jnp.int32)
    xq = fp8.quantize_rows(_x(m, k))
    wq = fp8.transpose_blocks(*fp8.quantize_blocks(jax.random.normal(jax.random.key(1), (3, k, n))))

    def run(*args):
        return fp8_mosaic_gpu.fp8_gmm(
            *args, sizes, out_dtype=jnp.float32, group_alignment=128, interpret=True, split=split,
            pipeline=pipeline,
        )  # fmt: skip

    calls = introspect.traced_kernel_calls(run, *xq, *wq, platform="cpu")
    assert [str(c) for c in calls] == ["fp8_gmm/interpret"]
    out = np.asarray(run(*xq, *wq))
    assert not out[384:].any()
    _fp32_close(out, fp8.dequantize_rows(*xq), fp8.dequantize_blocks(*wq), k, _gmm_t)


@pytest.mark.parametrize("pipeline", fp8_mosaic_gpu.PIPELINES)
@pytest.mark.parametrize("split", fp8_mosaic_gpu.SPLITS)
def test_fp8_tgmm_matches_dequantized_reference(split, pipeline):
    m, k, n = 512, 128, 128
    sizes = jnp.array(SIZES, jnp.int32)
    live = (_group_rows(m) >= 0)[:, None]
    xt = fp8.quantize_cols(jnp.where(live, _x(m, k), 0))
    dyt = fp8.quantize_cols(jnp.where(live, _x(m, n, seed=2), 0))

    def run(*args):
        return fp8_mosaic_gpu.fp8_tgmm(
            *args, sizes, out_dtype=jnp.float32, group_alignment=128, interpret=True, split=split,
            pipeline=pipeline,
        )  # fmt: skip

    calls = introspect.traced_kernel_calls(run, *xt, *dyt, platform="cpu")
    assert [str(c) for c in calls] == ["fp8_tgmm/interpret"]
    out = np.asarray(run(*xt, *dyt))
    assert out.shape == (3, k, n) and not out[1].any()  # the empty group
    _fp32_close(out, fp8.dequantize_rows(*xt), fp8.dequantize_rows(*dyt), 256, _tgmm)


@pytest.mark.parametrize("pipeline", fp8_mosaic_gpu.PIPELINES)
@pytest.mark.parametrize("kernel", ["fp8_gmm", "fp8_tgmm"])
def test_kernels_reuse_their_ring_across_tiles(kernel, pipeline):
    """Each of the interpreter's 2 CTAs walks several tiles, so the 4-slot shared-memory ring is
    refilled many times, across tiles ("stream": 8 K blocks a CTA in one ring; "per_tile": a
    ring filled and drained per tile), with groups of 1 and 2 row blocks: every block's fp8
    tile and scales reach the right step."""
    groups = [128, 128, 256]
    sizes = jnp.array(groups, jnp.int32)
    kw = dict(out_dtype=jnp.float32, group_alignment=128, interpret=True, pipeline=pipeline)
    if kernel == "fp8_gmm":
        m, k, n = 512, 256, 256  # 8 tiles of 2 K blocks
        xq = fp8.quantize_rows(_x(m, k))
        w = jax.random.normal(jax.random.key(1), (3, k, n))
        wq = fp8.transpose_blocks(*fp8.quantize_blocks(w))
        out = fp8_mosaic_gpu.fp8_gmm(*xq, *wq, sizes, **kw)
        operands = fp8.dequantize_rows(*xq), fp8.dequantize_blocks(*wq)
        product, depth = functools.partial(_gmm_t, sizes=groups), k
    else:
        m, k, n = 512, 384, 256  # 6 tiles a group, of 1 or 2 row blocks
        xt = fp8.quantize_cols(_x(m, k))
        dyt = fp8.quantize_cols(_x(m, n, seed=2))
        out = fp8_mosaic_gpu.fp8_tgmm(*xt, *dyt, sizes, **kw)
        operands = fp8.dequantize_rows(*xt), fp8.dequantize_rows(*dyt)
        product, depth = functools.partial(_tgmm, sizes=groups), 256
    _fp32_close(np.asarray(out), *operands, depth, product)


FORMATS = ["e4m3", "e5m2"]


@pytest.mark.slow
@pytest.mark.parametrize("grad_format", FORMATS)
def test_recipe_on_the_kernels_matches_emulation(grad_format):
    """fp8_grouped_matmul forward and VJP on the kernels (interpreted) vs emulated, with K and
    N not multiples of 128 (the ops pad) and a 16-bit output."""
    if not fp8_mosaic_gpu.supports(jnp.float8_e4m3fn, fp8.fp8_dtype(grad_format)):
        pytest.skip(f"jax {jax.__version__}'s Mosaic GPU wgmma does not mix e4m3 with e5m2")
    m, k, n = 512, 200, 136
    sizes = jnp.array(SIZES, jnp.int32)
    x = _x(m, k).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(3), (3, k, n)) * 0.1).astype(jnp.bfloat16)
    dy = _x(m, n, seed=4).astype(jnp.bfloat16)

    def fwd_vjp(backend):
        def f(x, w):
            return fp8_ops.fp8_grouped_matmul(
                x, w, sizes, grad_format=grad_format, backend=backend, group_alignment=128,
                interpret=backend != "emulated",
            )  # fmt: skip

        out, vjp = jax.vjp(f, x, w)
        return (out, *vjp(dy))

    calls = introspect.traced_kernel_calls(lambda: fwd_vjp("pallas_mosaic_gpu"), platform="cpu")
    assert [str(c) for c in calls] == [f"fp8_{c}/interpret" for c in ("gmm", "gmm", "tgmm")]
    got = jax.jit(lambda: fwd_vjp("pallas_mosaic_gpu"))()
    want = jax.jit(lambda: fwd_vjp("emulated"))()
    # |A| @ |B| of each product's dequantized operands (as the recipe quantizes them).
    live = (_group_rows(m) >= 0)[:, None]
    absq = lambda q: np.abs(np.asarray(q, np.float64))  # noqa: E731
    wq = absq(fp8.dequantize_blocks(*fp8.quantize_blocks(w)))
    xq = absq(fp8.dequantize_rows(*fp8.quantize_rows(x)))
    dyq = absq(fp8.dequantize_rows(*fp8.quantize_rows(dy, grad_format)))
    xt = absq(fp8.dequantize_rows(*fp8.quantize_cols(jnp.where(live, x, 0))))
    dyt = absq(fp8.dequantize_rows(*fp8.quantize_cols(jnp.where(live, dy, 0), grad_format)))
    mass = {
        "out": (_gmm_t(xq, np.swapaxes(wq, 1, 2)), k),
        "dx": (_gmm_t(dyq, wq), n),
        "dw": (_tgmm(xt, dyt), m),
    }
    for a, b, what in zip(got, want, ("out", "dx", "dw"), strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16, what
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        # Two fp32 sums of the same products (module docstring), each rounded to bf16 (unit
        # roundoff 2^-8).
        ab, depth = mass[what]
        bound = 2.0**-8 * (np.abs(a) + np.abs(b)) + 2 * (depth + 2) * 2.0**-24 * ab * 1.01
        i = np.unravel_index(np.argmax(np.abs(a - b) - bound), a.shape)
        assert np.all(np.abs(a - b) <= bound), (what, i, a[i], b[i], bound[i], ab[i])
        assert np.mean(a == b) > 0.9, what


def test_auto_runs_the_kernels_only_for_hopper_and_aligned_groups():
    x = jnp.ones((256, 128), jnp.bfloat16)
    w = jnp.ones((2, 128, 128), jnp.bfloat16)
    sizes = jnp.array([128, 128], jnp.int32)

    def calls(mesh, alignment, platform="cuda"):
        def f(x, w):
            return fp8_ops.fp8_grouped_matmul(x, w, sizes, group_alignment=alignment)

        with jax.sharding.use_abstract_mesh(mesh):
            return [str(c) for c in introspect.traced_kernel_calls(f, x, w, platform=platform)]

    h100 = targets.abstract_gpu_mesh()
    fused = ["fp8_quantize_blocks/mosaic_gpu", "fp8_quantize/mosaic_gpu"]
    fused = fused if mgpu_compat.LOADS_TRANSPOSED else []
    assert calls(h100, 128) == [*fused, "fp8_gmm/mosaic_gpu"]
    assert calls(h100, 1) == []  # unaligned groups: emulated
    assert calls(h100, 128, platform="cpu") == []  # the same program lowered for CPU
    with pytest.raises(ValueError, match="group_alignment=1"):
        fp8_ops.fp8_grouped_matmul(x, w, sizes, backend="pallas_mosaic_gpu")


def test_mixed_formats_follow_the_installed_jax():
    mixed = fp8_mosaic_gpu.supports(jnp.float8_e5m2, jnp.float8_e4m3fn)
    assert mixed == mgpu_compat.WGMMA_MIXES_FP8
    assert fp8_mosaic_gpu.supports(jnp.float8_e4m3fn, jnp.float8_e4m3fn)
    assert not fp8_mosaic_gpu.supports(jnp.bfloat16, jnp.float8_e4m3fn)


def _ffn_case(m=512, d=256, f=384, g=3):
    keys = jax.random.split(jax.random.key(11), 5)
    x = _x(m, d).astype(jnp.bfloat16)
    ws = [(jax.random.normal(keys[i], s) * 0.1).astype(jnp.bfloat16)
          for i, s in ((1, (g, d, f)), (2, (g, d, f)), (3, (g, f, d)))]  # fmt: skip
    dy = _x(m, d, seed=4).astype(jnp.bfloat16)
    return x, ws, dy


def _ffn_vjp(backend, sizes, x, ws, dy, *, fused=True, grad_format="e4m3"):
    kw = dict(backend=backend, group_alignment=128, interpret=backend != "emulated",
              grad_format=grad_format)  # fmt: skip

    def ffn(x, *ws):
        if fused:
            return fp8_ops.fp8_swiglu_ffn(x, *ws, sizes, **kw)

        def mm(a, w):
            return fp8_ops.fp8_grouped_matmul(a, w, sizes, **kw)

        h = fp8.swiglu(mm(x, ws[0]), mm(x, ws[1])).astype(x.dtype)
        return mm(h, ws[2])

    out, vjp = jax.vjp(ffn, x, *ws)
    return (out, *vjp(dy))


def test_fp8_swiglu_ffn_is_the_three_fp8_matmuls_and_the_activation():
    """Emulated: the fused FFN computes what three fp8_grouped_matmul calls around the same
    activation (fp8.swiglu rounded to bf16) compute, forward and every gradient, to fp32
    summation order and bf16 rounding of the same quantized products (the custom VJP's
    activation gradient is fp8.swiglu_grad, autodiff's through fp8.swiglu; they agree to fp32
    rounding, which bf16 absorbs but for rare flips)."""
    sizes = jnp.array(SIZES, jnp.int32)
    x, ws, dy = _ffn_case()
    got = jax.jit(lambda: _ffn_vjp("emulated", sizes, x, ws, dy))()
    want = jax.jit(lambda: _ffn_vjp("emulated", sizes, x, ws, dy, fused=False))()
    for what, a, b in zip(("out", "dx", "dw_gate", "dw_up", "dw_down"), got, want, strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16 and a.shape == b.shape, what
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.mean(a == b) > 0.99, what
        assert np.linalg.norm(a - b) <= 2**-8 * np.linalg.norm(b), what
    live = _group_rows(x.shape[0]) >= 0
    assert np.all(np.asarray(got[0])[~live] == 0) and np.all(np.asarray(got[1])[~live] == 0)


@pytest.mark.slow
@pytest.mark.skipif(
    not mgpu_compat.LOADS_TRANSPOSED, reason=f"jax {jax.__version__}: no transposed tile loads"
)
def test_fp8_swiglu_ffn_on_the_kernels_matches_emulation():
    """fp8_swiglu_ffn forward and VJP on the kernels (interpreted: 6 fp8_gmm, 3 fp8_tgmm, the
    fused quantizers) against the emulated op: the same quantized operands (the quantizers are
    the XLA quantization bit for bit, above), so the products differ by fp32 summation order and
    each output by its bf16 rounding; an intermediate (gate, up, dh) rounded differently to
    bf16 can move one fp8 operand element by a step, so a few outputs may differ by more."""
    sizes = jnp.array(SIZES, jnp.int32)
    x, ws, dy = _ffn_case()
    run = functools.partial(_ffn_vjp, "pallas_mosaic_gpu", sizes, x, ws, dy)
    calls = sorted(str(c) for c in introspect.traced_kernel_calls(run, platform="cpu"))
    assert calls == sorted(
        ["fp8_gmm/interpret"] * 6 + ["fp8_tgmm/interpret"] * 3
        + ["fp8_quantize_blocks/interpret"] * 3 + ["fp8_quantize/interpret"] * 2
        + ["fp8_quantize_swiglu/interpret", "fp8_quantize_swiglu_grad/interpret"]
    )  # fmt: skip
    got = jax.jit(run)()
    want = jax.jit(lambda: _ffn_vjp("emulated", sizes, x, ws, dy))()
    for what, a, b in zip(("out", "dx", "dw_gate", "dw_up", "dw_down"), got, want, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        close = np.abs(a - b) <= 2.0**-8 * (np.abs(a) + np.abs(b)) + 1e-6 * np.abs(b).max()
        assert np.mean(close) > 0.999, (what, np.mean(close))
        assert np.linalg.norm(a - b) <= 2**-8 * np.linalg.norm(b), what
