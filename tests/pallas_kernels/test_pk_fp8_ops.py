"""The fp8 grouped matmul (pallas_kernels.fp8_ops), emulated: forward, lhs and weight gradients
against float64 products of (a) the dequantized operands the recipe prescribes, to fp32
summation error, and (b) the unquantized operands, within the bound the fp8 formats imply."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8, fp8_ops

SIZES = [130, 0, 256, 37]  # unaligned, empty and aligned groups
M, K, N = 480, 320, 192  # 57 rows past the groups; K and N not multiples of 128


def _operands(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    # Rows and columns over 8 binades, a few outliers: tiles of very different scale.
    row_scale = jnp.exp2(jax.random.randint(keys[0], (M, 1), -4, 4).astype(jnp.float32))
    x = jax.random.normal(keys[1], (M, K)) * row_scale
    x = x.at[5, 7].set(300.0)
    w = jax.random.normal(keys[2], (len(SIZES), K, N)) * 0.05
    dy = jax.random.normal(keys[3], (M, N)) * row_scale
    return x, w, dy, jnp.array(SIZES, jnp.int32)


def _group_of_rows():
    g = np.full(M, -1)
    start = 0
    for i, s in enumerate(SIZES):
        g[start : start + s] = i
        start += s
    return g


def _gmm64(a, b, transpose=False):
    """float64 grouped product: rows of group g times b[g] (or b[g]^T); rows past: zero."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    g = _group_of_rows()
    out = np.zeros((a.shape[0], b.shape[1] if transpose else b.shape[2]))
    for i in range(b.shape[0]):
        bi = b[i].T if transpose else b[i]
        out[g == i] = a[g == i] @ bi
    return out


def _tgmm64(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    g = _group_of_rows()
    return np.stack([a[g == i].T @ b[g == i] for i in range(len(SIZES))])


def _err_bound(a_abs, da, b_abs, db, depth):
    """|(a+da)(b+db) - ab| summed: da|b| + |a|db + da db, plus fp32 summation of depth terms."""
    return da @ b_abs + a_abs @ db + da @ db + (depth + 2) * 2.0**-24 * (a_abs + da) @ (b_abs + db)


def _q_err(x, scale_full, fmt):
    return fp8.rounding_bound(fmt) * np.abs(x) + fp8.subnormal_bound(fmt) * scale_full


def _expand_rows(s, n):
    return np.repeat(np.asarray(s, np.float64), 128, axis=-1)[..., :n]


def _grads(x, w, dy, sizes, fmt):
    def f(x, w):
        out = fp8_ops.fp8_grouped_matmul(x, w, sizes, grad_format=fmt, backend="emulated")
        return out, out

    (out, vjp, _) = jax.vjp(f, x, w, has_aux=True)
    return out, *vjp(dy)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_emulated_matches_the_recipe_and_the_format_bound(fmt):
    x, w, dy, sizes = _operands()
    out, dx, dw = (np.asarray(t) for t in jax.jit(_grads, static_argnums=4)(x, w, dy, sizes, fmt))
    g = _group_of_rows()
    live = g >= 0
    assert np.all(out[~live] == 0) and np.all(dx[~live] == 0)
    xn, wn, dyn = np.asarray(x), np.asarray(w), np.where(live[:, None], np.asarray(dy), 0)

    # (a) The recipe's operands, dequantized: x e4m3 1x128, w e4m3 128x128, dy `fmt` 1x128
    # (dlhs) and 128x1 (dw), x 128x1 (dw). Only fp32 summation separates the results.
    xq = fp8.dequantize_rows(*fp8.quantize_rows(x))
    wq = fp8.dequantize_blocks(*fp8.quantize_blocks(w))
    dyq = fp8.dequantize_rows(*fp8.quantize_rows(dyn, fmt))
    xq_t = fp8.dequantize_rows(*fp8.quantize_cols(jnp.where(live[:, None], x, 0)))
    dyq_t = fp8.dequantize_rows(*fp8.quantize_cols(dyn, fmt))
    for got, want, depth in (
        (out, _gmm64(xq, wq), K),
        (dx, _gmm64(dyq, wq, transpose=True), N),
        (dw, _tgmm64(np.asarray(xq_t).T, np.asarray(dyq_t).T), M),
    ):
        tol = (depth + 2) * 2.0**-24 * np.abs(want).max() * 8 + 1e-30
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)

    # (b) Against the unquantized product: within the bound of each operand's rounding.
    sx = _expand_rows(fp8.quantize_rows(x)[1], K)
    sw = np.repeat(np.repeat(np.asarray(fp8.quantize_blocks(w)[1]), 128, 1), 128, 2)[:, :K, :N]
    dxq = _q_err(xn, sx, "e4m3")
    dwq = _q_err(wn, sw, "e4m3")
    bound = np.zeros((M, N))
    for i in range(len(SIZES)):
        r = g == i
        bound[r] = _err_bound(np.abs(xn[r]), dxq[r], np.abs(wn[i]), dwq[i], K)
    err = np.abs(out - _gmm64(xn, wn))
    assert np.all(err[live] <= bound[live]), float(np.max(err[live] / bound[live]))
    assert np.max(err[live] / bound[live]) > 0.05  # the bound is not vacuous
    sdy = _expand_rows(fp8.quantize_rows(dyn, fmt)[1], N)
    ddy = _q_err(dyn, sdy, fmt)
    bound = np.zeros((M, K))
    for i in range(len(SIZES)):
        r = g == i
        bound[r] = _err_bound(np.abs(dyn[r]), ddy[r], np.abs(wn[i]).T, dwq[i].T, N)
    err = np.abs(dx - _gmm64(dyn, wn, transpose=True))
    assert np.all(err[live] <= bound[live]), float(np.max(err[live] / bound[live]))


def test_gradient_format_is_the_one_asked_for():
    x, w, dy, sizes = _operands(1)
    _, dx4, dw4 = _grads(x, w, dy, sizes, "e4m3")
    _, dx5, dw5 = _grads(x, w, dy, sizes, "e5m2")
    exact = _gmm64(dy, w, transpose=True)
    live = _group_of_rows() >= 0
    e4 = np.abs(np.asarray(dx4) - exact)[live].mean()
    e5 = np.abs(np.asarray(dx5) - exact)[live].mean()
    # one mantissa bit less: about twice the error (round to nearest, uniform in the ulp)
    assert 1.5 < e5 / e4 < 2.6, e5 / e4


def test_rows_past_groups_and_padding_do_not_set_scales():
    """Garbage in rows past sum(group_sizes) must not change any gradient (it would inflate
    the 128 x 1 tiles' scales of the weight gradient)."""
    x, w, dy, sizes = _operands(2)
    past = _group_of_rows() < 0
    x2 = jnp.where(past[:, None], 1e4, x)
    dy2 = jnp.where(past[:, None], -1e4, dy)
    a = _grads(x, w, dy, sizes, "e4m3")
    b = _grads(x2, w, dy2, sizes, "e4m3")
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)


def test_bad_arguments_are_named():
    x, w, _, sizes = _operands()
    with pytest.raises(ValueError, match="grad_format|e4m3"):
        fp8_ops.fp8_grouped_matmul(x, w, sizes, grad_format="e3m4")
    with pytest.raises(ValueError, match="backend"):
        fp8_ops.fp8_grouped_matmul(x, w, sizes, backend="triton")
    with pytest.raises(ValueError, match="rhs"):
        fp8_ops.fp8_grouped_matmul(x, w[:, :5], sizes)
