"""The one reader of a Hugging Face `config.json`: -> `MoEConfig` (one MoE block) or `LMConfig` (a
whole decoder); and `MoEConfig` -> the block's `config.json` fields.

`read_config` reads the file (the safetensors reader's hardened JSON reading). Every reading starts
with `check_fields`: the count and size fields are ints >= 1 within `COUNT_CAPS`, so nothing is
sized from a hostile file. `family_of` (from `model_type`, or `architectures` when it is absent)
then picks the family's field reader. A field moejax cannot honour is a `CheckpointError` naming
it, unless the caller lists it in `ignore` (e.g. `router_jitter_noise`, training-time noise that a
model loaded for inference never applies). Missing fields take transformers' defaults
(transformers 5.24 `configuration_<family>.py`), as `from_pretrained` would.

Whole decoders (`lm_config_from_hf`: the families with an `HFFamily.decoder`) add attention,
norms, rope and which layers are sparse; the model's forward pass sees only the resulting
`LMConfig`. What differs by family is its `HFDecoder`:

| family (`model_type`) | MoE module | experts (per-expert names) | attention extras |
|---|---|---|---|
| `mixtral` | `block_sparse_moe` | `w1` gate, `w3` up, `w2` down | - |
| `qwen3_moe` | `mlp` | `gate_proj`, `up_proj`, `down_proj` | `qk_norm="head"`, optional biases |
| `olmoe` | `mlp` | `gate_proj`, `up_proj`, `down_proj` | `qk_norm="full"`, optional biases |
| `qwen2_moe` | `mlp` | `gate_proj`, `up_proj`, `down_proj` + shared expert | q/k/v biases |
| `deepseek_v3` | `mlp` | `gate_proj`, `up_proj`, `down_proj` + shared experts | MLA, MTP layers |
| `gpt_oss` | `mlp` | fused only: interleaved `experts.gate_up_proj`, biases | sinks, windows |

An FP8 block-scaled checkpoint's `quantization_config` is accepted by `lm_config_from_hf` (the
model it describes is the dequantized one, `moejax.interop.hf._fp8`); fields in `UNIMPLEMENTED`
are refused first, whatever the family.
| `llama` | - (dense) | - | optional biases (`attention_bias`) |
| `qwen2` | - (dense) | - | q/k/v biases |
| `qwen3` | - (dense) | - | `qk_norm="head"`, optional biases |

The dense families (`HFFamily.dense`: Llama, Qwen2, Qwen3) read as an `LMConfig` whose
`mlp_layer_types` are all `"dense"` (SwiGLU MLPs of width `intermediate_size`); its `moe` is a
placeholder no layer uses (one expert of that width), and `moejax.models.upcycle` replaces it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from moejax import MoEConfig
from moejax.interop.hf._errors import CheckpointError
from moejax.interop.hf._families import FAMILIES, FLOAT_DTYPES, HFDecoder, block_family
from moejax.interop.hf._fp8 import fp8_block_size, without_quantization
from moejax.interop.hf._safetensors import read_json
from moejax.models import LMConfig, MLAConfig, RopeScaling, mlp_layer_types_of
from moejax.models._config import ATTENTION_KINDS

CONFIG_FILE = "config.json"
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
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


# Activations moejax computes exactly as transformers' ACT2FN does.
_GATED_ACT = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu_new": "geglu",
    "gelu_pytorch_tanh": "geglu",
}
_UNGATED_ACT = {"relu": "relu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}


class _Fields:
    """Reads one `config.json`; every refusal is a `CheckpointError` naming the field."""

    def __init__(self, config: Mapping[str, Any], family: str, ignore: Collection[str]):
        self.config, self.family, self.ignore = config, family, frozenset(ignore)
        self.source: dict[str, str] = {}  # MoEConfig field -> config.json field it came from

    def get(self, key: str | tuple[str, ...], default: Any = None, *, to: str | None = None):
        """`config[key]`, or `default` when absent or null; records `to` <- `key`.

        A tuple is one field under several names (transformers' `attribute_map` aliases, e.g.
        Qwen3-MoE's `num_experts` is saved as `num_local_experts`): the first present wins, and
        two present with different values are an error.
        """
        keys = (key,) if isinstance(key, str) else key
        present = {k: self.config[k] for k in keys if self.config.get(k) is not None}
        if len(set(map(repr, present.values()))) > 1:
            self.bad(" / ".join(present), tuple(present.values()), "aliases of one field differ")
        found = next(iter(present), keys[0])
        if to is not None:
            self.source[to] = found
        return present.get(found, default)

    def bad(self, key: str, value: Any, why: str):
        raise CheckpointError(f"{CONFIG_FILE} {key}={value!r}: {why} ({self.family})")

    def require(self, key: str, allowed: Collection, default: Any, why: str) -> Any:
        """`config[key]`, which must be in `allowed` unless `key` is ignored."""
        value = self.get(key, default)
        if value not in allowed and key not in self.ignore:
            self.bad(key, value, f"{why}; moejax honours {sorted(allowed, key=repr)}")
        return value


def _common(f: _Fields) -> dict[str, Any]:
    if "quantization_config" in f.config and "quantization_config" not in f.ignore:
        method = (f.config["quantization_config"] or {}).get("quant_method", "?")
        f.bad("quantization_config", method, "quantized checkpoints cannot be loaded; dequantize")
    dtype = stored_dtype(f.config) or "float32"
    if dtype not in FLOAT_DTYPES:
        f.bad("dtype", dtype, f"moejax parameters are one of {FLOAT_DTYPES}")
    f.source["param_dtype"] = "dtype"
    return {"param_dtype": dtype}


def _gated_activation(f: _Fields) -> str:
    act = f.require("hidden_act", _GATED_ACT, "silu", "the experts' activation")
    return _GATED_ACT.get(act, "swiglu")


def _no_jitter(f: _Fields, default: float) -> None:
    f.require(
        "router_jitter_noise",
        (0, 0.0),
        default,
        "moejax's router adds no jitter noise (transformers applies it in training only); pass "
        "ignore={'router_jitter_noise'} to load the model without it",
    )


def _softmax_topk(f: _Fields, d_ff: tuple, experts: tuple, k: int, norm, d_model: int = 2048):
    """Mixtral, Qwen2/3-MoE, OLMoE: softmax over E, top-k, renormalised when `norm` is True or
    names a true field. `d_ff`, `experts`: (config.json field, transformers' default)."""
    return {
        "d_model": f.get("hidden_size", d_model, to="d_model"),
        "d_ff": f.get(*d_ff, to="d_ff"),
        "num_experts": f.get(*experts, to="num_experts"),
        "top_k": f.get("num_experts_per_tok", k, to="top_k"),
        "router": "softmax",
        "norm_topk_prob": norm
        if isinstance(norm, bool)
        else f.get(norm, False, to="norm_topk_prob"),
        "activation": _gated_activation(f),
    }


def _mixtral(f: _Fields) -> dict:
    _no_jitter(f, 0.0)
    experts = ("num_local_experts", "num_experts")
    return _softmax_topk(f, ("intermediate_size", 14336), (experts, 8), 2, True, 4096)


def _qwen2_moe(f: _Fields) -> dict:
    kw = _softmax_topk(f, ("moe_intermediate_size", 1408), ("num_experts", 60), 4, "norm_topk_prob")
    shared = f.get("shared_expert_intermediate_size", 5632, to="shared_d_ff")
    return {**kw, "num_shared_experts": 1, "shared_d_ff": shared, "shared_gate": True}


def _qwen3_moe(f: _Fields) -> dict:
    experts = ("num_experts", "num_local_experts")
    return _softmax_topk(f, ("moe_intermediate_size", 768), (experts, 128), 8, "norm_topk_prob")


def _olmoe(f: _Fields) -> dict:
    experts = ("num_experts", "num_local_experts")
    return _softmax_topk(f, ("intermediate_size", 2048), (experts, 64), 8, "norm_topk_prob")


def _deepseek_v3(f: _Fields) -> dict:
    f.require("scoring_func", ("sigmoid",), "sigmoid", "the router's score function")
    f.require("topk_method", ("noaux_tc",), "noaux_tc", "the router's top-k method")
    shared = f.get("n_shared_experts", 1, to="num_shared_experts")
    if shared < 1 and "n_shared_experts" not in f.ignore:
        f.bad("n_shared_experts", shared, "a DeepSeek-V3 MoE block has >= 1 shared experts")
    return {
        "d_model": f.get("hidden_size", 7168, to="d_model"),
        "d_ff": f.get("moe_intermediate_size", 2048, to="d_ff"),
        "num_experts": f.get(("n_routed_experts", "num_local_experts"), 256, to="num_experts"),
        "top_k": f.get("num_experts_per_tok", 8, to="top_k"),
        "router": "sigmoid",
        "score_correction_bias": True,
        "num_groups": f.get("n_group", 8, to="num_groups"),
        "topk_groups": f.get("topk_group", 4, to="topk_groups"),
        "routed_scaling_factor": float(
            f.get("routed_scaling_factor", 2.5, to="routed_scaling_factor")
        ),
        "norm_topk_prob": f.get("norm_topk_prob", True, to="norm_topk_prob"),
        "num_shared_experts": shared,
        "activation": _gated_activation(f),
    }


def _gpt_oss(f: _Fields) -> dict:
    # GptOssExperts ignores hidden_act: its clamped SwiGLU is written out in the module.
    return {
        "d_model": f.get("hidden_size", 2880, to="d_model"),
        "d_ff": f.get("intermediate_size", 2880, to="d_ff"),
        "num_experts": f.get(("num_local_experts", "num_experts"), 128, to="num_experts"),
        "top_k": f.get(("num_experts_per_tok", "experts_per_token"), 4, to="top_k"),
        "router": "topk_softmax",
        "router_bias": True,
        "activation": "clamped_swiglu",
        "swiglu_limit": float(f.get("swiglu_limit", 7.0, to="swiglu_limit")),
        "swiglu_alpha": float(f.get("swiglu_alpha", 1.702, to="swiglu_alpha")),
        "expert_bias": True,
    }


def _switch(f: _Fields) -> dict:
    _no_jitter(f, 0.01)
    f.require("router_dtype", ("float32",), "float32", "the router's compute dtype")
    act = f.require("dense_act_fn", _UNGATED_ACT, "relu", "the experts' activation")
    return {
        "d_model": f.get(("d_model", "hidden_size"), 768, to="d_model"),
        "d_ff": f.get("d_ff", 2048, to="d_ff"),
        "num_experts": f.get("num_experts", 8, to="num_experts"),
        "top_k": 1,
        "router": "softmax",
        "norm_topk_prob": False,
        "router_bias": bool(f.get("router_bias", False, to="router_bias")),
        "drop_policy": "capacity",
        "capacity_factor": 1.0,  # unused: expert_capacity is set
        "expert_capacity": f.get("expert_capacity", 64, to="expert_capacity"),
        "activation": _UNGATED_ACT.get(act, "relu"),
    }


_READERS: dict[str, Callable[[_Fields], dict]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "switch": _switch,
}


def family_of(config: Mapping[str, Any]) -> str:
    """The family (a key of `FAMILIES`) of a `config.json`, from `model_type` (or `architectures`
    when it is absent).

    Raises:
      CheckpointError: naming the `model_type` / `architectures` value and the families moejax
        reads.

    >>> family_of({"model_type": "switch_transformers"})
    'switch'
    """
    if not isinstance(config, Mapping):
        raise CheckpointError(f"{CONFIG_FILE} is a JSON {type(config).__name__}, need an object")
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    by_type = {f.model_type: f for f in FAMILIES.values()}
    if model_type is not None:
        if model_type not in by_type:
            raise CheckpointError(
                f"{CONFIG_FILE} model_type={model_type!r}: not supported; moejax reads "
                f"model_type in {sorted(by_type)}"
            )
        fam = by_type[model_type]
        for arch in archs:
            if not str(arch).startswith(fam.architecture_prefix):
                raise CheckpointError(
                    f"{CONFIG_FILE} architectures={archs!r}: {arch!r} is not a "
                    f"{fam.architecture_prefix}* class, but model_type={model_type!r}"
                )
        return fam.name
    for fam in FAMILIES.values():
        if archs and all(str(a).startswith(fam.architecture_prefix) for a in archs):
            return fam.name
    raise CheckpointError(
        f"{CONFIG_FILE} architectures={archs!r} (no model_type): not supported; moejax reads "
        f"{sorted(f.architecture_prefix + '*' for f in FAMILIES.values())}"
    )


def moe_config_from_hf(
    config: Mapping[str, Any], *, ignore: Collection[str] = ()
) -> tuple[MoEConfig, str]:
    """The `MoEConfig` of the MoE blocks of a Hugging Face model, and its family name.

    Args:
      config: the parsed `config.json`.
      ignore: `config.json` fields whose value moejax cannot honour but the caller accepts to
        drop (e.g. `{"router_jitter_noise"}` to run a Switch or Mixtral model without jitter).

    Returns:
      `(MoEConfig, family)`, family a key of `moejax.interop.hf.FAMILIES`.

    Raises:
      CheckpointError (a ValueError): naming the `config.json` field moejax cannot honour (a
        count or size, an activation, a quantization, a router option), or an unknown
        `model_type` / `architectures`.

    >>> cfg, family = moe_config_from_hf({"model_type": "mixtral", "hidden_size": 16,
    ...     "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2})
    >>> family, cfg.d_ff, cfg.top_k, cfg.norm_topk_prob
    ('mixtral', 32, 2, True)
    """
    check_fields(config)
    family = family_of(config)
    if FAMILIES[family].dense:
        raise CheckpointError(
            f"{CONFIG_FILE} model_type={config.get('model_type', family)!r}: a dense model, "
            "without MoE blocks (load_hf_model / lm_config_from_hf read it whole)"
        )
    fields = _Fields(config, family, ignore)
    kw = {**_common(fields), **_READERS[family](fields)}
    try:
        return MoEConfig(**kw), family
    except (ValueError, TypeError) as err:  # name the config.json field behind the MoEConfig one
        field = str(err).split("=", 1)[0].removeprefix("MoEConfig.")
        key = fields.source.get(field)
        where = CONFIG_FILE if key is None else f"{CONFIG_FILE} {key}={config.get(key)!r}"
        raise CheckpointError(f"{where}: {err} ({family})") from None


# Fields of MoEConfig that a config.json does not carry (layer execution, not the model).
_NOT_IN_CONFIG = frozenset({"block_size", "init_scale", "router_dtype", "capacity_factor"})

_ACT_NAMES = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh", "relu": "relu", "gelu": "gelu_new"}


def moe_config_to_hf(cfg: MoEConfig, family: str) -> dict[str, Any]:
    """The `config.json` fields of `family` that describe MoE blocks equal to `cfg`.

    The whole-model writer adds the rest (attention, vocabulary, layers). Inverse of
    `moe_config_from_hf` on every field a checkpoint carries.

    Raises:
      ValueError: naming the `MoEConfig` field that `family` cannot express (e.g. Mixtral with
        `norm_topk_prob=False`, or a shared-expert width that is not one expert).
    """
    fam = block_family(family)
    out: dict[str, Any] = {"model_type": fam.model_type}
    for field, key in fam.config_keys.items():
        out[key] = getattr(cfg, field)
    if fam.name == "switch":
        out["dense_act_fn"] = _ACT_NAMES.get(cfg.activation, cfg.activation)
        out["router_jitter_noise"] = 0.0
    elif fam.name != "gpt_oss":
        out["hidden_act"] = _ACT_NAMES.get(cfg.activation, cfg.activation)
    if fam.name == "deepseek_v3":
        out.update(scoring_func="sigmoid", topk_method="noaux_tc")
    out["dtype"] = cfg.param_dtype
    try:
        back, _ = moe_config_from_hf(out)
    except ValueError as err:
        raise ValueError(f"MoEConfig cannot be written as {fam.name}: {err}") from err
    back = back.replace(**{f: getattr(cfg, f) for f in _NOT_IN_CONFIG})
    for field in dataclasses.fields(MoEConfig):
        mine, theirs = getattr(cfg, field.name), getattr(back, field.name)
        if mine != theirs and not (
            field.name == "shared_d_ff" and cfg.shared_width == back.shared_width
        ):
            raise ValueError(
                f"MoEConfig.{field.name}={mine!r}: a {fam.name} block has {field.name}={theirs!r}"
            )
    return out


def _get(config: dict, key: str, default=None, *, required: bool = False):
    if key not in config or config[key] is None:
        if required and default is None:
            raise CheckpointError(f"{CONFIG_FILE}: {key!r} missing")
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
            f"{CONFIG_FILE}: rope_scaling type {kind!r} is not supported; supported: {ROPE_TYPES}"
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
        raise CheckpointError(f"{CONFIG_FILE}: rope_scaling {scaling}: {err}") from None


def lm_config_from_hf(config: dict, *, param_dtype: str = "float32") -> tuple[LMConfig, str]:
    """`(LMConfig, family)` of a Hugging Face MoE decoder config, or of a dense one (Llama, Qwen2,
    Qwen3: every layer `"dense"`, module docstring).

    Dense and MoE layers come from any of the layer-pattern fields
    (`moejax.models.mlp_layer_types_of`: `mlp_layer_types`, `first_k_dense_replace`,
    `moe_layer_freq`, `mlp_only_layers`, `decoder_sparse_step`); attention from the family's
    `HFDecoder` and `layer_types` / `sliding_window`. DeepSeek-V3 (`deepseek_v3`, also Kimi K2
    and Moonlight) adds MLA (`q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
    `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`) and `num_nextn_predict_layers` MTP
    blocks (absent: none); GPT-OSS adds sinks and alternating sliding-window layers.

    Raises:
      CheckpointError: not a JSON object, a count or size that is not an int >= 1 or is over
        `COUNT_CAPS`, an unknown `model_type`, an activation other than SiLU, a field moejax
        does not implement (`UNIMPLEMENTED`: hash-routed layers, `sqrtsoftplus` scoring,
        `moe_apply_probs_on_input`, latent MoE; an unknown `layer_types` or `mlp_layer_types`
        entry, `first_k_dense_replace` beyond the layers), `clip_qkv`, a rope type not in
        `ROPE_TYPES`, a missing field, a dense model's `mlp_bias`, or fields that do not fit
        together; each names the field.

    >>> cfg, family = lm_config_from_hf({"model_type": "olmoe", "vocab_size": 64,
    ...     "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2,
    ...     "tie_word_embeddings": True})
    >>> family, cfg.qk_norm, cfg.tie_embeddings, cfg.moe.num_experts, cfg.head_dim
    ('olmoe', 'full', True, 8, 8)
    """
    check_fields(config)
    check_implemented(config)
    if fp8_block_size(config) is not None:  # FP8 block-scaled: load_hf_model dequantizes it
        config = without_quantization(config)
    try:
        return _from_fields(config, param_dtype)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as err:  # LMConfig's own checks: fields that do not fit
        raise CheckpointError(f"{CONFIG_FILE}: {err}") from None


def _is_hash(config) -> bool:
    types = config.get("mlp_layer_types")
    return isinstance(types, list | tuple) and any(str(t).startswith("hash") for t in types)


# Fields of published configs that change the model in ways moejax does not implement:
# (field, test of the config, what it would need). `check_implemented` names the first present.
UNIMPLEMENTED: tuple[tuple[str, Callable[[Mapping], bool], str], ...] = (
    (
        "mlp_layer_types", _is_hash,
        "hash-routed MoE layers (DeepSeek-V4 `hash_moe`: experts looked up from the token id, "
        "`tid2eid`) would need a router keyed by token ids",
    ),
    (
        "num_hash_layers", lambda c: bool(c.get("num_hash_layers")),
        "hash-routed MoE layers (DeepSeek-V4) would need a router keyed by token ids",
    ),
    (
        "scoring_func", lambda c: c.get("scoring_func") == "sqrtsoftplus",
        "sqrt(softplus(logits)) router scores (DeepSeek-V4) would need that score function in "
        "moejax's router (it has softmax and sigmoid)",
    ),
    (
        "moe_apply_probs_on_input", lambda c: bool(c.get("moe_apply_probs_on_input")),
        "Llama 4 scales each expert's input by its router probability; moejax scales the "
        "experts' outputs (would need the probabilities applied before the experts)",
    ),
    (
        "moe_latent_size", lambda c: c.get("moe_latent_size") is not None,
        "latent MoE (Nemotron-H: experts compute in a down-projected latent) would need latent "
        "projections around the experts",
    ),
    (
        "hc_mult", lambda c: c.get("hc_mult") not in (None, 1),
        "hyper-connections (DeepSeek-V4 mHC: several residual streams) would need a residual "
        "stream per copy",
    ),
)  # fmt: skip


def check_implemented(config: Mapping[str, Any]) -> None:
    """CheckpointError naming the first `UNIMPLEMENTED` field `config` sets, and what
    implementing it would need."""
    for key, present, need in UNIMPLEMENTED:
        if present(config):
            value = config[key]
            if isinstance(value, list) and len(value) > 4:
                value = [*value[:4], "..."]
            raise CheckpointError(f"{CONFIG_FILE} {key}={value!r}: not implemented; {need}")


def _with_defaults(config: dict, dec: HFDecoder) -> dict:
    """`config` with the family's decoder defaults for absent fields (rope: only when the
    config has neither `rope_scaling` nor `rope_parameters`, resp. no `rope_theta` in either;
    `first_k_dense_replace`: only without `mlp_layer_types`)."""
    out = dict(config)
    params = config.get("rope_parameters") or {}
    for key, value in dec.defaults.items():
        if key == "rope_scaling" and ("rope_scaling" in config or "rope_parameters" in config):
            continue
        if key == "rope_theta" and (config.get("rope_theta") or params.get("rope_theta")):
            continue
        if key == "first_k_dense_replace" and config.get("mlp_layer_types") is not None:
            continue  # the per-layer list says it all (the fields combine: a layer is MoE
            # only where every one present says so)
        if out.get(key) is None:
            out[key] = value(config) if callable(value) else value
    return out


def _attention_kinds(config: dict, layers: int) -> tuple[tuple | None, int | None]:
    """`(LMConfig.layer_types, sliding_window)` from `layer_types` (None when every layer
    attends to its whole past)."""
    kinds = config.get("layer_types")
    if kinds is None:
        return None, None
    if not isinstance(kinds, list | tuple) or len(kinds) != layers:
        raise CheckpointError(
            f"{CONFIG_FILE} layer_types={kinds!r}: need a list of num_hidden_layers={layers}"
        )
    if bad := sorted({k for k in kinds if k not in ATTENTION_KINDS}, key=str):
        raise CheckpointError(
            f"{CONFIG_FILE} layer_types: entries {bad} are not implemented (moejax has "
            f"{list(ATTENTION_KINDS)}); each would need its attention variant in moejax.models"
        )
    if "sliding_attention" not in kinds:
        return None, None
    window = config.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointError(
            f"{CONFIG_FILE} sliding_window={window!r}: layer_types has sliding_attention "
            "layers: need an int >= 1"
        )
    return tuple(kinds), window


def _mla(config: dict) -> MLAConfig:
    if config.get("attention_bias"):
        raise CheckpointError(
            f"{CONFIG_FILE} attention_bias=true: MLA with biased q_a_proj, kv_a_proj_with_mqa "
            "and o_proj is not implemented (would need those biases in moejax.models._mla)"
        )
    return MLAConfig(
        kv_lora_rank=_get(config, "kv_lora_rank", 512),
        qk_nope_head_dim=_get(config, "qk_nope_head_dim", 128),
        qk_rope_head_dim=_get(config, "qk_rope_head_dim", 64),
        v_head_dim=_get(config, "v_head_dim", 128),
        q_lora_rank=config.get("q_lora_rank", 1536),
        rope_interleave=bool(config.get("rope_interleave", True)),
    )


def _mtp_layers(config: dict) -> int:
    keys = ("num_nextn_predict_layers", "num_mtp_layers")
    values = {k: config[k] for k in keys if config.get(k) is not None}
    n = next(iter(values.values()), 0)
    if len(set(values.values())) > 1 or isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise CheckpointError(f"{CONFIG_FILE} {values}: need one int >= 0")
    return n


def _mlp_kinds(config: dict) -> tuple[str, ...]:
    try:
        return mlp_layer_types_of(config)
    except ValueError as err:
        raise CheckpointError(f"{CONFIG_FILE} {err}") from None


def _from_fields(config: dict, param_dtype: str) -> tuple[LMConfig, str]:
    family = family_of(config)
    dec = FAMILIES[family].decoder
    if dec is None:
        readers = sorted(name for name, fam in FAMILIES.items() if fam.decoder is not None)
        raise CheckpointError(
            f"{CONFIG_FILE} model_type={config.get('model_type')!r}: moejax reads the MoE blocks "
            f"of {family} models (block_from_hf), not whole ones; whole decoders: {readers}"
        )
    config = _with_defaults(config, dec)
    if config.get("hidden_act", "silu") != "silu":
        act = config["hidden_act"]
        raise CheckpointError(f"{CONFIG_FILE}: hidden_act={act!r}: only silu is supported")
    if config.get("clip_qkv") is not None:
        raise CheckpointError(f"{CONFIG_FILE}: clip_qkv={config['clip_qkv']}: not supported")
    if config.get("use_sliding_window"):
        raise CheckpointError(f"{CONFIG_FILE}: use_sliding_window=true: not supported")
    heads = _get(config, "num_attention_heads", required=True)
    d = _get(config, "hidden_size", required=True)
    head_dim = _get(config, "head_dim", d // heads)
    max_len = _get(config, "max_position_embeddings", 4096)
    if dec.window_caps_length and config.get("sliding_window"):
        max_len = min(max_len, config["sliding_window"])  # exact up to the window
    theta, scaling = _rope(config)
    layers = _get(config, "num_hidden_layers", required=True)
    kinds = _mlp_kinds(config)
    step = _get(config, "decoder_sparse_step", 1)
    legacy = kinds == tuple("moe" if (i + 1) % step == 0 else "dense" for i in range(layers))
    layer_types, window = _attention_kinds(config, layers)
    mla = _mla(config) if dec.mla else None
    kv_heads = _get(config, "num_key_value_heads", heads)
    if mla is not None:
        if kv_heads != heads:
            raise CheckpointError(
                f"{CONFIG_FILE} num_key_value_heads={kv_heads}: MLA has one key/value head per "
                f"query head (num_attention_heads={heads})"
            )
        head_dim = mla.qk_head_dim
    if FAMILIES[family].dense:
        moe, kinds = _dense_mlp(config, family, d, layers)
        legacy = False
    else:
        moe, _ = moe_config_from_hf(config)
    cfg = LMConfig(
        vocab_size=_get(config, "vocab_size", required=True),
        d_model=d,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_seq_len=max_len,
        moe=moe.replace(param_dtype=param_dtype),
        moe_every=step if legacy else 1,
        mlp_layer_types=None if legacy else kinds,
        dense_d_ff=config.get("intermediate_size") if "dense" in kinds else None,
        mtp_layers=_mtp_layers(config) if dec.mla else 0,
        rope_theta=theta,
        norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=dec.qk_norm,
        attention_bias=_flag(config, dec.qkv_bias),
        attention_out_bias=_flag(config, dec.out_bias),
        attention_sinks=dec.sinks,
        layer_types=layer_types,
        sliding_window=window,
        mla=mla,
        rope_scaling=scaling,
        param_dtype=param_dtype,
    )
    return cfg, family


def _dense_mlp(config: dict, family: str, d: int, layers: int) -> tuple[MoEConfig, tuple]:
    """A dense model's placeholder `MoEConfig` (one expert of the MLP's width, softmax top-1:
    no layer uses it) and its FFN kinds (every layer dense)."""
    fields = _Fields(config, family, ())
    _common(fields)  # quantization and dtype checks
    if config.get("mlp_bias"):
        fields.bad("mlp_bias", config["mlp_bias"], "MLP biases are not supported")
    d_ff = _get(config, "intermediate_size", required=True)
    moe = MoEConfig(d_model=d, d_ff=d_ff, num_experts=1, top_k=1, router="softmax")
    return moe, ("dense",) * layers
