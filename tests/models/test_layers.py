"""Attention (GQA, causal, RoPE) and RMSNorm against numpy loop references; the logits' VJP."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.models import apply_rope, attention, rms_norm, rope_tables, unembed_logits
from moejax.testing import assert_close


def _normal(shape, seed):
    """Inputs from numpy (jax.random would compile a threefry kernel per call site)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _rope_np(x, pos, theta):
    """Rotate-half RoPE of one head vector at position `pos` (numpy, float64)."""
    half = x.shape[-1] // 2
    freq = theta ** (-np.arange(0, 2 * half, 2) / (2 * half))
    c, s = np.cos(pos * freq), np.sin(pos * freq)
    return np.concatenate([x[:half] * c - x[half:] * s, x[half:] * c + x[:half] * s])


def _attention_np(p, x, theta):
    b, s, _ = x.shape
    _, h, dh = p["wq"].shape
    hkv = p["wk"].shape[1]
    out = np.zeros(x.shape)
    for bi in range(b):
        for head in range(h):
            g = head // (h // hkv)  # the kv head this query head reads
            q = [_rope_np(x[bi, t] @ p["wq"][:, head], t, theta) for t in range(s)]
            k = [_rope_np(x[bi, t] @ p["wk"][:, g], t, theta) for t in range(s)]
            v = [x[bi, t] @ p["wv"][:, g] for t in range(s)]
            for t in range(s):
                scores = np.array([q[t] @ k[u] / np.sqrt(dh) for u in range(t + 1)])
                w = np.exp(scores - scores.max())
                w /= w.sum()
                o = sum(w[u] * v[u] for u in range(t + 1))
                out[bi, t] += o @ p["wo"][head]
    return out


def test_attention_matches_loop_reference_gqa_causal_rope():
    d, h, hkv, dh, s = 16, 4, 2, 8, 6
    p = {
        "wq": _normal((d, h, dh), 0) / 4,
        "wk": _normal((d, hkv, dh), 1) / 4,
        "wv": _normal((d, hkv, dh), 2) / 4,
        "wo": _normal((h, dh, d), 3) / 4,
    }
    x = _normal((2, s, d), 4)
    cos, sin = rope_tables(s, dh, 100.0)
    got = jax.jit(attention)(p, x, cos, sin)
    want = _attention_np(jax.tree.map(np.asarray, p), np.asarray(x, np.float64), 100.0)
    assert_close(got, want, np.float32)


def test_rope_scores_depend_only_on_relative_position():
    dh, s = 8, 12
    q, k = _normal((dh,), 1), _normal((dh,), 2)
    cos, sin = rope_tables(s, dh, 10000.0)
    qk = jnp.broadcast_to(jnp.stack([q, k]), (1, s, 2, dh))
    rot = jax.jit(apply_rope)(qk, cos, sin)[0]
    scores = np.asarray(rot[:, 0] @ rot[:, 1].T)  # [m, n] = <rope(q, m), rope(k, n)>
    for offset in (0, 1, 5):
        diag = np.diagonal(scores, offset)
        np.testing.assert_allclose(diag, diag[0], rtol=1e-5, atol=1e-5)
    assert abs(scores[0, 1] - scores[0, 5]) > 1e-3  # and it does depend on the distance


def test_rms_norm_matches_numpy():
    x = _normal((3, 5, 16), 3) * 3
    scale = _normal((16,), 4)
    xn = np.asarray(x, np.float64)
    want = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-5) * np.asarray(scale)
    assert_close(jax.jit(rms_norm, static_argnums=2)(x, scale, 1e-5), want, np.float32)


def test_logits_vjp_multiplies_in_the_activations_dtype():
    """fp32 logits; the backward rounds their cotangent to the activations' dtype and multiplies
    there with fp32 accumulation (bf16), which is plain autodiff for fp32 activations."""
    x, w, d = _normal((2, 8, 64), 0), _normal((64, 96), 1), _normal((2, 8, 96), 2)

    def einsum(x, w):
        return jnp.einsum("bsd,dv->bsv", x, w, preferred_element_type=jnp.float32)

    def vjp(f, x, w):
        out, pullback = jax.vjp(f, x, w)
        return (out, *pullback(d))

    for got, want in zip(vjp(unembed_logits, x, w), vjp(einsum, x, w), strict=True):
        np.testing.assert_array_equal(got, want)  # fp32: autodiff's

    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    logits, dx, dw = vjp(unembed_logits, xb, wb)
    assert logits.dtype == jnp.float32 and dx.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_array_equal(logits, einsum(xb, wb))
    # The same products in float64 from the bf16-rounded cotangent, rounded to bf16 once.
    x64, w64 = np.asarray(xb, np.float64), np.asarray(wb, np.float64)
    g64 = np.asarray(d.astype(jnp.bfloat16), np.float64)
    want_dx = np.einsum("bsv,dv->bsd", g64, w64)
    want_dw = np.einsum("bsd,bsv->dv", x64, g64)
    for got, want in ((dx, want_dx), (dw, want_dw)):
        got = np.asarray(got, np.float64)
        # bf16 output rounding (unit roundoff 2^-8) of an fp32 sum (its error far below that)
        assert np.all(np.abs(got - want) <= 2.0**-8 * np.abs(want) + 1e-6), np.max(
            np.abs(got - want)
        )
    # ... and not autodiff of the einsum, whose fp32 cotangent would not be rounded first.
    _, dx_autodiff, _ = vjp(einsum, xb, wb)
    assert not np.array_equal(np.asarray(dx, np.float32), np.asarray(dx_autodiff, np.float32))
