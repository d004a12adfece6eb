"""Hugging Face MoE checkpoints <-> moejax layer parameters, `MoEConfig` and whole decoders.

One table, `FAMILIES` (`HFFamily` records): `mixtral`, `qwen2_moe`, `qwen3_moe`, `olmoe`,
`deepseek_v2`, `deepseek_v3` (also Kimi K2's `model_type` `kimi_k2`), `glm4_moe`,
`glm4_moe_lite`, `minimax_m2`, `gpt_oss`, `switch` (Switch Transformers) name their MoE blocks'
tensors there, and the ten whose whole decoders moejax reads (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-V2-Lite, DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash with their MTP layers,
MiniMax-M2, GPT-OSS) carry an `HFDecoder`; so do the dense decoders `llama`,
`qwen2`, `qwen3` (`HFFamily.dense`: no MoE block; they load as all-dense `LMConfig`s, the
sources of `moejax.models.upcycle`). Block tensors come in two layouts: `"per_expert"` (one
Linear per expert, as published checkpoints store them) and `"fused"` (transformers 5's stacked
`experts.gate_up_proj` / `experts.down_proj`); `LAYOUTS` names both and `FAMILIES[name].layouts`
says which a family has. `FLOAT_DTYPES` are the tensor dtypes a parameter can have.

- Config (one reader): `read_config(path)` -> dict; `family_of(config)` -> family name;
  `moe_config_from_hf(config)` -> `(MoEConfig, family)`; `lm_config_from_hf(config)` ->
  `(LMConfig, family)`; `moe_config_to_hf(cfg, family)` -> the block's `config.json` fields.
- One block: `block_from_hf(tensors, cfg, family, prefix)` -> layer params; `block_to_hf(params,
  cfg, family, prefix, layout)` -> tensors; `block_tensor_names` / `block_tensor_shapes` list
  what a block has; `detect_layout` tells which layout a checkpoint uses; `block_prefix` gives a
  layer's prefix in a whole decoder-only checkpoint.
- Whole decoders: `load_hf_model(path, mesh=...)` streams a checkpoint directory onto a mesh
  (FP8 block-scaled weights dequantized);
  `save_hf_model(path, params, cfg, hf_config)` writes one back (sharded, atomic);
  `model_recipes` / `tensor_names` list the tensors a model has.
- Files: `SafetensorsCheckpoint(path)`, the one safetensors reader, a lazy Mapping over a
  checkpoint directory (sharded or not) that validates every header and index on opening and
  refuses NaN/Inf weights (`NonFiniteError`) unless `allow_nonfinite=True`; `CheckpointWriter`
  / `save_safetensors`, the one writer: atomic (a temporary sibling swapped into place; an
  existing directory is replaced only if it is an earlier moejax output and `overwrite=True`);
  `check_output(path, overwrite=..., inputs=...)` refuses an output before anything is read.
- Converted models (an orbax checkpoint that training starts from): `convert_to_orbax(hf_dir,
  out)` and `convert_to_hf(converted, out, checkpoint=...)` (what `experiments/convert_hf.py`
  runs), built on `save_converted`, `read_converted`, `load_converted_params` (checksums
  verified) and `params_of_train_checkpoint` (a `moejax.training` checkpoint's parameters).
- Errors, one tree: `CheckpointError` (a `ValueError`) and its subclasses `MissingTensorError`
  (also a `KeyError`), `NonFiniteError`, `ConvertedDirError`; each names the tensor and the
  file, or the `config.json` field.

>>> import numpy as np
>>> from moejax.testing import random_params
>>> from moejax.interop import hf
>>> cfg, family = hf.moe_config_from_hf({"model_type": "qwen3_moe", "hidden_size": 8,
...     "moe_intermediate_size": 4, "num_experts": 4, "num_experts_per_tok": 2})
>>> params = random_params(cfg)  # or moejax.init_moe_params(cfg, key)
>>> tensors = hf.block_to_hf(params, cfg, family, "model.layers.0.mlp.", layout="per_expert")
>>> tensors["model.layers.0.mlp.experts.3.up_proj.weight"].shape
(4, 8)
>>> back = hf.block_from_hf(tensors, cfg, family, "model.layers.0.mlp.")
>>> bool(np.array_equal(back["experts"]["w_up"], params["experts"]["w_up"]))
True
"""

