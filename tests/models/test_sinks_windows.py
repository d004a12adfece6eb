"""GPT-OSS's attention pieces: learned sinks in the softmax denominator, sliding-window layers
from `layer_types`, attention biases; against a float64 reference, scanned runs over
alternating layers, the KV-cached steps, and the XLA path named in the compiled program."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.models import attention, generate, init_lm_params, lm_forward, presets, rope_tables
from moejax.models._generate import init_cache
from moejax.models._layer_runs import layer_runs
from moejax.testing import assert_close

S, F = "sliding_attention", "full_attention"
CFG = presets.get("micro").replace(
    num_layers=4,
    attention_sinks=True,
    attention_bias=True,
    attention_out_bias=True,
    layer_types=(S, F, S, F),
    sliding_window=3,  # shorter than the 16 positions
)


def _reference(p, x, cos, sin, window):
    """float64 numpy: GQA attention with biases, RoPE (halves), a window and per-head sinks."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    x, cos, sin = (np.asarray(a, np.float64) for a in (x, cos, sin))
    q = np.einsum("bsd,dhk->bshk", x, p["wq"]) + p["bq"]
    k = np.einsum("bsd,dhk->bshk", x, p["wk"]) + p["bk"]
    v = np.einsum("bsd,dhk->bshk", x, p["wv"]) + p["bv"]

    def rope(t):
        a, b = np.split(t, 2, axis=-1)
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    q, k = rope(q), rope(k)
    h, hkv = q.shape[2], k.shape[2]
    k, v = np.repeat(k, h // hkv, axis=2), np.repeat(v, h // hkv, axis=2)
    n = x.shape[1]
    scores = np.einsum("bshk,bthk->bhst", q, k) / np.sqrt(q.shape[-1])
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    e = np.where(visible, np.exp(scores - scores.max()), 0.0)
    denom = e.sum(-1, keepdims=True) + np.exp(p["sinks"] - scores.max())[None, :, None, None]
    out = np.einsum("bhst,bthk->bshk", e / denom, v)
    return np.einsum("bshk,hkd->bsd", out, p["wo"]) + p["bo"]


def _random(params, key):
    """Non-zero biases and sinks (init makes them zero)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        tree, [a + 0.5 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys, strict=True)]
    )


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_and_window_equal_the_reference(window):
    p = _random(init_lm_params(CFG, jax.random.key(0))["layers"][0]["attn"], jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (2, 16, CFG.d_model))
    cos, sin = rope_tables(16, CFG.head_dim, CFG.rope_theta)
    fn = jax.jit(functools.partial(attention, window=window))
    np.testing.assert_allclose(
        np.asarray(fn(p, x, cos, sin)), _reference(p, x, cos, sin, window), rtol=2e-5, atol=2e-5
    )
    assert "xla_attention_sinks_window" in fn.lower(p, x, cos, sin).as_text(debug_info=True)


def test_alternating_windows_scan_as_pairs_and_cached_steps_equal_the_forward():
    params = init_lm_params(CFG, jax.random.key(3))
    params["layers"] = [
        {**layer, "attn": _random(layer["attn"], jax.random.key(10 + i))}
        for i, layer in enumerate(params["layers"])
    ]
    assert [r[1:] for r in layer_runs(CFG)] == [(2, 2)]  # units (sliding, full) x 2
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    want, _ = jax.jit(functools.partial(lm_forward, cfg=CFG))(params, tokens)
    got, _ = jax.jit(functools.partial(lm_forward, cfg=CFG, scan_layers=True))(params, tokens)
    assert_close(got, want)
    full, _ = jax.jit(functools.partial(lm_forward, cfg=CFG.replace(sliding_window=16)))(
        params, tokens
    )
    assert not np.allclose(full, want, atol=1e-3)  # the window changes the answer
    # Sliding layers cache a ring of their 3 positions; the 4-token prompt already wraps it.
    assert [c["k"].shape[1] for c in init_cache(CFG, 2, 16)] == [3, 16, 3, 16]
    ids, logits = generate(params, CFG, tokens[:, :4], 12, return_logits=True)
    again, _ = jax.jit(functools.partial(lm_forward, cfg=CFG))(params, jnp.asarray(ids))
    assert_close(logits, again[:, 3:-1])


def test_layer_types_checks():
    with pytest.raises(ValueError, match="sliding_window"):
        CFG.replace(sliding_window=None)
    with pytest.raises(ValueError, match="layer_types"):
        CFG.replace(layer_types=(S, F))
    with pytest.raises(ValueError, match="chunked"):
        CFG.replace(layer_types=(S, F, S, "chunked_attention"))
