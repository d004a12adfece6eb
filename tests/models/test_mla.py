"""Multi-head latent attention against a hand-written float64 reference of DeepSeek-V3's
equations (true interleaved rotary pairs, yarn with mscale), in the whole model, cached, and
sharded (heads over `model`, D over `fsdp`)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import parallel
from moejax.models import (
    MLAConfig,
    RopeScaling,
    generate,
    init_lm_params,
    lm_forward,
    lm_partition_specs,
    presets,
    rope_frequencies,
)
from moejax.models._layers import rope_tables
from moejax.models._mla import mla_attention
from moejax.testing import assert_close

YARN = RopeScaling("yarn", 4.0, original_max_position_embeddings=8, mscale=0.7, mscale_all_dim=0.9)
MLA = MLAConfig(
    kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=10
)
CFG = presets.get("micro").replace(
    num_layers=3,
    num_kv_heads=4,
    head_dim=12,
    mla=MLA,
    rope_scaling=YARN,
    mlp_layer_types=("dense", "moe", "moe"),  # DeepSeek-V3's dense first layers
)


def _rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def _reference(p, x, cfg):
    """DeepSeek-V3 MLA in float64 numpy, rotary pairs (2i, 2i+1) rotated in place."""
    m, eps = cfg.mla, cfg.norm_eps
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    x = np.asarray(x, np.float64)
    b, s, _ = x.shape
    if m.q_lora_rank is None:
        q = np.einsum("bsd,dhk->bshk", x, p["wq"])
    else:
        q = np.einsum("bsr,rhk->bshk", _rms(x @ p["wq_a"], p["q_a_norm"]["scale"], eps), p["wq_b"])
    q_nope, q_pe = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
    kv = x @ p["wkv_a"]
    c = _rms(kv[..., : m.kv_lora_rank], p["kv_a_norm"]["scale"], eps)
    k_pe = kv[..., m.kv_lora_rank :][:, :, None, :]
    kv = np.einsum("bsr,rhk->bshk", c, p["wkv_b"])
    k_nope, v = kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim :]
    inv_freq, attn_factor = rope_frequencies(m.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    angle = np.arange(s)[:, None] * inv_freq.astype(np.float64)[None, :]  # [S, Dr/2]
    cos, sin = (f(angle)[None, :, None, :] * attn_factor for f in (np.cos, np.sin))

    def rot(t):  # pairs (2i, 2i+1): the DeepSeek paper's rotation of complex numbers
        if not m.rope_interleave:
            a, bb = np.split(t, 2, axis=-1)
            return np.concatenate([a * cos - bb * sin, bb * cos + a * sin], axis=-1)
        out = np.empty_like(t)
        a, bb = t[..., 0::2], t[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * cos - bb * sin, bb * cos + a * sin
        return out

    h = cfg.num_heads
    qf = np.concatenate([q_nope, rot(q_pe)], axis=-1)
    kf = np.concatenate([k_nope, np.broadcast_to(rot(k_pe), (b, s, h, m.qk_rope_head_dim))], -1)
    sc = cfg.rope_scaling
    mscale = 0.1 * sc.mscale_all_dim * math.log(sc.factor) + 1 if sc else 1.0
    scores = np.einsum("bshk,bthk->bhst", qf, kf) * m.qk_head_dim**-0.5 * mscale**2
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhst,bthk->bshk", probs, v)
    return np.einsum("bshk,hkd->bsd", out, p["wo"])


@pytest.mark.parametrize(
    "mla, scaling",
    [(MLA, YARN), (MLA.replace(q_lora_rank=None, rope_interleave=False), None)],
    ids=["lora_q_interleaved_yarn", "full_q_halves_plain"],
)
def test_mla_equals_the_reference(mla, scaling):
    cfg = CFG.replace(mla=mla, rope_scaling=scaling)
    p = init_lm_params(cfg, jax.random.key(0))["layers"][0]["attn"]
    p = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(1), a.shape), p)
    x = jax.random.normal(jax.random.key(2), (2, 16, cfg.d_model))
    cos, sin = rope_tables(16, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    got = jax.jit(functools.partial(mla_attention, cfg=cfg))(p, x, cos, sin)
    np.testing.assert_allclose(np.asarray(got), _reference(p, x, cfg), rtol=2e-5, atol=2e-5)


def test_mla_model_cached_steps_equal_the_forward():
    params = init_lm_params(CFG, jax.random.key(3))
    assert params["layers"][0]["attn"]["wkv_b"].shape == (12, 4, 8 + 6)
    prompt = np.random.default_rng(0).integers(0, 256, (2, 4)).astype(np.int32)
    ids, logits = generate(params, CFG, prompt, 12, return_logits=True)
    full, _ = jax.jit(functools.partial(lm_forward, cfg=CFG))(params, jnp.asarray(ids))
    assert_close(logits, full[:, 3:-1])


def test_mla_sharded_over_fsdp_and_model_equals_one_device():
    mesh = parallel.make_mesh((2, 2, 2), ("fsdp", "expert", "model"))
    specs = lm_partition_specs(CFG, mesh)["layers"][1]["attn"]
    assert specs["wq_b"] == jax.sharding.PartitionSpec(None, "model", None)
    assert specs["wkv_a"][0] == ("fsdp", "expert") and specs["wo"][0] == "model"
    params = init_lm_params(CFG, jax.random.key(4))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (4, 16)), jnp.int32)

    def loss(params, mesh):
        logits, aux = lm_forward(params, tokens, CFG, mesh=mesh, scan_layers=mesh is not None)
        return jnp.mean(logits**2), logits

    want = jax.jit(jax.value_and_grad(functools.partial(loss, mesh=None), has_aux=True))(params)
    got = jax.jit(jax.value_and_grad(functools.partial(loss, mesh=mesh), has_aux=True))(params)
    assert_close(got, want)


def test_mla_config_checks():
    with pytest.raises(ValueError, match="num_kv_heads"):
        CFG.replace(num_kv_heads=2)
    with pytest.raises(ValueError, match="head_dim"):
        CFG.replace(head_dim=8)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        MLA.replace(qk_rope_head_dim=3)
    with pytest.raises(ValueError, match="delay_wgrad"):
        lm_forward(init_lm_params(CFG, jax.random.key(0)), jnp.zeros((1, 4), jnp.int32), CFG,
                   delay_wgrad=True)  # fmt: skip


def test_deepseek_v3_preset_at_full_depth_is_the_published_model():
    """61 layers, the first 3 dense: 671,026,419,200 parameters, 37 B active (DeepSeek-V3's
    report: 671 B total, 37 B activated per token)."""
    from moejax.models import param_counts

    cfg = presets.get("deepseek_v3_4l")
    full = cfg.replace(num_layers=61, mlp_layer_types=("dense",) * 3 + ("moe",) * 58)
    counts = param_counts(full)
    assert counts.total == 671_026_419_200
    assert round(counts.active / 1e9) == 37
