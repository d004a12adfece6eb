"""GLM-4.5 (`glm4_moe`): published configs read into the published sizes, the config fields
that shape its attention (`partial_rotary_factor` in either place, `use_qk_norm`,
`attention_bias`), and partial RoPE itself against a numpy transcription of transformers'
`apply_rotary_pos_emb` (GPT-NeoX form). GLM-4.7-Flash (`glm4_moe_lite`: DeepSeek-V3's MLA,
router and MTP layer): its published config. Logits, gradients, MTP and generation against
transformers are in `test_hf_fidelity.py`."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moejax import models
from moejax.interop.hf import CheckpointError, family_of, lm_config_from_hf

GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "use_qk_norm": False,
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "num_nextn_predict_layers": 1,
    "rope_theta": 1000000,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip  (zai-org/GLM-4.5-Air's shape)
GLM45 = GLM45_AIR | {
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 92,
    "n_routed_experts": 160,
    "first_k_dense_replace": 3,
    "use_qk_norm": True,
    "routed_scaling_factor": 2.5,
}  # fmt: skip  (zai-org/GLM-4.5's shape)


@pytest.mark.parametrize(
    ("config", "total", "active"),
    [
        (GLM45_AIR | {"num_nextn_predict_layers": 0}, 106.85, 12.80),
        (GLM45_AIR, 109.23, 13.10),  # + the MTP layer
        (GLM45 | {"num_nextn_predict_layers": 0}, 352.80, 32.86),
        (GLM45, 356.79, 33.26),
    ],
    ids=["glm45_air", "glm45_air_mtp", "glm45", "glm45_mtp"],
)
def test_published_configs_give_the_published_sizes(config, total, active):
    """GLM-4.5-Air 106B (12B active), GLM-4.5 355B (32B active), without their MTP layer."""
    cfg, family = lm_config_from_hf(config)
    counts = models.param_counts(cfg)
    assert family == "glm4_moe"
    assert (round(counts.total / 1e9, 2), round(counts.active / 1e9, 2)) == (total, active)
    first = config["first_k_dense_replace"]
    assert cfg.mlp_kinds == ("dense",) * first + ("moe",) * (cfg.num_layers - first)
    assert cfg.rope_dim == 64 and cfg.attention_bias and not cfg.attention_out_bias
    assert cfg.qk_norm == ("head" if config["use_qk_norm"] else None)
    assert cfg.moe.router == "sigmoid" and cfg.moe.score_correction_bias
    assert cfg.moe.num_shared_experts == 1 and cfg.mtp_layers == config["num_nextn_predict_layers"]


def test_partial_rotary_factor_from_either_place_and_its_default():
    """transformers 4 writes it at the top level, 5 in `rope_parameters`; absent, GLM's 0.5."""
    base = {k: v for k, v in GLM45_AIR.items() if k not in ("partial_rotary_factor", "rope_theta")}
    top, _ = lm_config_from_hf(base | {"partial_rotary_factor": 0.25, "rope_theta": 1e6})
    nested, _ = lm_config_from_hf(
        base | {"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.25}}
    )
    assert top == nested and top.rope_dim == 32 and top.rope_theta == 1e6
    assert lm_config_from_hf(base)[0].rope_dim == 64  # GLM's default
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        lm_config_from_hf(
            base | {"partial_rotary_factor": 0.5, "rope_parameters": {"partial_rotary_factor": 1}}
        )
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        lm_config_from_hf(base | {"partial_rotary_factor": 0.2})  # 25 features: not even


def test_partial_rotary_factor_is_checked():
    cfg, _ = lm_config_from_hf(GLM45_AIR | {"num_hidden_layers": 2})
    for bad in (0, -0.5, 1.5, float("nan"), True, 0.2):  # 0.2: 25 features, odd
        with pytest.raises(ValueError, match="partial_rotary_factor"):
            dataclasses.replace(cfg, partial_rotary_factor=bad)


def _neox_rope(x, cos, sin):
    """transformers' GPT-NeoX `apply_rotary_pos_emb` (GLM-4.5's): rotate-half on the first
    `2 * cos.shape[-1]` features of each head, the rest passed through; float64."""
    r = 2 * cos.shape[-1]
    emb_cos = np.concatenate([cos, cos], -1)[None, :, None, :]
    emb_sin = np.concatenate([sin, sin], -1)[None, :, None, :]
    rot, rest = x[..., :r], x[..., r:]
    half = np.concatenate([-rot[..., r // 2 :], rot[..., : r // 2]], -1)
    return np.concatenate([rot * emb_cos + half * emb_sin, rest], -1)


@pytest.mark.parametrize("rotated", [4, 8, 16])
def test_partial_rope_rotates_the_first_features_only(rotated):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    cos, sin = models.rope_tables(5, rotated, 10000.0)
    got = np.asarray(models.apply_rope(x, cos, sin))
    want = _neox_rope(x.astype(np.float64), np.asarray(cos), np.asarray(sin))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[..., rotated:], x[..., rotated:])


GLM47_FLASH = {
    "architectures": ["Glm4MoeLiteForCausalLM"],
    "model_type": "glm4_moe_lite",
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "max_position_embeddings": 202752,
    "moe_intermediate_size": 1536,
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.8,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 47,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 1.0,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "vocab_size": 154880,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "dtype": "bfloat16",
}  # fmt: skip  (zai-org/GLM-4.7-Flash's shape)


@pytest.mark.parametrize(
    ("mtp", "total", "active"), [(0, 29.94, 3.58), (1, 30.59, 3.66)], ids=["flash", "flash_mtp"]
)
def test_glm47_flash_config_gives_the_published_size(mtp, total, active):
    """GLM-4.7-Flash, "30B-A3B": MLA (20 heads, q latent 768, kv latent 512, 192 + 64 query/key
    and 256 value features), one dense first layer, 64 experts top-4 with one shared, sigmoid
    routing scaled by 1.8; its MTP layer as DeepSeek-V3's. The Hub's 31B also counts the MTP
    layer's stored copies of the embedding and head."""
    cfg, family = lm_config_from_hf(GLM47_FLASH | {"num_nextn_predict_layers": mtp})
    counts = models.param_counts(cfg)
    assert family == "glm4_moe_lite" and cfg.mtp_layers == mtp
    assert (round(counts.total / 1e9, 2), round(counts.active / 1e9, 2)) == (total, active)
    assert cfg.mla.q_lora_rank == 768 and cfg.mla.v_head_dim == 256 and cfg.head_dim == 256
    assert cfg.mlp_kinds == ("dense",) + ("moe",) * 46
    assert cfg.moe.router == "sigmoid" and cfg.moe.routed_scaling_factor == 1.8
    assert (cfg.moe.num_groups, cfg.moe.top_k, cfg.moe.num_shared_experts) == (1, 4, 1)
    # transformers' latent norms keep RMSNorm's default eps, not rms_norm_eps (1e-5 here)
    assert cfg.norm_eps == 1e-5 and cfg.mla.latent_norm_eps == 1e-6


def test_architecture_prefixes_tell_glm_and_deepseek_variants_apart():
    """Without `model_type`, `architectures` decides: Glm4MoeLite* is not Glm4Moe*, and
    DeepseekV32* (sparse attention, not read) is not DeepseekV3*."""
    assert family_of({"architectures": ["Glm4MoeLiteForCausalLM"]}) == "glm4_moe_lite"
    assert family_of({"architectures": ["Glm4MoeForCausalLM"]}) == "glm4_moe"
    assert family_of({"architectures": ["DeepseekV3ForCausalLM"]}) == "deepseek_v3"
    with pytest.raises(CheckpointError, match="DeepseekV32"):
        family_of({"architectures": ["DeepseekV32ForCausalLM"]})
    with pytest.raises(CheckpointError, match="Glm4MoeLiteFor"):
        family_of({"model_type": "glm4_moe_lite", "architectures": ["Glm4MoeForCausalLM"]})


@pytest.mark.parametrize("bad", [0, -1e-6, 1.5, True, "1e-6"])
def test_mla_latent_norm_eps_is_checked(bad):
    cfg, _ = lm_config_from_hf(GLM47_FLASH | {"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="latent_norm_eps"):
        cfg.mla.replace(latent_norm_eps=bad)
