"""A Hugging Face `config.json` of an MoE decoder -> `LMConfig` (+ the family's tensor naming).

Families differ by fields here, in one table (`FAMILIES`); the model's forward pass sees only
the resulting `LMConfig` (`qk_norm`, `attention_bias`, `rope_scaling`, `tie_embeddings`, ...).

| family (`model_type`) | MoE module | experts (per-expert names) | attention extras |
|---|---|---|---|
| `mixtral` | `block_sparse_moe` | `w1` gate, `w3` up, `w2` down | - |
| `qwen3_moe` | `mlp` | `gate_proj`, `up_proj`, `down_proj` | `qk_norm="head"`, optional biases |
| `olmoe` | `mlp` | `gate_proj`, `up_proj`, `down_proj` | `qk_norm="full"`, optional biases |
| `qwen2_moe` | `mlp` | `gate_proj`, `up_proj`, `down_proj` + shared expert | q/k/v biases |
"""

from __future__ import annotations

import dataclasses

from moejax._config import MoEConfig
from moejax.interop.hf._errors import CheckpointError
from moejax.interop.hf._safetensors import CONFIG_FILE as CONFIG_NAME
from moejax.models import LMConfig, RopeScaling


@dataclasses.dataclass(frozen=True)
class Family:
    """How one family names its tensors and which `LMConfig` options its config implies."""

    moe_module: str  # the MoE block's name inside a layer (per-expert layout)
    expert_names: tuple[str, str, str]  # gate, up, down projections of one expert
    qk_norm: str | None  # LMConfig.qk_norm
    qkv_bias: str | bool  # True, False, or the config key that says
    out_bias: str | bool
    shared_expert: bool  # Qwen2-MoE's sigmoid-gated shared expert


