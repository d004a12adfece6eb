"""A Hugging Face `config.json` -> `MoEConfig` (one MoE block), and `MoEConfig` -> the block's
`config.json` fields.

Every reading starts with `check_fields` (`moejax.interop.hf._config`). `family_of` (from
`model_type`, or `architectures` when it is absent) then picks the family's field reader. A field
moejax cannot honour is a `CheckpointError` naming it, unless the caller lists it in `ignore`
(e.g. `router_jitter_noise`, training-time noise that a model loaded for inference never
applies). Missing fields take transformers' defaults (transformers 5.24
`configuration_<family>.py`), as `from_pretrained` would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

from moejax import MoEConfig
from moejax.interop.hf._config import CONFIG_FILE, check_fields, stored_dtype
from moejax.interop.hf._errors import CheckpointError
from moejax.interop.hf._families import FAMILIES, FLOAT_DTYPES, block_family

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


# transformers' defaults of the sigmoid grouped routers' fields (`DeepseekV3Config`,
# `Glm4MoeConfig`, `Glm4MoeLiteConfig`): hidden_size, moe_intermediate_size, n_routed_experts,
# num_experts_per_tok, n_group, topk_group, routed_scaling_factor.
_GROUPED_DEFAULTS = {
    "deepseek_v3": (7168, 2048, 256, 8, 8, 4, 2.5),
    "glm4_moe": (4096, 1408, 128, 8, 1, 1, 1.0),
    "glm4_moe_lite": (2048, 1536, 64, 4, 1, 1, 1.8),
}


def _sigmoid_grouped(f: _Fields) -> dict:
    """DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash: sigmoid scores with the correction bias,
    group-limited top-k, renormalised and scaled, shared experts."""
    d, d_ff, experts, k, groups, topk_groups, scale = _GROUPED_DEFAULTS[f.family]
    f.require("scoring_func", ("sigmoid",), "sigmoid", "the router's score function")
    f.require("topk_method", ("noaux_tc",), "noaux_tc", "the router's top-k method")
    shared = f.get("n_shared_experts", 1, to="num_shared_experts")
    if shared < 1 and "n_shared_experts" not in f.ignore:
        f.bad("n_shared_experts", shared, "this family's MoE block has >= 1 shared experts")
    return {
        "d_model": f.get("hidden_size", d, to="d_model"),
        "d_ff": f.get("moe_intermediate_size", d_ff, to="d_ff"),
        "num_experts": f.get(("n_routed_experts", "num_local_experts"), experts, to="num_experts"),
        "top_k": f.get("num_experts_per_tok", k, to="top_k"),
        "router": "sigmoid",
        "score_correction_bias": True,
        "num_groups": f.get("n_group", groups, to="num_groups"),
        "topk_groups": f.get("topk_group", topk_groups, to="topk_groups"),
        "routed_scaling_factor": float(
            f.get("routed_scaling_factor", scale, to="routed_scaling_factor")
        ),
        "norm_topk_prob": f.get("norm_topk_prob", True, to="norm_topk_prob"),
        "num_shared_experts": shared,
        "activation": _gated_activation(f),
    }


def _deepseek_v2(f: _Fields) -> dict:
    """DeepSeek-V2-Lite: softmax over E, top-k, scaled; renormalised when `norm_topk_prob` (as
    DeepSeek's own code does; published configs say false, transformers never renormalises)."""
    f.require("scoring_func", ("softmax",), "softmax", "the router's score function")
    f.require(
        "topk_method", ("greedy",), "greedy",
        "the router's top-k method (group_limited_greedy, DeepSeek-V2's 236B models, scores a "
        "group by its best softmax probability; moejax's group-limited routing is DeepSeek-V3's "
        "sigmoid one, groups scored by their top-2 sum)",
    )  # fmt: skip
    if f.config.get("mlp_bias") and "mlp_bias" not in f.ignore:
        f.bad("mlp_bias", True, "moejax's experts and shared experts have no biases here")
    experts = ("n_routed_experts", "num_experts")
    kw = _softmax_topk(f, ("moe_intermediate_size", 1407), (experts, 64), 6, "norm_topk_prob", 4096)
    shared = f.get("n_shared_experts", 2, to="num_shared_experts")
    if shared < 1 and "n_shared_experts" not in f.ignore:
        f.bad("n_shared_experts", shared, "this family's MoE block has >= 1 shared experts")
    scale = float(f.get("routed_scaling_factor", 1.0, to="routed_scaling_factor"))
    return {**kw, "routed_scaling_factor": scale, "num_shared_experts": shared}


def _minimax_m2(f: _Fields) -> dict:
    """MiniMax-M2: sigmoid scores, the correction bias picks the top-k, the chosen scores
    renormalised (`MiniMaxM2TopKRouter`); no groups, no scaling, no shared expert."""
    _no_jitter(f, 0.0)
    f.require("scoring_func", ("sigmoid",), "sigmoid", "the router's score function")
    f.require(
        "use_routing_bias", (True,), True,
        "the correction bias added to the scores that choose the experts (transformers' "
        "MiniMaxM2SparseMoeBlock always has it)",
    )  # fmt: skip
    shared = f.get("shared_intermediate_size", 0)
    if shared and "shared_intermediate_size" not in f.ignore:
        f.bad("shared_intermediate_size", shared, "MiniMax-M2's MoE block has no shared expert")
    return {
        "d_model": f.get("hidden_size", 3072, to="d_model"),
        "d_ff": f.get("intermediate_size", 1536, to="d_ff"),
        "num_experts": f.get(("num_local_experts", "num_experts"), 256, to="num_experts"),
        "top_k": f.get("num_experts_per_tok", 8, to="top_k"),
        "router": "sigmoid",
        "score_correction_bias": True,
        "num_groups": 1,
        "topk_groups": 1,
        "norm_topk_prob": True,
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
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _sigmoid_grouped,
    "glm4_moe": _sigmoid_grouped,
    "glm4_moe_lite": _sigmoid_grouped,
    "minimax_m2": _minimax_m2,
    "gpt_oss": _gpt_oss,
    "switch": _switch,
}


def family_of(config: Mapping[str, Any]) -> str:
    """The family (a key of `FAMILIES`) of a `config.json`, from `model_type` (a family's own or
    one of its `aliases`; or `architectures` when it is absent).

    Raises:
      CheckpointError: naming the `model_type` / `architectures` value and the families moejax
        reads.

    >>> family_of({"model_type": "switch_transformers"})
    'switch'
    >>> family_of({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]})
    'deepseek_v3'
    """
    if not isinstance(config, Mapping):
        raise CheckpointError(f"{CONFIG_FILE} is a JSON {type(config).__name__}, need an object")
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    by_type = {t: f for f in FAMILIES.values() for t in (f.model_type, *f.aliases)}
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
    if fam.name == "minimax_m2":
        out.update(scoring_func="sigmoid", use_routing_bias=True)
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