from moejax.interop.hf._block import block_from_hf as block_from_hf
from moejax.interop.hf._block import block_tensor_names as block_tensor_names
from moejax.interop.hf._block import block_tensor_shapes as block_tensor_shapes
from moejax.interop.hf._block import block_to_hf as block_to_hf
from moejax.interop.hf._block import detect_layout as detect_layout
from moejax.interop.hf._config import read_config as read_config
from moejax.interop.hf._converted import convert_to_hf as convert_to_hf
from moejax.interop.hf._converted import convert_to_orbax as convert_to_orbax
from moejax.interop.hf._converted import load_converted_params as load_converted_params
from moejax.interop.hf._converted import params_of_train_checkpoint as params_of_train_checkpoint
from moejax.interop.hf._converted import read_converted as read_converted
from moejax.interop.hf._converted import save_converted as save_converted
from moejax.interop.hf._errors import CheckpointError as CheckpointError
from moejax.interop.hf._errors import ConvertedDirError as ConvertedDirError
from moejax.interop.hf._errors import MissingTensorError as MissingTensorError
from moejax.interop.hf._errors import NonFiniteError as NonFiniteError
from moejax.interop.hf._families import FAMILIES as FAMILIES
from moejax.interop.hf._families import FLOAT_DTYPES as FLOAT_DTYPES
from moejax.interop.hf._families import LAYOUTS as LAYOUTS
from moejax.interop.hf._families import HFDecoder as HFDecoder
from moejax.interop.hf._families import HFFamily as HFFamily
from moejax.interop.hf._families import block_prefix as block_prefix
from moejax.interop.hf._lm_config import lm_config_from_hf as lm_config_from_hf
from moejax.interop.hf._model import load_hf_model as load_hf_model
from moejax.interop.hf._model import save_hf_model as save_hf_model
from moejax.interop.hf._moe_config import family_of as family_of
from moejax.interop.hf._moe_config import moe_config_from_hf as moe_config_from_hf
from moejax.interop.hf._moe_config import moe_config_to_hf as moe_config_to_hf
from moejax.interop.hf._outputs import check_output as check_output
from moejax.interop.hf._recipes import model_recipes as model_recipes
from moejax.interop.hf._recipes import tensor_names as tensor_names
from moejax.interop.hf._safetensors import SafetensorsCheckpoint as SafetensorsCheckpoint
from moejax.interop.hf._writer import CheckpointWriter as CheckpointWriter
from moejax.interop.hf._writer import save_safetensors as save_safetensors

__all__ = [
    "load_hf_model",
    "save_hf_model",
    "lm_config_from_hf",
    "model_recipes",
    "tensor_names",
    "FAMILIES",
    "FLOAT_DTYPES",
    "LAYOUTS",
    "CheckpointError",
    "CheckpointWriter",
    "ConvertedDirError",
    "HFDecoder",
    "HFFamily",
    "MissingTensorError",
    "NonFiniteError",
    "SafetensorsCheckpoint",
    "block_from_hf",
    "block_prefix",
    "block_tensor_names",
    "block_tensor_shapes",
    "block_to_hf",
    "check_output",
    "convert_to_hf",
    "convert_to_orbax",
    "detect_layout",
    "family_of",
    "load_converted_params",
    "moe_config_from_hf",
    "moe_config_to_hf",
    "params_of_train_checkpoint",
    "read_config",
    "read_converted",
    "save_converted",
    "save_safetensors",
]
