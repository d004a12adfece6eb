"""The fused fp8 quantizers (pallas_kernels.fp8_quantizers) in the Mosaic GPU
interpreter on CPU: bit for bit the XLA quantization (`pallas_kernels.fp8`) of what they read or
compute, free of shared-memory races, and refusing what they cannot run. The H100 compile is in
tests/accelerator/test_deviceless_fp8.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8, fp8_quantizers, introspect, mgpu_compat

FORMATS = ["e4m3", "e5m2"]


def _x(m, k, seed=0):
    """Normal values over rows scaled by 2^-3 .. 2^2: tiles of several binades."""
    keys = jax.random.split(jax.random.key(seed), 2)
    rows = jnp.exp2(jax.random.randint(keys[0], (m, 1), -3, 3).astype(jnp.float32))
    return jax.random.normal(keys[1], (m, k)) * rows


@pytest.mark.skipif(
    not mgpu_compat.LOADS_TRANSPOSED, reason=f"jax {jax.__version__}: no transposed tile loads"
)
@pytest.mark.parametrize("dtype", FORMATS)
def test_quantize_both_is_the_xla_quantization_bit_for_bit(dtype):
    """The fused quantizer (one read of x, interpreted) gives fp8.quantize_rows and
    fp8.quantize_cols exactly: values, scales and layouts, across 16 binades, with an all-zero
    tile (scale 1) and tiles that saturate the format."""
    x = _x(256, 384).astype(jnp.bfloat16)
    x = x.at[:128, 128:256].set(0).at[128:, :128].multiply(2.0**60)

    def both(x):
        return fp8_quantizers.quantize_both(x, dtype, interpret=True)

    calls = introspect.traced_kernel_calls(both, x, platform="cpu")
    assert [str(c) for c in calls] == ["fp8_quantize/interpret"]
    got = jax.tree.map(np.asarray, jax.jit(both)(x))
    want = jax.tree.map(np.asarray, (fp8.quantize_rows(x, dtype), fp8.quantize_cols(x, dtype)))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), got) == jax.tree.map(
        lambda a: (a.shape, a.dtype), want
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g.astype(np.float32), w.astype(np.float32))
    assert np.all(np.asarray(got[0][1])[:128, 1] == 1.0)  # the zero tile's row scales


@pytest.mark.skipif(
    not mgpu_compat.LOADS_TRANSPOSED, reason=f"jax {jax.__version__}: no transposed tile loads"
)
@pytest.mark.parametrize("live", [0, 200, 384, 512])
def test_quantize_both_zeroes_the_rows_past_live_rows(live):
    """quantize_both(live_rows=n) quantizes x with its rows from n on zeroed, bit for bit, in
    the same pass: rows past the groups hold NaN here (they may hold anything), and n need not
    be a multiple of 128 (a tile then mixes live rows and zeros)."""
    x = _x(512, 256).astype(jnp.bfloat16).at[live:].set(jnp.nan)
    run = functools.partial(fp8_quantizers.quantize_both, interpret=True)
    got = jax.jit(lambda x, n: run(x, live_rows=n))(x, jnp.int32(live))
    zeroed = jnp.where(jnp.arange(512)[:, None] < live, x, 0)
    want = (fp8.quantize_rows(zeroed), fp8.quantize_cols(zeroed))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.skipif(
    not mgpu_compat.LOADS_TRANSPOSED, reason=f"jax {jax.__version__}: no transposed tile loads"
)
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("w_dtype", [jnp.bfloat16, jnp.float32])
def test_quantize_blocks_both_is_the_xla_quantization_bit_for_bit(dtype, w_dtype):
    """The fused weight quantizer (one read of w, interpreted) gives fp8.quantize_blocks and its
    transpose_blocks exactly: values, scales and layouts, across 16 binades, with an all-zero
    block (scale 1), a block that saturates the format and one of a single nonzero element;
    from bf16 weights, and from fp32 ones (master weights: quantized once, the transposed copy
    staged through fp16, which holds every fp8 value exactly)."""
    w = jnp.stack([_x(256, 384, seed=1), _x(384, 256, seed=2).T]).astype(w_dtype)
    w = w.at[0, :128, 128:256].set(0).at[1, 128:, :128].multiply(2.0**60)
    w = w.at[1, :128, 256:].set(0).at[1, 5, 300].set(-3.0)

    def both(w):
        return fp8_quantizers.quantize_blocks_both(w, dtype, interpret=True)

    calls = introspect.traced_kernel_calls(both, w, platform="cpu")
    assert [str(c) for c in calls] == ["fp8_quantize_blocks/interpret"]
    got = jax.tree.map(np.asarray, jax.jit(both)(w))
    blocks = fp8.quantize_blocks(w, dtype)
    want = jax.tree.map(np.asarray, (blocks, fp8.transpose_blocks(*blocks)))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), got) == jax.tree.map(
        lambda a: (a.shape, a.dtype), want
    )
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g.astype(np.float32), w_.astype(np.float32))
    scale = got[0][1]
    assert scale[0, 0, 1] == 1.0  # the zero block
    assert scale[1, 0, 2] == np.float32(3.0) * np.float32(1 / fp8.fmax(dtype))
    assert got[0][0][1, 5, 300].astype(np.float32) == -fp8.fmax(dtype)


def test_quantize_both_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_quantizers.quantize_both(jnp.ones((128, 200), jnp.bfloat16))
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_quantizers.quantize_blocks_both(jnp.ones((2, 128, 200), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\[G, K, N\]"):
        fp8_quantizers.quantize_blocks_both(jnp.ones((128, 128), jnp.bfloat16))


def _swiglu_operands(m=256, f=384):
    """gate, up and dh across the activation's regimes: |gate| up to ~2^5 (exp(-gate)
    overflows to inf past 88: silu -> -0), tiles of 16 binades, an all-zero dh tile."""
    keys = jax.random.split(jax.random.key(7), 3)
    gate = _x(m, f, seed=5) * 4
    gate = gate.at[0, :].set(-100.0).at[1, :].set(100.0)  # saturated sigmoid either way
    up = jax.random.normal(keys[1], (m, f))
    dh = _x(m, f, seed=6).at[128:, :128].set(0)
    return tuple(a.astype(jnp.bfloat16) for a in (dh, gate, up))


def test_swiglu_and_its_gradient_are_fp32_accurate():
    """fp8.swiglu and swiglu_grad against float64, at saturated gates too (|gate| = 100, where
    autodiff through swiglu's own expression would give NaN, exp(100) being inf): within a few
    fp32 roundings of each term (dgate's factor 1 + gate (1 - s) cancels near gate = -1.28, so
    its bound is on the terms' magnitudes, not on the result)."""
    dh, gate, up = (a.astype(jnp.float32) for a in _swiglu_operands())
    d, g, u = (np.asarray(a, np.float64) for a in (dh, gate, up))
    sig = 1 / (1 + np.exp(-g))
    eps = 16 * 2.0**-24
    h, (dgate, dup) = fp8.swiglu(gate, up), fp8.swiglu_grad(dh, gate, up)
    checks = [
        (h, g * sig * u, np.abs(g * sig * u)),
        # s near 1 is rounded by up to 2^-24, which 1 - s keeps: |gate| 2^-24 in the factor
        (dgate, d * u * sig * (1 + g * (1 - sig)), np.abs(d * u) * sig * (1 + np.abs(g))),
        (dup, d * g * sig, np.abs(d * g * sig)),
    ]
    for got, want, scale in checks:
        err = np.abs(np.asarray(got, np.float64) - want)
        assert np.all(err <= eps * scale + 1e-30), np.max(err - eps * scale)
    np.testing.assert_allclose(
        jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)[1](dh)[1], dup, rtol=2.0**-20
    )


@pytest.mark.skipif(
    not mgpu_compat.LOADS_TRANSPOSED, reason=f"jax {jax.__version__}: no transposed tile loads"
)
@pytest.mark.parametrize("dtype", FORMATS)
def test_swiglu_quantizers_are_the_xla_quantization_of_the_activation(dtype):
    """quantize_swiglu and quantize_swiglu_grad (interpreted) give, bit for bit, the XLA
    quantization (fp8.quantize_rows / quantize_cols) of fp8.swiglu and fp8.swiglu_grad rounded
    to bf16: the interpreter evaluates the same fp32 expression with XLA:CPU, so only the
    kernels' data movement (the halves, the tiles rewritten in place, the transposed loads) is
    under test here; the H100 compile is in tests/accelerator/test_deviceless_fp8.py."""
    dh, gate, up = _swiglu_operands()

    def both(a):
        a = a.astype(jnp.bfloat16)
        return fp8.quantize_rows(a, dtype), fp8.quantize_cols(a, dtype)

    cases = [
        ("fp8_quantize_swiglu", fp8_quantizers.quantize_swiglu, (gate, up),
         (both(fp8.swiglu(gate, up)),)),
        ("fp8_quantize_swiglu_grad", fp8_quantizers.quantize_swiglu_grad, (dh, gate, up),
         tuple(both(d) for d in fp8.swiglu_grad(dh, gate, up))),
    ]  # fmt: skip
    for name, kernel, args, want in cases:
        run = functools.partial(kernel, dtype=dtype, interpret=True)
        calls = introspect.traced_kernel_calls(run, *args, platform="cpu")
        assert [str(c) for c in calls] == [f"{name}/interpret"]
        got = jax.jit(run)(*args)
        if name == "fp8_quantize_swiglu":
            got = (got,)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), got) == jax.tree.map(
            lambda a: (a.shape, a.dtype), want
        )
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    grad = functools.partial(fp8_quantizers.quantize_swiglu_grad, dtype=dtype, interpret=True)
    (dgate, _), (dup, _) = jax.jit(grad)(dh, gate, up)
    assert np.all(np.asarray(dgate[1])[128:, 0] == 1.0)  # the zero dh tile: scale 1
    assert np.all(np.asarray(dup[1])[128:, 0] == 1.0)


@pytest.mark.skipif(
    not mgpu_compat.LOADS_TRANSPOSED, reason=f"jax {jax.__version__}: no transposed tile loads"
)
def test_swiglu_quantizers_have_no_shared_memory_races():
    """The race detector on: the activation gradient's kernel quantizes its two results into
    one pair of fp8 tiles (sharing memory with the up tile, dead by then) and refills them
    only after TMA has read the first result's (without that wait the detector reports a
    race); the forward kernel likewise over its one result."""
    dh, gate, up = _swiglu_operands(256, 256)
    params = mgpu_compat.interpret_params(detect_races=True)
    jax.block_until_ready(fp8_quantizers.quantize_swiglu_grad(dh, gate, up, interpret=params))
    assert not mgpu_compat.races_found()
    jax.block_until_ready(fp8_quantizers.quantize_swiglu(gate, up, interpret=params))
    assert not mgpu_compat.races_found()


def test_swiglu_quantizers_refuse_mismatched_inputs():
    a = jnp.ones((128, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="all inputs"):
        fp8_quantizers.quantize_swiglu(a, a[:, :128])
    with pytest.raises(ValueError, match="all inputs"):
        fp8_quantizers.quantize_swiglu_grad(a, a, a.astype(jnp.float16))
