"""Attention (GQA, causal, RoPE) and RMSNorm against numpy loop references."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.models import apply_rope, attention, rms_norm, rope_tables
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
