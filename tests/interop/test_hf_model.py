"""Whole Hugging Face MoE decoders: load, forward against a numpy transcription of transformers'
decoders (`_hf_decoder_reference.py`), save back bit-identically, and reject bad input with an
error that names the file and the tensor."""

from __future__ import annotations

import json
import os

import _hf_decoder_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import models
from moejax.interop.hf import (
    CheckpointError,
    SafetensorsCheckpoint,
    lm_config_from_hf,
    load_hf_model,
    save_hf_model,
    tensor_names,
)

FAMILIES = sorted(ref.CONFIGS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny random checkpoint directory per family (3 shards + index; OLMoE in one file)."""
    out = {}
    for family, config in ref.CONFIGS.items():
        path = str(tmp_path_factory.mktemp(family))
        sd = ref.random_state_dict(config, seed=len(out))
        ref.write_checkpoint(path, config, sd, shards=1 if family == "olmoe" else 3)
        out[family] = (path, sd)
    return out


@pytest.mark.slow  # test_hf_fidelity checks the same against transformers itself
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_transcription(checkpoints, family):
    path, sd = checkpoints[family]
    cfg, params, hf_config = load_hf_model(path)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
    logits, aux = jax.jit(lambda p, t: models.lm_forward(p, t, cfg))(params, jnp.asarray(tokens))
    inv_freq, scaling = models.rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if cfg.rope_scaling is not None:  # the reference's own formula for linear scaling
        assert cfg.rope_scaling.kind == "linear"
        dh = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2) / dh)) / cfg.rope_scaling.factor
    else:
        inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim))
    want, routing = ref.decoder_logits(sd, hf_config, tokens, inv_freq, scaling)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    counts = np.asarray(aux.expert_counts)
    for j, index in enumerate(routing):  # top-k choices exactly those of the reference
        want_counts = np.bincount(index.ravel(), minlength=counts.shape[1])
        np.testing.assert_array_equal(counts[j], want_counts)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_export_round_trip_is_bit_identical(checkpoints, family, tmp_path):
    path, sd = checkpoints[family]
    cfg, params, hf_config = load_hf_model(path)
    out = str(tmp_path / "out")
    save_hf_model(out, params, cfg, hf_config, max_shard_bytes=20_000)
    saved = SafetensorsCheckpoint(out)
    assert sorted(saved.tensors) == sorted(sd)
    for name, want in sd.items():
        got = saved.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f) == hf_config
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary left


def test_fused_layout_round_trip(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3_moe"]
    cfg, params, hf_config = load_hf_model(path)
    save_hf_model(str(tmp_path / "fused"), params, cfg, hf_config, layout="fused")
    names = set(SafetensorsCheckpoint(str(tmp_path / "fused")).tensors)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert names == set(tensor_names(cfg, "qwen3_moe", "fused"))
    _, again, _ = load_hf_model(str(tmp_path / "fused"))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_options_come_from_the_config():
    cfgs = {f: lm_config_from_hf(c)[0] for f, c in ref.CONFIGS.items()}
    assert cfgs["qwen3_moe"].qk_norm == "head" and cfgs["olmoe"].qk_norm == "full"
    assert cfgs["mixtral"].qk_norm is None and cfgs["qwen2_moe"].attention_bias
    assert not cfgs["qwen2_moe"].attention_out_bias and cfgs["olmoe"].tie_embeddings
    assert cfgs["qwen2_moe"].moe_layers == (1, 3) and cfgs["qwen2_moe"].mlp_d_ff == 40
    assert cfgs["qwen3_moe"].head_dim == 16 and cfgs["mixtral"].rope_scaling.factor == 2.0
    assert cfgs["qwen2_moe"].moe.shared_gate and cfgs["qwen2_moe"].moe.shared_width == 32


# ---------------------------------------------------------------------------------------------
# RoPE scaling formulas (transformers' modeling_rope_utils), by their defining properties


def test_rope_llama3_keeps_high_and_divides_low_frequencies():
    sc = models.RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)
    base, _ = models.rope_frequencies(128, 500000.0, None)
    got, factor = models.rope_frequencies(128, 500000.0, sc)
    wavelen = 2 * np.pi / base
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert factor == 1.0 and high.any() and low.any()
    np.testing.assert_array_equal(got[high], base[high])
    np.testing.assert_allclose(got[low], base[low] / 8, rtol=1e-6)
    mid = ~high & ~low
    assert np.all((got[mid] < base[mid]) & (got[mid] > base[mid] / 8))


def test_rope_yarn_ramps_from_extrapolation_to_interpolation():
    sc = models.RopeScaling("yarn", 4.0, 4096)
    base, _ = models.rope_frequencies(64, 10000.0, None)
    got, factor = models.rope_frequencies(64, 10000.0, sc)
    assert factor == pytest.approx(0.1 * np.log(4.0) + 1.0)
    np.testing.assert_allclose(got[0], base[0], rtol=1e-6)  # fastest: extrapolated
    np.testing.assert_allclose(got[-1], base[-1] / 4, rtol=1e-6)  # slowest: interpolated
    assert np.all(np.diff(got / base) <= 1e-7)  # the share moves one way


def test_rope_linear_divides_every_frequency():
    base, _ = models.rope_frequencies(16, 10000.0, None)
    got, _ = models.rope_frequencies(16, 10000.0, models.RopeScaling("linear", 2.0))
    np.testing.assert_allclose(got, base / 2, rtol=1e-7)


# ---------------------------------------------------------------------------------------------
# Bad input


def _copy(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_missing_shard_names_the_file(checkpoints, tmp_path):
    path = _copy(checkpoints["mixtral"][0], tmp_path / "ck")
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors.*missing"):
        load_hf_model(path)


def test_wrong_shape_names_file_and_tensor(checkpoints, tmp_path):
    path = _copy(checkpoints["olmoe"][0], tmp_path / "ck")
    sd = SafetensorsCheckpoint(path)
    tensors = [(n, sd.read(n)) for n in sd.tensors]
    bad = "model.layers.1.self_attn.k_norm.weight"
    tensors = [(n, t[:-1] if n == bad else t) for n, t in tensors]
    ref.write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    match = rf"tensor '{bad}' in '.*model\.safetensors': has shape"
    with pytest.raises(CheckpointError, match=match):
        load_hf_model(path)


def test_integer_dtype_names_file_and_tensor(checkpoints, tmp_path):
    path = _copy(checkpoints["olmoe"][0], tmp_path / "ck")
    sd = SafetensorsCheckpoint(path)
    bad = "model.norm.weight"
    tensors = [(n, sd.read(n).astype(np.int32) if n == bad else sd.read(n)) for n in sd.tensors]
    ref.write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    with pytest.raises(CheckpointError, match=rf"tensor '{bad}' in .*: has dtype I32"):
        load_hf_model(path)


def test_unknown_architecture_is_one_clear_error(checkpoints, tmp_path):
    path = _copy(checkpoints["mixtral"][0], tmp_path / "ck")
    config = dict(ref.CONFIGS["mixtral"], model_type="jamba", architectures=["JambaForCausalLM"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match="model_type='jamba'.*not supported"):
        load_hf_model(path)


def test_missing_tensor_names_it(checkpoints, tmp_path):
    path = _copy(checkpoints["olmoe"][0], tmp_path / "ck")
    sd = SafetensorsCheckpoint(path)
    bad = "model.layers.0.mlp.experts.3.up_proj.weight"
    ref.write_safetensors(
        os.path.join(path, "model.safetensors"), [(n, sd.read(n)) for n in sd.tensors if n != bad]
    )
    with pytest.raises(CheckpointError, match=rf"tensor '{bad}': not in the checkpoint"):
        load_hf_model(path)


def test_failed_export_leaves_nothing(checkpoints, tmp_path):
    path, _ = checkpoints["mixtral"]
    cfg, params, hf_config = load_hf_model(path)
    experts = params["layers"][1]["moe"]["experts"]
    experts["w_up"] = experts["w_up"][:2]  # 2 experts of 4: the export fails half-way
    with pytest.raises(ValueError):
        save_hf_model(str(tmp_path / "out"), params, cfg, hf_config)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_layers_named_as_the_block_mapping_names_them(family, layout):
    """The whole-model table's MoE tensors are `moejax.interop.hf.block_to_hf`'s, same arrays."""
    from moejax.interop import hf
    from moejax.interop.hf import model_recipes
    from moejax.interop.hf._model import _empty_tree, _set

    cfg, _ = lm_config_from_hf(ref.CONFIGS[family])
    sd = ref.random_state_dict(ref.CONFIGS[family], dtype=np.float32)
    params = _empty_tree(cfg)  # numpy leaves, read through the per-expert table
    for recipe in model_recipes(cfg, family, "per_expert"):
        arrays = recipe.to_leaves([sd[n] for n in recipe.tensors])
        for path, array in zip(recipe.leaves, arrays, strict=True):
            _set(params, path, array)
    ours = {}
    for recipe in model_recipes(cfg, family, layout):
        if "moe" in recipe.leaves[0]:
            leaves = [np.asarray(_leaf(params, p)) for p in recipe.leaves]
            ours.update(zip(recipe.tensors, recipe.to_tensors(leaves), strict=True))
    theirs = {}
    for i in cfg.moe_layers:
        block = params["layers"][i]["moe"]
        prefix = hf.block_prefix(family, i, layout)
        theirs.update(hf.block_to_hf(block, cfg.moe, family, prefix, layout=layout))
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        np.testing.assert_array_equal(ours[name], np.asarray(t), err_msg=name)


def _leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


# ---------------------------------------------------------------------------------------------
# Published configs: the config.json fields of mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B,
# allenai/OLMoE-1B-7B-0924 and Qwen/Qwen1.5-MoE-A2.7B, transcribed (the Hub is not reachable from
# the machine these tests were written on); the sizes are the ones their model cards give.

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "clip_qkv": None,
    "eos_token_id": 50279,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 1024,
    "max_position_embeddings": 4096,
    "model_type": "olmoe",
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "pad_token_id": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 50304,
}
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
    "max_window_layers": 21,
    "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize(
    "config,total,qk_norm,bias",
    [
        (MIXTRAL_8X7B, 46.70, None, False),
        (QWEN3_30B_A3B, 30.53, "head", False),
        (OLMOE_1B_7B, 6.92, "full", False),
        (QWEN15_MOE_A27B, 14.32, None, True),
    ],
)
def test_published_configs_give_the_published_sizes(config, total, qk_norm, bias):
    """46.7B (Mixtral), 30.5B (Qwen3-30B-A3B), 6.9B (OLMoE-1B-7B), 14.3B (Qwen1.5-MoE-A2.7B)."""
    cfg, _ = lm_config_from_hf(config)
    assert round(models.param_counts(cfg).total / 1e9, 2) == total
    assert (cfg.qk_norm, cfg.attention_bias) == (qk_norm, bias)