FAMILIES = {
    "mixtral": Family("block_sparse_moe", ("w1", "w3", "w2"), None, False, False, False),
    "qwen3_moe": Family(
        "mlp", ("gate_proj", "up_proj", "down_proj"), "head", "attention_bias", "attention_bias",
        False,
    ),
    "olmoe": Family(
        "mlp", ("gate_proj", "up_proj", "down_proj"), "full", "attention_bias", "attention_bias",
        False,
    ),
    "qwen2_moe": Family("mlp", ("gate_proj", "up_proj", "down_proj"), None, True, False, True),
}  # fmt: skip
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Fields that count or size something: ints >= 1 when present. Counts have a cap (far above any
# published model) so that no config.json can make moejax build a huge name list or tree
# before the tensors are checked against it; sizes are checked against the tensors' shapes.
_SIZE_FIELDS = (
    "hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size", "head_dim",
    "max_position_embeddings", "decoder_sparse_step", "num_experts_per_tok",
    "shared_expert_intermediate_size", "num_attention_heads", "num_key_value_heads",
)  # fmt: skip
COUNT_CAPS = {
    "num_hidden_layers": 4096,
    "num_experts": 65536,
    "num_local_experts": 65536,
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
            f"{CONFIG_NAME} is a JSON {type(config).__name__}, need an object of fields"
        )
    for key in (*_SIZE_FIELDS, *COUNT_CAPS):
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{CONFIG_NAME} {key}={value!r}: need an int >= 1")
        if value > COUNT_CAPS.get(key, value):
            raise CheckpointError(
                f"{CONFIG_NAME} {key}={value}: over moejax's cap of {COUNT_CAPS[key]} (no "
                "published model comes near it; a damaged or hostile config?)"
            )
    for key in ("rope_scaling", "rope_parameters", "quantization_config"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise CheckpointError(f"{CONFIG_NAME} {key}={config[key]!r}: need an object")


def family_of(config: dict) -> str:
    """The family key of `config` (its `model_type`), or a clear error."""
    kind = config.get("model_type")
    if kind not in FAMILIES:
        arch = config.get("architectures")
        raise CheckpointError(
            f"{CONFIG_NAME}: model_type={kind!r} (architectures={arch}) is not supported; "
            f"supported: {sorted(FAMILIES)}"
        )
    return kind


def _get(config: dict, key: str, default=None, *, required: bool = False):
    if key not in config or config[key] is None:
        if required and default is None:
            raise CheckpointError(f"{CONFIG_NAME}: {key!r} missing")
        return default
    return config[key]


def _flag(config: dict, spec) -> bool:
    return bool(config.get(spec, False)) if isinstance(spec, str) else spec


def _rope(config: dict) -> tuple[float, RopeScaling | None]:
    """`(rope_theta, RopeScaling or None)` from `rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in ROPE_TYPES:
        raise CheckpointError(
            f"{CONFIG_NAME}: rope_scaling type {kind!r} is not supported; supported: {ROPE_TYPES}"
        )
    if kind == "default":
        return theta, None
    keys = ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor")
    extra = {k: scaling[k] for k in (*keys, "mscale", "mscale_all_dim", "truncate") if k in scaling}
    original = scaling.get("original_max_position_embeddings")
    if kind == "yarn" and original is None:
        original = config.get("max_position_embeddings")
    try:
        return theta, RopeScaling(
            kind=kind,
            factor=float(scaling["factor"]),
            original_max_position_embeddings=original,
            **extra,
        )
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"{CONFIG_NAME}: rope_scaling {scaling}: {err}") from None


def moe_config_of(config: dict) -> MoEConfig:
    """The MoE layer of `config` (`moejax.interop.hf.moe_config_from_hf`, errors as
    `CheckpointError`)."""
    from moejax.interop.hf._config import moe_config_from_hf

    try:
        return moe_config_from_hf(config)[0]
    except CheckpointError:
        raise
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def lm_config_from_hf(config: dict, *, param_dtype: str = "float32") -> tuple[LMConfig, str]:
    """`(LMConfig, family)` of a Hugging Face MoE decoder config.

    Raises:
      CheckpointError: not a JSON object, a count or size that is not an int >= 1 or is over
        `COUNT_CAPS`, an unknown `model_type`, an activation other than SiLU, a layer pattern
        moejax cannot express (`mlp_only_layers`), `clip_qkv`, a rope type not in
        `ROPE_TYPES`, a missing field, or fields that do not fit together; each names the
        field.

    >>> cfg, family = lm_config_from_hf({"model_type": "olmoe", "vocab_size": 64,
    ...     "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2,
    ...     "tie_word_embeddings": True})
    >>> family, cfg.qk_norm, cfg.tie_embeddings, cfg.moe.num_experts, cfg.head_dim
    ('olmoe', 'full', True, 8, 8)
    """
    check_fields(config)
    try:
        return _from_fields(config, param_dtype)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as err:  # LMConfig's own checks: fields that do not fit
        raise CheckpointError(f"{CONFIG_NAME}: {err}") from None


def _from_fields(config: dict, param_dtype: str) -> tuple[LMConfig, str]:
    family = family_of(config)
    fam = FAMILIES[family]
    if config.get("hidden_act", "silu") != "silu":
        act = config["hidden_act"]
        raise CheckpointError(f"{CONFIG_NAME}: hidden_act={act!r}: only silu is supported")
    if config.get("mlp_only_layers"):
        raise CheckpointError(
            f"{CONFIG_NAME}: mlp_only_layers={config['mlp_only_layers']}: dense layers at "
            "arbitrary positions are not supported (decoder_sparse_step is)"
        )
    if config.get("clip_qkv") is not None:
        raise CheckpointError(f"{CONFIG_NAME}: clip_qkv={config['clip_qkv']}: not supported")
    if config.get("use_sliding_window"):
        raise CheckpointError(f"{CONFIG_NAME}: use_sliding_window=true: not supported")
    heads = _get(config, "num_attention_heads", required=True)
    d = _get(config, "hidden_size", required=True)
    head_dim = _get(config, "head_dim", d // heads)
    max_len = _get(config, "max_position_embeddings", 4096)
    if family == "mixtral" and config.get("sliding_window"):
        max_len = min(max_len, config["sliding_window"])  # exact up to the window
    theta, scaling = _rope(config)
    layers = _get(config, "num_hidden_layers", required=True)
    step = _get(config, "decoder_sparse_step", 1)
    moe = moe_config_of(config)
    cfg = LMConfig(
        vocab_size=_get(config, "vocab_size", required=True),
        d_model=d,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_get(config, "num_key_value_heads", heads),
        head_dim=head_dim,
        max_seq_len=max_len,
        moe=moe.replace(param_dtype=param_dtype),
        moe_every=step,
        dense_d_ff=config.get("intermediate_size") if step > 1 else None,
        rope_theta=theta,
        norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=fam.qk_norm,
        attention_bias=_flag(config, fam.qkv_bias),
        attention_out_bias=_flag(config, fam.out_bias),
        rope_scaling=scaling,
        param_dtype=param_dtype,
    )
    return cfg, family


def stored_dtype(config: dict) -> str | None:
    """The dtype name the checkpoint says its weights are stored in (`torch_dtype`, or `dtype`
    in transformers 5), e.g. "bfloat16"; None if it does not say."""
    return config.get("torch_dtype") or config.get("dtype")
