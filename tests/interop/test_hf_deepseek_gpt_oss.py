"""Whole DeepSeek-V3 (MLA, dense first layers, MTP layers, Kimi-K2-style single-group routing)
and GPT-OSS (sinks, sliding windows, biases) checkpoints, and DeepSeek-V2-Lite's and GLM-4.5's
round trips: published configs give the published sizes, load -> save -> load is bit-identical
in both expert layouts, FP8 block-scaled weights
are dequantized on load, and config fields moejax does not implement are one error each, before
anything is read or written. (Logits and gradients against transformers: test_hf_fidelity.py.)"""

from __future__ import annotations

import json
import os

import _hf_decoder_reference as ref
import jax
import ml_dtypes
import numpy as np
import pytest

from moejax import models
from moejax.interop import hf
from moejax.interop.hf import (
    CheckpointError,
    SafetensorsCheckpoint,
    lm_config_from_hf,
    load_hf_model,
    save_hf_model,
    tensor_names,
)

DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}  # fmt: skip  (deepseek-ai/DeepSeek-V3 config.json)
KIMI_K2 = DSV3 | {
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
    "routed_scaling_factor": 2.827,
    "rope_theta": 50000.0,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
}  # fmt: skip  (moonshotai/Kimi-K2-Instruct config.json)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_local_experts": 32,
    "experts_per_token": 4,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "torch_dtype": "bfloat16",
}  # fmt: skip  (openai/gpt-oss-20b config.json without its MXFP4 quantization_config)
GPT_OSS_120B = GPT_OSS_20B | {
    "num_hidden_layers": 36, "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "total", "active"),
    [
        (DSV3 | {"num_nextn_predict_layers": 0}, 671.03, 36.63),
        (DSV3, 682.64, 37.31),  # + the MTP layer (HF's 685B also counts its embedding and head)
        (KIMI_K2, 1026.41, 31.69),
        (GPT_OSS_20B, 20.91, 3.61),
        (GPT_OSS_120B, 116.83, 5.13),
    ],
    ids=["deepseek_v3", "deepseek_v3_mtp", "kimi_k2", "gpt_oss_20b", "gpt_oss_120b"],
)
def test_published_configs_give_the_published_sizes(config, total, active):
    """DeepSeek-V3 671B (37B active), Kimi K2 1.03T (32B), gpt-oss-20b 20.9B (3.6B),
    gpt-oss-120b 116.8B (5.1B)."""
    cfg, family = lm_config_from_hf(config)
    counts = models.param_counts(cfg)
    assert (round(counts.total / 1e9, 2), round(counts.active / 1e9, 2)) == (total, active)
    if family == "deepseek_v3":
        first = config["first_k_dense_replace"]
        assert cfg.mlp_kinds == ("dense",) * first + ("moe",) * (61 - first)
        assert cfg.mla.qk_head_dim == 192 and cfg.mla.rope_interleave and cfg.mlp_d_ff == 18432
        assert cfg.moe.num_groups == config["n_group"] and cfg.moe.score_correction_bias
        assert cfg.mtp_layers == config["num_nextn_predict_layers"]
    else:
        assert cfg.attention_sinks and cfg.attention_bias and cfg.attention_out_bias
        assert cfg.window(0) == 128 and cfg.window(1) is None
        assert cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.truncate is False
        # transformers' defaults where a config leaves them out
        minimal = {k: v for k, v in config.items() if k not in ("layer_types", "rope_scaling")}
        assert lm_config_from_hf(minimal)[0] == cfg


DSV2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "ep_size": 1,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 6,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "attention_bias": False,
}  # fmt: skip  (deepseek-ai/DeepSeek-V2-Lite config.json)


def test_deepseek_v2_lite_reads_as_published_and_refuses_v2s_group_routing():
    """DeepSeek-V2-Lite 15.7B (2.4B active): MLA with a full-rank query, softmax top-6 without
    renormalisation, two shared experts, one dense first layer. The 236B models' group-limited
    greedy routing (groups scored by their best expert) is refused, naming the field."""
    cfg, family = lm_config_from_hf(DSV2_LITE)
    counts = models.param_counts(cfg)
    assert family == "deepseek_v2"
    assert (round(counts.total / 1e9, 2), round(counts.active / 1e9, 2)) == (15.71, 2.45)
    assert cfg.mla.q_lora_rank is None and cfg.mla.rope_interleave and cfg.mtp_layers == 0
    assert cfg.mlp_kinds == ("dense",) + ("moe",) * 26
    assert cfg.moe.router == "softmax" and not cfg.moe.norm_topk_prob
    assert cfg.moe.num_shared_experts == 2 and cfg.moe.top_k == 6
    v2 = DSV2_LITE | {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}
    with pytest.raises(hf.CheckpointError, match="topk_method='group_limited_greedy'"):
        lm_config_from_hf(v2)


