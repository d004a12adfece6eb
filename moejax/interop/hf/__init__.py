"""Hugging Face MoE checkpoints <-> moejax layer parameters and `MoEConfig`.

Families (`FAMILIES`): `mixtral`, `qwen2_moe`, `qwen3_moe`, `olmoe`, `deepseek_v3`, `gpt_oss`,
`switch` (Switch Transformers). Block tensors come in two layouts: `"per_expert"` (one Linear per
expert, as published checkpoints store them) and `"fused"` (transformers 5's stacked
`experts.gate_up_proj` / `experts.down_proj`); `LAYOUTS` names both and `FAMILIES[name].layouts`
says which a family has. `FLOAT_DTYPES` are the tensor dtypes a block's parameters can have.

- `moe_config_from_hf(config)` -> `(MoEConfig, family)`; `moe_config_to_hf(cfg, family)`.
- `block_from_hf(tensors, cfg, family, prefix)` -> layer params; `block_to_hf(params, cfg,
  family, prefix, layout)` -> tensors; `block_tensor_names` / `block_tensor_shapes` list what a
  block has; `detect_layout` tells which layout a checkpoint uses; `block_prefix` gives a layer's
  prefix in a whole decoder-only checkpoint.
- `SafetensorsCheckpoint(path)`: the package's one safetensors reader, a lazy Mapping over a
  checkpoint directory (sharded or not) that validates every header and index on opening and
  refuses NaN/Inf weights (`NonFiniteError`) unless `allow_nonfinite=True`;
  `CheckpointWriter` / `save_safetensors`: atomic writing (a temporary sibling swapped into
  place; an existing directory is replaced only if it is an earlier moejax output and
  `overwrite=True`);
  `read_config(path)`.
- Whole decoders (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE): `lm_config_from_hf(config)` ->
  `LMConfig`; `load_hf_model(path, mesh=...)` streams a checkpoint directory onto a mesh;
  `save_hf_model(path, params, cfg, hf_config)` writes one back (sharded, atomic);
  `model_recipes` / `tensor_names` list the tensors a model has.
- Errors: `CheckpointError` (a `ValueError`) and `MissingTensorError` (also a `KeyError`) name
  the tensor and the file.

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

from moejax.interop.hf._block import FLOAT_DTYPES as FLOAT_DTYPES
from moejax.interop.hf._block import block_from_hf as block_from_hf
from moejax.interop.hf._block import block_tensor_names as block_tensor_names
from moejax.interop.hf._block import block_tensor_shapes as block_tensor_shapes
from moejax.interop.hf._block import block_to_hf as block_to_hf
from moejax.interop.hf._block import detect_layout as detect_layout
from moejax.interop.hf._config import family_of as family_of
from moejax.interop.hf._config import moe_config_from_hf as moe_config_from_hf
from moejax.interop.hf._config import moe_config_to_hf as moe_config_to_hf
from moejax.interop.hf._errors import CheckpointError as CheckpointError
from moejax.interop.hf._errors import MissingTensorError as MissingTensorError
from moejax.interop.hf._families import FAMILIES as FAMILIES
from moejax.interop.hf._families import LAYOUTS as LAYOUTS
from moejax.interop.hf._families import HFFamily as HFFamily
from moejax.interop.hf._families import block_prefix as block_prefix
from moejax.interop.hf._model import load_hf_model as load_hf_model
from moejax.interop.hf._model import model_recipes as model_recipes
from moejax.interop.hf._model import save_hf_model as save_hf_model
from moejax.interop.hf._model import tensor_names as tensor_names
from moejax.interop.hf._model_config import lm_config_from_hf as lm_config_from_hf
from moejax.interop.hf._safetensors import NonFiniteError as NonFiniteError
from moejax.interop.hf._safetensors import SafetensorsCheckpoint as SafetensorsCheckpoint
from moejax.interop.hf._safetensors import read_config as read_config
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
    "HFFamily",
    "MissingTensorError",
    "NonFiniteError",
    "SafetensorsCheckpoint",
    "block_from_hf",
    "block_prefix",
    "block_tensor_names",
    "block_tensor_shapes",
    "block_to_hf",
    "detect_layout",
    "family_of",
    "moe_config_from_hf",
    "moe_config_to_hf",
    "read_config",
    "save_safetensors",
]
