"""Bad Hugging Face input gives one clear error naming the file and tensor (or config field), and
a failed export leaves nothing behind."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from _hf_cases import CONFIGS
from safetensors.numpy import save_file

from moejax.interop import hf
from moejax.testing import random_params

PREFIX = "model.layers.0.mlp."


def _mixtral():
    cfg, family = hf.moe_config_from_hf(CONFIGS["mixtral"])
    return cfg, family, hf.block_to_hf(random_params(cfg), cfg, family, PREFIX)


def _sharded(tmp_path, tensors):
    """A two-shard checkpoint: the router in shard 1, the experts in shard 2."""
    path = tmp_path / "ckpt"
    with hf.CheckpointWriter(path, max_shard_bytes=1) as writer:
        for name, value in tensors.items():
            writer.add(name, value)
        writer.add_file("config.json", CONFIGS["mixtral"])
    assert (path / "model-00002-of-00003.safetensors").exists()
    return path


# ---------------------------------------------------------------------------------------------
# Tensors


def test_missing_tensor_names_it():
    cfg, family, tensors = _mixtral()
    del tensors[PREFIX + "experts.down_proj"]
    with pytest.raises(hf.MissingTensorError, match=r"'model.layers.0.mlp.experts.down_proj'"):
        hf.block_from_hf(tensors, cfg, family, PREFIX)


def test_missing_tensor_in_a_checkpoint_names_it_and_the_checkpoint(tmp_path):
    cfg, family, tensors = _mixtral()
    del tensors[PREFIX + "gate.weight"]
    path = hf.save_safetensors(tmp_path / "ckpt", tensors)
    with (
        hf.SafetensorsCheckpoint(path) as ckpt,
        pytest.raises(KeyError, match=rf"'{PREFIX}gate.weight'.*{path}"),
    ):
        hf.block_from_hf(ckpt, cfg, family, PREFIX)
    with hf.SafetensorsCheckpoint(path) as ckpt, pytest.raises(hf.MissingTensorError, match="nope"):
        ckpt["nope"]


def test_missing_shard_names_the_shard_and_a_tensor(tmp_path):
    _, _, tensors = _mixtral()
    path = _sharded(tmp_path, tensors)
    shard = "model-00002-of-00003.safetensors"
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    tensor = next(name for name, file in index.items() if file == shard)
    os.remove(path / shard)
    with pytest.raises(hf.CheckpointError, match=rf"tensor '{tensor}' in '.*{shard}'.*missing"):
        hf.SafetensorsCheckpoint(path)


def test_wrong_shape_names_tensor_file_and_both_shapes(tmp_path):
    cfg, family, tensors = _mixtral()
    name = PREFIX + "experts.gate_up_proj"
    tensors[name] = tensors[name][:, :-2]
    path = _sharded(tmp_path, tensors)
    with hf.SafetensorsCheckpoint(path) as ckpt:
        file = ckpt.file_of(name)
        with pytest.raises(hf.CheckpointError) as err:
            hf.block_from_hf(ckpt, cfg, family, PREFIX)
    assert err.value.tensor == name and err.value.file == file
    assert f"'{name}' in '{file}'" in str(err.value)
    assert "(8, 14, 16)" in str(err.value) and "(8, 16, 16)" in str(err.value)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, ml_dtypes.float8_e4m3fn])
def test_dtype_the_model_cannot_take_names_tensor_and_file(dtype, tmp_path):
    cfg, family, tensors = _mixtral()
    name = PREFIX + "experts.down_proj"
    tensors[name] = tensors[name].astype(dtype)
    path = hf.save_safetensors(tmp_path / "ckpt", tensors)
    with hf.SafetensorsCheckpoint(path) as ckpt:
        assert ckpt.dtype_of(name) != "float32"
        with pytest.raises(hf.CheckpointError, match=rf"'{name}' in '.*model.safetensors'.*dtype"):
            hf.block_from_hf(ckpt, cfg, family, PREFIX)


def test_unexpected_tensor_under_the_prefix_is_an_error():
    cfg, family, tensors = _mixtral()
    tensors[PREFIX + "gate.bias"] = np.zeros(8, np.float32)
    with pytest.raises(hf.CheckpointError, match=r"'model.layers.0.mlp.gate.bias'.*strict=False"):
        hf.block_from_hf(tensors, cfg, family, PREFIX)
    assert hf.block_from_hf(tensors, cfg, family, PREFIX, strict=False)["router"]["kernel"].size


def test_more_experts_than_the_config_is_an_error():
    cfg, family, _ = _mixtral()
    tensors = hf.block_to_hf(random_params(cfg), cfg, family, PREFIX, "per_expert")
    smaller = cfg.replace(num_experts=4)
    with pytest.raises(hf.CheckpointError, match=r"experts.4.w1.weight'.*with 4 experts"):
        hf.block_from_hf(tensors, smaller, family, PREFIX)
    with pytest.raises(hf.CheckpointError, match=r"gate.weight'.*shape \(8, 16\)"):
        hf.block_from_hf(tensors, smaller, family, PREFIX, strict=False)


def test_neither_layout_found_says_what_was_looked_for():
    cfg, family, tensors = _mixtral()
    with pytest.raises(hf.CheckpointError, match=r"neither.*experts.gate_up_proj.*experts.0.w3"):
        hf.block_from_hf(tensors, cfg, family, "model.layers.7.mlp.")


def test_mxfp4_gpt_oss_experts_say_dequantize():
    cfg, family = hf.moe_config_from_hf(CONFIGS["gpt_oss"])
    tensors = hf.block_to_hf(random_params(cfg), cfg, family, PREFIX)
    blocks = tensors.pop(PREFIX + "experts.gate_up_proj")
    tensors[PREFIX + "experts.gate_up_proj_blocks"] = blocks.view(np.uint8)
    with pytest.raises(hf.MissingTensorError, match="MXFP4"):
        hf.block_from_hf(tensors, cfg, family, PREFIX, strict=False)


def test_layout_a_family_lacks_is_an_error():
    cfg, family = hf.moe_config_from_hf(CONFIGS["switch"])
    with pytest.raises(ValueError, match=r"layout='fused'.*per_expert"):
        hf.block_tensor_names(cfg, family, PREFIX, "fused")
    cfg, family = hf.moe_config_from_hf(CONFIGS["gpt_oss"])
    with pytest.raises(ValueError, match=r"layout='per_expert'.*fused"):
        hf.block_to_hf(random_params(cfg), cfg, family, PREFIX, "per_expert")


def test_config_the_family_cannot_hold_is_an_error():
    cfg, family, _ = _mixtral()
    with pytest.raises(ValueError, match="MoEConfig.expert_bias=True"):
        hf.block_tensor_names(cfg.replace(expert_bias=True), family)
    with pytest.raises(ValueError, match="MoEConfig.norm_topk_prob=False"):
        hf.moe_config_to_hf(cfg.replace(norm_topk_prob=False), family)
    with pytest.raises(ValueError, match=r"params\['experts'\]\['w_up'\] has shape"):
        params = random_params(cfg)
        params["experts"]["w_up"] = params["experts"]["w_up"][:, :, :-1]
        hf.block_to_hf(params, cfg, family)


def test_no_checkpoint_at_path(tmp_path):
    with pytest.raises(hf.CheckpointError, match=rf"'{tmp_path}'.*model.safetensors"):
        hf.SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(hf.CheckpointError, match="model.safetensors'.*not a safetensors file"):
        hf.SafetensorsCheckpoint(tmp_path)
    with pytest.raises(hf.CheckpointError, match="config.json'.*missing"):
        hf.read_config(tmp_path)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(hf.CheckpointError, match=r"tensor 'b' in '.*s1.safetensors'.*not in the"):
        hf.SafetensorsCheckpoint(tmp_path)  # found on opening: every header is read then


# ---------------------------------------------------------------------------------------------
# config.json


@pytest.mark.parametrize(
    "family,change,field",
    [
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),  # erf GELU; moejax's is tanh
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("mixtral", {"dtype": "int8"}, "dtype"),
        ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen3_moe", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
        ("deepseek_v3", {"n_group": 3}, "n_group"),
        ("deepseek_v3", {"n_shared_experts": 0}, "n_shared_experts"),
        ("switch", {"router_dtype": "bfloat16"}, "router_dtype"),
        ("switch", {"dense_act_fn": "gelu"}, "dense_act_fn"),
        ("qwen3_moe", {"num_local_experts": 16}, "num_experts / num_local_experts"),
    ],
)
def test_config_field_moejax_cannot_honour_names_it(family, change, field):
    with pytest.raises(ValueError, match=rf"config.json {field}="):
        hf.moe_config_from_hf({**CONFIGS[family], **change})


def test_ignored_fields_are_dropped():
    jitter = {**CONFIGS["switch"], "router_jitter_noise": 0.01}
    cfg, _ = hf.moe_config_from_hf(jitter, ignore={"router_jitter_noise"})
    assert cfg == hf.moe_config_from_hf(CONFIGS["switch"])[0]


def test_unknown_architecture_is_an_error():
    with pytest.raises(ValueError, match=r"model_type='gemma'.*mixtral"):
        hf.moe_config_from_hf({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]})
    with pytest.raises(ValueError, match=r"architectures=\['GemmaForCausalLM'\]"):
        hf.moe_config_from_hf({"architectures": ["GemmaForCausalLM"], "hidden_size": 8})
    with pytest.raises(ValueError, match=r"'LlamaForCausalLM' is not a Mixtral\*"):
        hf.moe_config_from_hf({**CONFIGS["mixtral"], "architectures": ["LlamaForCausalLM"]})
    no_type = {k: v for k, v in CONFIGS["olmoe"].items() if k != "model_type"}
    assert hf.moe_config_from_hf(no_type)[1] == "olmoe"  # architectures suffice
    with pytest.raises(ValueError, match="family='gemma': not one of"):
        hf.block_tensor_names(hf.moe_config_from_hf(CONFIGS["olmoe"])[0], "gemma")
    # Llama is a dense family: whole models only (test_hf_dense.py), no MoE block
    with pytest.raises(ValueError, match="model_type='llama': a dense model"):
        hf.moe_config_from_hf({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


# ---------------------------------------------------------------------------------------------
# Atomic export


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir())


def test_failure_mid_export_leaves_nothing(tmp_path, monkeypatch):
    _, _, tensors = _mixtral()
    import safetensors.numpy

    real, calls = safetensors.numpy.save_file, []

    def failing_save_file(*args, **kw):  # the second shard fails, after the first was written
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args, **kw)

    monkeypatch.setattr(safetensors.numpy, "save_file", failing_save_file)
    with pytest.raises(hf.CheckpointError, match="disk full"):
        hf.save_safetensors(tmp_path / "out", tensors, max_shard_bytes=1)
    assert os.path.exists(calls[0]) is False and len(calls) == 2
    assert _leftovers(tmp_path) == []


def test_exception_inside_the_writer_leaves_nothing(tmp_path):
    _, _, tensors = _mixtral()
    with pytest.raises(RuntimeError), hf.CheckpointWriter(tmp_path / "out", max_shard_bytes=1) as w:
        for name, value in tensors.items():
            w.add(name, value)
        raise RuntimeError("the model iterator failed")
    assert _leftovers(tmp_path) == []
    with pytest.raises(hf.CheckpointError, match="object has no safetensors type"):
        hf.save_safetensors(tmp_path / "out", {**tensors, "x": np.array([None])})
    assert _leftovers(tmp_path) == []


def test_existing_checkpoint_is_replaced_only_when_asked(tmp_path):
    _, _, tensors = _mixtral()
    path = hf.save_safetensors(tmp_path / "out", tensors)
    with pytest.raises(hf.CheckpointError, match="earlier moejax output.*overwrite"):
        hf.save_safetensors(path, tensors)
    small = {"a": np.arange(3, dtype=np.float32)}
    hf.save_safetensors(path, small, overwrite=True, files={"config.json": {"x": 1}})
    assert _leftovers(tmp_path) == ["out"]
    assert sorted(os.listdir(path)) == [".moejax-output.json", "config.json", "model.safetensors"]
    with hf.SafetensorsCheckpoint(path) as ckpt:
        assert list(ckpt) == ["a"]
    assert hf.read_config(path) == {"x": 1}


def test_sharded_checkpoint_reads_back(tmp_path):
    _, _, tensors = _mixtral()
    path = _sharded(tmp_path, tensors)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    assert hf.read_config(path) == CONFIGS["mixtral"]
    with hf.SafetensorsCheckpoint(path) as ckpt:
        assert sorted(ckpt) == sorted(tensors) and len(ckpt) == len(tensors)
        for name, value in tensors.items():
            assert ckpt.shape_of(name) == value.shape
            np.testing.assert_array_equal(ckpt[name], value)