def test_dense_first_layers_from_any_spelling():
    """`first_k_dense_replace` (its default 3 when absent) or transformers 5's
    `mlp_layer_types`; `moe_layer_freq` combines with them."""
    base = {k: v for k, v in DSV3.items() if k != "first_k_dense_replace"}
    spellings = {
        "first_k_dense_replace": ({"first_k_dense_replace": 2}, 2),
        "default": ({}, 3),
        "mlp_layer_types": ({"mlp_layer_types": ["dense"] + ["sparse"] * 60}, 1),
    }
    for name, (fields, dense) in spellings.items():
        cfg, _ = lm_config_from_hf(base | fields)
        assert cfg.mlp_kinds == ("dense",) * dense + ("moe",) * (61 - dense), name
    cfg, _ = lm_config_from_hf(base | {"first_k_dense_replace": 1, "moe_layer_freq": 2})
    assert cfg.mlp_kinds[:5] == ("dense", "dense", "moe", "dense", "moe")


# A Kimi-K2-style tiny model: one expert group (n_group 1), 384 experts, one dense first layer,
# and Kimi K2's model_type (its architecture is DeepSeek-V3's).
KIMI_TINY = ref.CONFIGS_2026["deepseek_v3"] | {
    "model_type": "kimi_k2", "hidden_size": 16, "n_routed_experts": 384, "n_group": 1,
    "topk_group": 1, "moe_intermediate_size": 4, "num_experts_per_tok": 8,
    "num_nextn_predict_layers": 0, "routed_scaling_factor": 2.827, "num_hidden_layers": 2,
}  # fmt: skip
ROUND_TRIPS = {
    "deepseek_v3": (ref.CONFIGS_2026["deepseek_v3"], "per_expert"),
    "deepseek_v3_fused": (ref.CONFIGS_2026["deepseek_v3"], "fused"),
    "kimi_k2_tiny": (KIMI_TINY, "per_expert"),
    "gpt_oss": (ref.CONFIGS_2026["gpt_oss"], "fused"),
    "glm4_moe": (ref.CONFIGS_2026["glm4_moe"], "per_expert"),  # with its MTP layer
    "deepseek_v2": (ref.CONFIGS_2026["deepseek_v2"], "per_expert"),
    "minimax_m2": (ref.CONFIGS_2026["minimax_m2"], "per_expert"),
    "glm4_moe_lite": (ref.CONFIGS_2026["glm4_moe_lite"], "per_expert"),  # with its MTP layer
    "minimax_m2_fused": (ref.CONFIGS_2026["minimax_m2"], "fused"),
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_load_save_load_is_bit_identical(case, tmp_path):
    config, layout = ROUND_TRIPS[case]
    sd = ref.random_state_dict(config, seed=7)
    cfg, family = lm_config_from_hf(config)
    if layout == "fused":  # as transformers 5 saves it: write ours, then read it back
        cfg0, params0, _ = _load_dict(tmp_path / "src0", config, sd)
        save_hf_model(str(tmp_path / "src"), params0, cfg0, config, layout="fused")
        sd = dict(SafetensorsCheckpoint(str(tmp_path / "src")))
    else:
        ref.write_checkpoint(str(tmp_path / "src"), config, sd, shards=3)
    assert sorted(sd) == sorted(tensor_names(cfg, family, layout))
    cfg, params, hf_config = load_hf_model(str(tmp_path / "src"))
    save_hf_model(str(tmp_path / "out"), params, cfg, hf_config, layout=layout, max_shard_bytes=1e4)
    back = SafetensorsCheckpoint(str(tmp_path / "out"))
    assert sorted(back.tensors) == sorted(sd)
    for name, want in sd.items():  # as stored: bf16, the router bias buffer float32
        got = back.read(name)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
    _, again, _ = load_hf_model(str(tmp_path / "out"))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if case == "kimi_k2_tiny":  # every one of the 384 experts is reachable in one group
        assert family == "deepseek_v3" and cfg.moe.num_groups == 1
        assert cfg.mlp_kinds == ("dense", "moe")
        with open(tmp_path / "out" / "config.json") as f:  # written back as it was read
            assert json.load(f)["model_type"] == "kimi_k2"
        tokens = np.random.default_rng(0).integers(0, 64, (4, 16))
        logits, aux = jax.jit(lambda p: models.lm_forward(p, tokens, cfg))(params)
        assert np.isfinite(np.asarray(logits)).all()
        assert int(np.asarray(aux.expert_counts).sum()) == 4 * 16 * 8


def _load_dict(path, config, sd):
    ref.write_checkpoint(str(path), config, sd, shards=1)
    return load_hf_model(str(path))


def test_mtp_copies_of_the_embedding_and_head_must_equal_them(tmp_path):
    config = ref.CONFIGS_2026["deepseek_v3"]
    sd = ref.random_state_dict(config, seed=8)
    sd["model.layers.3.shared_head.head.weight"] = sd["lm_head.weight"] * 2
    ref.write_checkpoint(str(tmp_path), config, sd, shards=1)
    with pytest.raises(CheckpointError, match=r"shared_head.head.weight.*differs from 'lm_head"):
        load_hf_model(str(tmp_path))


def test_mtp_layer_missing_says_how_to_load_without_it(tmp_path):
    config = ref.CONFIGS_2026["deepseek_v3"]
    sd = {n: t for n, t in ref.random_state_dict(config, seed=8).items() if ".layers.3." not in n}
    ref.write_checkpoint(str(tmp_path), config, sd, shards=1)
    with pytest.raises(CheckpointError, match="set num_nextn_predict_layers to 0"):
        load_hf_model(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# FP8 checkpoints (DeepSeek-V3 as published): e4m3 weights with float32 block scales


def _quantize(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """`(q float8_e4m3fn [out, in], scale_inv [ceil(out/bo), ceil(in/bi)])`: DeepSeek's
    `act_quant`-style block quantization, scale = block amax / 448."""
    (rows, cols), (bo, bi) = w.shape, block
    w = w.astype(np.float32)
    scale = np.ones((-(-rows // bo), -(-cols // bi)), np.float32)
    q = np.zeros_like(w)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi]
            scale[i, j] = max(float(np.abs(tile).max()), 1e-12) / 448.0
            q[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = tile / scale[i, j]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


def _reference_dequant(q, scale, block) -> np.ndarray:
    out = q.astype(np.float32)
    for (i, j), s in np.ndenumerate(scale):
        out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= s
    return out


QUANTIZED = ("_proj.weight", "proj_with_mqa.weight")  # Linear weights of attention and MLPs


@pytest.mark.parametrize("block", [(128, 128), (16, 12)], ids=["128x128", "16x12_partial"])
def test_fp8_block_scaled_checkpoint_is_dequantized_on_load(block, tmp_path, capsys):
    """Built from a bf16 checkpoint as DeepSeek's FP8 checkpoints are: every attention and MLP
    Linear weight e4m3 with `weight_scale_inv` per block (edge blocks partial); the loaded
    parameters are exactly `q * scale_inv` block by block, close to the bf16 originals."""
    config = ref.CONFIGS_2026["deepseek_v3"]
    sd = ref.random_state_dict(config, seed=9)
    fp8, want = dict(sd), {}
    for name, w in sd.items():
        if name.endswith(QUANTIZED) and ".layers." in name:
            q, scale = _quantize(w, block)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            want[name] = _reference_dequant(q, scale, block)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
             "activation_scheme": "dynamic"}  # fmt: skip
    ref.write_checkpoint(str(tmp_path / "fp8"), config | {"quantization_config": quant}, fp8)
    cfg, params, hf_config = load_hf_model(str(tmp_path / "fp8"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"FP8 weights (e4m3, {block[0]}x{block[1]} block" in err
    assert "quantization_config" not in hf_config
    recipes = hf.model_recipes(cfg, "deepseek_v3")
    got = {}
    for recipe in recipes:
        leaves = [np.asarray(_leaf(params, p)) for p in recipe.leaves]
        got.update(zip(recipe.tensors, recipe.to_tensors(leaves), strict=True))
    assert len(want) > 40
    for name, w in want.items():
        assert got[name].tobytes() == w.tobytes(), name  # exact: float32 products
        original = sd[name].astype(np.float32)  # e4m3 keeps 3 mantissa bits: within 1/16
        assert np.abs(got[name] - original).max() <= np.abs(original).max() / 16, name
    save_hf_model(str(tmp_path / "out"), params, cfg, hf_config)  # bf16, unquantized
    out = SafetensorsCheckpoint(str(tmp_path / "out"))
    assert not [n for n in out.tensors if n.endswith("_scale_inv")]
    with open(os.path.join(tmp_path / "out", "config.json")) as f:
        assert "quantization_config" not in json.load(f)


def _leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def test_fp8_scales_of_the_wrong_shape_name_the_tensor(tmp_path):
    config = ref.CONFIGS_2026["deepseek_v3"]
    sd = ref.random_state_dict(config, seed=9)
    name = "model.layers.0.mlp.up_proj.weight"
    sd[name], _ = _quantize(sd[name], (128, 128))
    sd[name + "_scale_inv"] = np.ones((2, 2), np.float32)  # [40, 32] in 16x16 blocks: (3, 2)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    ref.write_checkpoint(str(tmp_path), config | {"quantization_config": quant}, sd)
    with pytest.raises(CheckpointError, match=r"up_proj.weight_scale_inv.*need \(3, 2\)"):
        load_hf_model(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Fields moejax does not implement: one error naming the field and what it would need; nothing
# read, nothing written.

GPT_OSS = ref.CONFIGS_2026["gpt_oss"]
DEEPSEEK = ref.CONFIGS_2026["deepseek_v3"]
UNIMPLEMENTED = {
    "first_k_dense_replace_beyond_layers": (
        DEEPSEEK | {"first_k_dense_replace": 5}, r"first_k_dense_replace=5: must be an int from 0"
    ),
    "unknown_layer_types_entry": (
        GPT_OSS | {"layer_types": ["sliding_attention", "linear_attention"] * 2},
        r"layer_types: entries \['linear_attention'\] are not implemented",
    ),
    "deepseek_v4_hash_layers": (
        DEEPSEEK | {"mlp_layer_types": ["hash_moe", "moe", "moe"]},
        r"mlp_layer_types=.*hash-routed MoE layers .*would need a router keyed by token ids",
    ),
    "deepseek_v4_num_hash_layers": (DEEPSEEK | {"num_hash_layers": 3}, r"num_hash_layers=3"),
    "deepseek_v4_sqrtsoftplus": (
        DEEPSEEK | {"scoring_func": "sqrtsoftplus"}, r"scoring_func='sqrtsoftplus'.*would need"
    ),
    "llama4_probs_on_input": (
        GPT_OSS | {"moe_apply_probs_on_input": True},
        r"moe_apply_probs_on_input=True.*would need the probabilities applied before",
    ),
    "latent_moe": (DEEPSEEK | {"moe_latent_size": 8}, r"moe_latent_size=8.*latent MoE.*would"),
    "mla_attention_bias": (DEEPSEEK | {"attention_bias": True}, r"attention_bias=true: MLA"),
    "mxfp4": (
        GPT_OSS | {"quantization_config": {"quant_method": "mxfp4"}},
        r"quant_method='mxfp4'.*dequantize this one first",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(UNIMPLEMENTED))
def test_unimplemented_field_is_one_error_and_nothing_is_loaded_or_written(
    case, tmp_path, monkeypatch
):
    config, message = UNIMPLEMENTED[case]
    base = DEEPSEEK if config["model_type"] == "deepseek_v3" else GPT_OSS
    ref.write_checkpoint(str(tmp_path / "src"), config, ref.random_state_dict(base, 1), shards=1)
    reads = []
    real_read = SafetensorsCheckpoint.read
    monkeypatch.setattr(
        SafetensorsCheckpoint,
        "read",
        lambda self, *a, **k: reads.append(a) or real_read(self, *a, **k),
    )
    with pytest.raises(CheckpointError, match=message) as err:
        hf.convert_to_orbax(str(tmp_path / "src"), str(tmp_path / "out"))
    assert "\n" not in str(err.value) and "config.json" in str(err.value)
    assert reads == [] and not (tmp_path / "out").exists()  # no tensor read, no output
    with pytest.raises(CheckpointError, match=message):
        lm_config_from_hf(config)
