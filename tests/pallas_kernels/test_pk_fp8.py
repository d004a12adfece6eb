"""Block-scaled fp8 quantization (pallas_kernels.fp8) against hand-computed values and the
rounding bounds of the formats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8


def test_scale_is_tile_amax_over_fmax_and_values_hand_computed():
    x = jnp.zeros((2, 256), jnp.float32)
    x = x.at[0, 0].set(3.0).at[0, 5].set(-1.5).at[0, 130].set(0.25).at[1, 200].set(-896.0)
    q, s = fp8.quantize_rows(x)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32 and s.shape == (2, 2)
    # row 0, tile 0: amax 3 -> scale 3/448, 3 -> 448, -1.5 -> -224 (exact in e4m3)
    # row 0, tile 1: amax 0.25 -> 0.25 -> 448; row 1 tile 0 all zero -> scale 1
    r = np.float32(1 / 448)  # the scale is amax * fp32(1 / fmax), one rounding
    np.testing.assert_array_equal(s, [[np.float32(3) * r, np.float32(0.25) * r], [1, 896 * r]])
    qf = np.asarray(q.astype(jnp.float32))
    assert qf[0, 0] == 448 and qf[0, 5] == -224 and qf[0, 130] == 448 and qf[1, 200] == -448
    assert np.count_nonzero(qf) == 4
    # dequantized: q * scale in fp32, one rounding (3/448 is not an fp32, so 448 * s is 3 + 1 ulp)
    out = np.asarray(fp8.dequantize_rows(q, s))
    assert out[0, 0] == np.float32(448) * s[0, 0] and out[0, 5] == np.float32(-224) * s[0, 0]
    np.testing.assert_allclose(out, x, rtol=2**-23, atol=0)


def test_e5m2_fmax_and_rounding_to_nearest():
    # amax 1 -> scale 1/57344; 0.3 * 57344 = 17203.2, whose e5m2 neighbours are 16384 and
    # 20480 (2 mantissa bits): nearest is 16384.
    q, s = fp8.quantize_rows(jnp.array([[1.0, 0.3]]), "e5m2")
    assert q.dtype == jnp.float8_e5m2
    assert s.item() == np.float32(1 / 57344)
    assert q.astype(jnp.float32).tolist() == [[57344.0, 16384.0]]


def test_partial_edge_tiles_scale_only_what_exists():
    x = jnp.arange(1, 131, dtype=jnp.float32)[None, :]  # 130 columns: tiles of 128 and 2
    q, s = fp8.quantize_rows(x)
    assert s.shape == (1, 2) and q.shape == (1, 130)
    r = np.float32(1 / 448)
    np.testing.assert_array_equal(s, [[np.float32(128) * r, np.float32(130) * r]])
    w = jnp.ones((3, 130, 5), jnp.float32).at[:, 128:, :].set(2.0)
    qw, sw = fp8.quantize_blocks(w)
    assert sw.shape == (3, 2, 1)
    np.testing.assert_array_equal(sw[:, :, 0], [[r, np.float32(2) * r]] * 3)
    np.testing.assert_array_equal(fp8.dequantize_blocks(qw, sw), w)


def test_zero_tensor_round_trips_to_zero_without_nan():
    for quant, deq in ((fp8.quantize_rows, fp8.dequantize_rows),
                       (fp8.quantize_blocks, fp8.dequantize_blocks)):  # fmt: skip
        q, s = quant(jnp.zeros((4, 200)))
        out = deq(q, s)
        assert np.all(np.asarray(s) == 1.0) and np.all(np.asarray(out) == 0.0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_round_trip_error_within_format_bound(fmt):
    """|deq(q(x)) - x| <= u |x| + h * scale elementwise (u: half an ulp relative to a normal,
    h: half the smallest subnormal, for values the tile's scale sends below the normals)."""
    key = jax.random.key(0)
    # Adversarial magnitudes: tiles spanning 12 binades, some tiles tiny, some huge.
    x = jax.random.normal(key, (64, 384)) * jnp.exp2(
        jax.random.randint(jax.random.key(1), (64, 384), -6, 6).astype(jnp.float32)
    )
    x = x * jnp.exp2(jnp.arange(64, dtype=jnp.float32)[:, None] - 32)
    u, h = fp8.rounding_bound(fmt), fp8.subnormal_bound(fmt)
    for quant, deq, scale_of in (
        (fp8.quantize_rows, fp8.dequantize_rows, lambda s: jnp.repeat(s, 128, 1)),
        (fp8.quantize_blocks, fp8.dequantize_blocks,
         lambda s: jnp.repeat(jnp.repeat(s, 128, 0), 128, 1)[:64]),
    ):  # fmt: skip
        q, s = quant(x, fmt)
        err = np.abs(np.asarray(deq(q, s)) - np.asarray(x))
        bound = u * np.abs(np.asarray(x)) + h * np.asarray(scale_of(s))
        assert np.all(err <= bound * (1 + 1e-6)), float(np.max(err / bound))
        # ...and the bound is tight: some element needs most of it.
        assert np.max(err / bound) > 0.5


def test_tile_max_is_exact_and_nothing_saturates():
    x = jax.random.uniform(jax.random.key(2), (32, 256), minval=-3.0, maxval=3.0)
    q, s = fp8.quantize_rows(x)
    qf = np.abs(np.asarray(q.astype(jnp.float32))).reshape(32, 2, 128)
    assert np.all(qf.max(-1) == 448.0)  # each tile's amax lands on fmax exactly
    assert not np.any(np.isnan(qf))


def test_transposed_copies():
    w = jax.random.normal(jax.random.key(3), (2, 256, 384))
    q, s = fp8.quantize_blocks(w)
    qt, st = fp8.transpose_blocks(q, s)
    q2, s2 = fp8.quantize_blocks(jnp.swapaxes(w, 1, 2))
    # a 128 x 128 block's scale does not depend on orientation: transposing = requantizing
    np.testing.assert_array_equal(qt.astype(jnp.float32), q2.astype(jnp.float32))
    np.testing.assert_array_equal(st, s2)
    x = jax.random.normal(jax.random.key(4), (300, 64))
    qc, sc = fp8.quantize_cols(x, "e5m2")
    assert qc.shape == (64, 300) and sc.shape == (64, 3)
    # column j of x, rows 128..255, has scale max|x[128:256, j]| / 57344
    amax = np.max(np.abs(np.asarray(x)[128:256]), 0)
    np.testing.assert_array_equal(sc[:, 1], amax * np.float32(1 / 57344))


def test_bad_format_is_named():
    for bad in ("e3m4", jnp.bfloat16):
        with pytest.raises(ValueError, match="e4m3"):
            fp8.quantize_rows(jnp.ones((1, 4)), bad)
