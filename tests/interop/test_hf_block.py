"""Hugging Face MoE block tensors <-> moejax parameters, against the numpy transcriptions of the
published blocks (tests/core/_hf_reference.py, which tests/core/test_families.py checks against
transformers), without torch: names, layouts, round trips bit for bit, and the config.json reader.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hf_cases import CONFIGS, load_reference

from moejax import presets
from moejax.interop import hf
from moejax.testing import random_params

ref = load_reference()
FAMILIES = sorted(CONFIGS)
PREFIX = "model.layers.1.mlp."


def _sigmoid_grouped(config):
    """DeepSeek-V3's reference block with `config`'s routing fields."""
    return ref.to_hf_deepseek_v3, functools.partial(
        ref.deepseek_v3_block,
        top_k=config["num_experts_per_tok"],
        n_group=config["n_group"],
        topk_group=config["topk_group"],
        norm_topk_prob=config["norm_topk_prob"],
        scaling=config["routed_scaling_factor"],
    )


# The reference layout writer and block of each family, with the CONFIGS sizes.
REFERENCE = {
    "mixtral": (ref.to_hf_mixtral, functools.partial(ref.mixtral_block, top_k=2)),
    "qwen2_moe": (
        ref.to_hf_qwen2_moe,
        functools.partial(ref.qwen2_moe_block, top_k=2, norm_topk_prob=False),
    ),
    "qwen3_moe": (
        ref.to_hf_mixtral,
        functools.partial(ref.mixtral_block, top_k=3, norm_topk_prob=True),
    ),
    "olmoe": (
        ref.to_hf_mixtral,
        functools.partial(ref.mixtral_block, top_k=3, norm_topk_prob=False),
    ),
    "deepseek_v2": (
        ref.to_hf_deepseek_v2,
        functools.partial(ref.deepseek_v2_block, top_k=3, scaling=2.0),
    ),
    # DeepSeek-V3's block; transformers' Glm4MoeMoE (and GLM-4.7-Flash's) reuses its router
    **{
        family: _sigmoid_grouped(CONFIGS[family])
        for family in ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
    },
    "minimax_m2": (ref.to_hf_minimax_m2, functools.partial(ref.minimax_m2_block, top_k=3)),
    "gpt_oss": (ref.to_hf_gpt_oss, functools.partial(ref.gpt_oss_block, top_k=2, limit=1.0)),
    "switch": (ref.to_hf_switch, functools.partial(ref.switch_block, expert_capacity=3)),
}


def config(family):
    cfg, name = hf.moe_config_from_hf(CONFIGS[family])
    assert name == family
    return cfg.replace(block_size=8)


def layouts(family):
    return hf.FAMILIES[family].layouts


CASES = [(f, layout) for f in FAMILIES for layout in layouts(f)]


def test_config_reader_gives_each_family_its_preset():
    sizes = dict(d_model=16, d_ff=8, num_experts=8, top_k=3)
    grouped = functools.partial(presets.deepseek_v3, **sizes, num_groups=4, topk_groups=2)
    expected = {
        "mixtral": presets.mixtral(d_model=16, d_ff=8, num_experts=8),
        "qwen2_moe": presets.qwen2_moe(d_model=16, d_ff=8, num_experts=8, top_k=2, shared_d_ff=12),
        "qwen3_moe": presets.qwen3_moe(d_model=16, d_ff=8, num_experts=8, top_k=3),
        "olmoe": presets.olmoe(d_model=16, d_ff=8, num_experts=8, top_k=3),
        "deepseek_v2": presets.deepseek_v2(
            d_model=16, d_ff=8, num_experts=8, top_k=3, routed_scaling_factor=2.0
        ),
        "deepseek_v3": grouped(num_shared_experts=2),
        "glm4_moe": grouped(num_shared_experts=2, routed_scaling_factor=1.5),
        "glm4_moe_lite": grouped(routed_scaling_factor=1.8),
        "minimax_m2": presets.minimax_m2(d_model=16, d_ff=8, num_experts=8, top_k=3),
        "gpt_oss": presets.gpt_oss(d_model=16, d_ff=8, num_experts=8, top_k=2, swiglu_limit=1.0),
        "switch": presets.switch(d_model=16, d_ff=8, num_experts=8, expert_capacity=3),
    }
    for family in FAMILIES:
        assert config(family) == expected[family].replace(block_size=8), family


@pytest.mark.parametrize("family", FAMILIES)
def test_config_writer_inverts_the_reader(family):
    cfg = config(family)
    written = hf.moe_config_to_hf(cfg, family)
    assert hf.moe_config_from_hf(written) == (cfg.replace(block_size=128), family)
    for key, value in written.items():  # the same values as the published config.json
        assert CONFIGS[family].get(key, value) == value, (family, key)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_is_the_published_layout(family):
    """moejax params -> the tensors the published module holds (the transcription's mapping)."""
    cfg = config(family)
    params = random_params(cfg, seed=3)
    to_published, _ = REFERENCE[family]
    expected = to_published(params)
    layout = "fused" if "fused" in layouts(family) else "per_expert"
    got = hf.block_to_hf(params, cfg, family, PREFIX, layout)
    assert sorted(got) == sorted(PREFIX + name for name in expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[PREFIX + name].astype(np.float64), value, err_msg=name)
    assert sorted(got) == sorted(hf.block_tensor_names(cfg, family, PREFIX, layout))


@pytest.mark.parametrize("family", FAMILIES)
def test_import_of_the_published_layout_gives_back_the_parameters(family):
    """Published tensors -> moejax params, exactly. With test_export_is_the_published_layout and
    tests/core/test_families.py (moejax on `params` equals the published block on
    `to_published(params)`), the imported layer computes the published block."""
    cfg = config(family)
    params = random_params(cfg, seed=4)
    to_published, _ = REFERENCE[family]
    state = {PREFIX + k: v.astype(np.float32) for k, v in to_published(params).items()}
    got = hf.block_from_hf(state, cfg, family, PREFIX)
    assert jax.tree.structure(got) == jax.tree.structure(params)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        mine = got[path[0].key][path[1].key]
        assert mine.dtype == np.float32
        np.testing.assert_array_equal(mine, leaf, err_msg=jax.tree_util.keystr(path))


def _bits(a):
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.mark.parametrize("family,layout", CASES)
def test_round_trip_through_files_is_bit_identical(family, layout, tmp_path):
    cfg = config(family)
    tensors = hf.block_to_hf(random_params(cfg, seed=6), cfg, family, PREFIX, layout)
    first = hf.save_safetensors(tmp_path / "a", tensors)
    with hf.SafetensorsCheckpoint(first) as ckpt:
        assert hf.detect_layout(ckpt, family, PREFIX) == layout
        params = hf.block_from_hf(ckpt, cfg, family, PREFIX)
    again = hf.block_to_hf(params, cfg, family, PREFIX, layout)
    assert sorted(again) == sorted(tensors)
    for name in tensors:
        assert again[name].dtype == tensors[name].dtype
        np.testing.assert_array_equal(_bits(again[name]), _bits(tensors[name]), err_msg=name)
    second = hf.save_safetensors(tmp_path / "b", again)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_trip_keeps_half_precision_bits(dtype, tmp_path):
    cfg = config("deepseek_v3").replace(param_dtype=dtype)
    tensors = hf.block_to_hf(random_params(cfg, seed=7), cfg, "deepseek_v3", PREFIX, "per_expert")
    path = hf.save_safetensors(tmp_path / "ckpt", tensors, max_shard_bytes=4096)
    assert (path / "model.safetensors.index.json").exists()  # sharded
    with hf.SafetensorsCheckpoint(path) as ckpt:
        params = hf.block_from_hf(ckpt, cfg, "deepseek_v3", PREFIX)
    assert params["experts"]["w_up"].dtype == jnp.dtype(dtype)
    again = hf.block_to_hf(params, cfg, "deepseek_v3", PREFIX, "per_expert")
    for name in tensors:
        np.testing.assert_array_equal(_bits(again[name]), _bits(tensors[name]), err_msg=name)
    with hf.SafetensorsCheckpoint(path) as ckpt:  # dtype= casts (here exactly: fp32 holds both)
        wide = hf.block_from_hf(ckpt, cfg, "deepseek_v3", PREFIX, dtype="float32")
    assert wide["experts"]["w_up"].dtype == np.float32
    np.testing.assert_array_equal(wide["experts"]["w_up"], params["experts"]["w_up"])


@pytest.mark.parametrize("family", [f for f in FAMILIES if len(layouts(f)) == 2])
def test_per_expert_and_fused_hold_the_same_parameters(family):
    cfg = config(family)
    params = random_params(cfg, seed=8)
    per_expert = hf.block_to_hf(params, cfg, family, PREFIX, "per_expert")
    fused = hf.block_to_hf(hf.block_from_hf(per_expert, cfg, family, PREFIX), cfg, family, PREFIX)
    assert fused.keys() == hf.block_to_hf(params, cfg, family, PREFIX).keys()
    for name, value in hf.block_to_hf(params, cfg, family, PREFIX).items():
        np.testing.assert_array_equal(fused[name], value, err_msg=name)


def test_block_prefix_follows_transformers_module_paths():
    assert hf.block_prefix("mixtral", 3, "per_expert") == "model.layers.3.block_sparse_moe."
    assert hf.block_prefix("mixtral", 3, "fused") == "model.layers.3.mlp."
    assert hf.block_prefix("deepseek_v3", 0, "per_expert") == "model.layers.0.mlp."
    with pytest.raises(ValueError, match="encoder and a decoder"):
        hf.block_prefix("switch", 1, "per_expert")
