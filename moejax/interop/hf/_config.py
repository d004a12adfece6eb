"""Reading a Hugging Face `config.json`: the file, and the checks every reading starts with.

`read_config` reads the file (the safetensors reader's hardened JSON reading). `check_fields`
makes the count and size fields ints >= 1 within `COUNT_CAPS`, so nothing is sized from a hostile
file. What the fields mean is read by `moejax.interop.hf._moe_config` (one MoE block: a
`MoEConfig`) and `moejax.interop.hf._lm_config` (a whole decoder: an `LMConfig`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moejax.interop.hf._errors import CheckpointError
from moejax.interop.hf._safetensors import read_json

CONFIG_FILE = "config.json"
# Fields that count or size something: ints >= 1 when present. Counts have a cap (far above any
# published model) so that no config.json can make moejax build a huge name list or tree
# before the tensors are checked against it; sizes are checked against the tensors' shapes.
_SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "vocab_size",
    "head_dim",
    "max_position_embeddings",
    "decoder_sparse_step",
    "num_experts_per_tok",
    "shared_expert_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)  # fmt: skip (not sliding_window: transformers writes 0 where no layer slides)
COUNT_CAPS = {
    "num_hidden_layers": 4096,
    "num_experts": 65536,
    "num_local_experts": 65536,
    "n_routed_experts": 65536,
    "num_attention_heads": 65536,
    "num_key_value_heads": 65536,
    "vocab_size": 2**24,
    "hidden_size": 2**20,
}


def check_fields(config) -> None:
    """`config` is a JSON object whose count and size fields are ints >= 1 within
    `COUNT_CAPS`: CheckpointError naming the field otherwise (nothing is sized before)."""
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{CONFIG_FILE} is a JSON {type(config).__name__}, need an object of fields"
        )
    for key in (*_SIZE_FIELDS, *COUNT_CAPS):
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{CONFIG_FILE} {key}={value!r}: need an int >= 1")
        if value > COUNT_CAPS.get(key, value):
            raise CheckpointError(
                f"{CONFIG_FILE} {key}={value}: over moejax's cap of {COUNT_CAPS[key]} (no "
                "published model comes near it; a damaged or hostile config?)"
            )
    for key in ("rope_scaling", "rope_parameters", "quantization_config"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise CheckpointError(f"{CONFIG_FILE} {key}={config[key]!r}: need an object")


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of checkpoint directory `path` (or the file itself).

    Raises:
      CheckpointError: missing, not JSON, or not a JSON object.
    """
    file = Path(path)
    if not os.path.lexists(file):
        raise CheckpointError(
            f"no such file or directory (need a Hugging Face checkpoint directory or its "
            f"{CONFIG_FILE})",
            file=str(file),
        )
    if file.is_dir():
        file = file / CONFIG_FILE
    config = read_json(str(file), CONFIG_FILE)
    if not isinstance(config, dict):
        raise CheckpointError(
            f"is a JSON {type(config).__name__}, need an object of fields", file=str(file)
        )
    return config


def stored_dtype(config: Mapping[str, Any]) -> str | None:
    """The dtype name the checkpoint says its weights are stored in (`dtype` in transformers 5,
    `torch_dtype` before), e.g. "bfloat16"; None if it does not say."""
    return config.get("dtype") or config.get("torch_dtype")
