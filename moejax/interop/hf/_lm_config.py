"""A Hugging Face `config.json` -> `LMConfig` (a whole decoder).

Whole decoders (`lm_config_from_hf`: the families with an `HFFamily.decoder`) add attention,
norms, rope and which layers are sparse to the MoE block (`moejax.interop.hf._moe_config`); the
model's forward pass sees only the resulting `LMConfig`. What differs by family is its
`HFDecoder`:

| family (`model_type`) | MoE module | experts (per-expert names) | attention extras |
|---|---|---|---|
| `mixtral` | `block_sparse_moe` | `w1` gate, `w3` up, `w2` down | - |
| `qwen3_moe` | `mlp` | `gate_proj`, `up_proj`, `down_proj` | `qk_norm="head"`, optional biases |
| `olmoe` | `mlp` | `gate_proj`, `up_proj`, `down_proj` | `qk_norm="full"`, optional biases |
| `qwen2_moe` | `mlp` | `gate_proj`, `up_proj`, `down_proj` + shared expert | q/k/v biases |
| `deepseek_v3` | `mlp` | `gate_proj`, `up_proj`, `down_proj` + shared experts | MLA, MTP layers |
| `deepseek_v2` | `mlp` | `gate_proj`, `up_proj`, `down_proj` + shared experts | MLA |
| `glm4_moe` | `mlp` | `gate_proj`, `up_proj`, `down_proj` + shared experts | partial RoPE, MTP |
| `glm4_moe_lite` | `mlp` | `gate_proj`, `up_proj`, `down_proj` + shared experts | MLA, MTP layers |
| `minimax_m2` | `block_sparse_moe` | `w1`, `w3`, `w2` | `qk_norm="full"`, partial RoPE |
| `gpt_oss` | `mlp` | fused only: interleaved `experts.gate_up_proj`, biases | sinks, windows |
| `llama` | - (dense) | - | optional biases (`attention_bias`) |
| `qwen2` | - (dense) | - | q/k/v biases |
| `qwen3` | - (dense) | - | `qk_norm="head"`, optional biases |

GLM-4.5's attention has optional q/k/v biases (`attention_bias`), per-head q/k norms when
`use_qk_norm`, and RoPE over the first `partial_rotary_factor` (0.5) of each head. MiniMax-M2's
attention has q/k RMSNorms over all heads together and RoPE over the first `rotary_dim` features.

An FP8 block-scaled checkpoint's `quantization_config` is accepted by `lm_config_from_hf` (the
model it describes is the dequantized one, `moejax.interop.hf._fp8`); fields in `UNIMPLEMENTED`
are refused first, whatever the family.

The dense families (`HFFamily.dense`: Llama, Qwen2, Qwen3) read as an `LMConfig` whose
`mlp_layer_types` are all `"dense"` (SwiGLU MLPs of width `intermediate_size`); its `moe` is a
placeholder no layer uses (one expert of that width), and `moejax.models.upcycle` replaces it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from moejax import MoEConfig
from moejax.interop.hf._config import CONFIG_FILE, check_fields
from moejax.interop.hf._errors import CheckpointError
from moejax.interop.hf._families import FAMILIES, HFDecoder
from moejax.interop.hf._fp8 import fp8_block_size, without_quantization
from moejax.interop.hf._moe_config import _common, _Fields, family_of, moe_config_from_hf
from moejax.models import LMConfig, MLAConfig, RopeScaling, mlp_layer_types_of
from moejax.models._config import ATTENTION_KINDS

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    blocks (absent: none); DeepSeek-V2-Lite (`deepseek_v2`) the same MLA (a full-rank query
    when `q_lora_rank` is null) without MTP; GLM-4.5 (`glm4_moe`) DeepSeek-V3's MoE blocks and
    MTP blocks with grouped-query attention, `partial_rotary_factor` (default 0.5) and
    `use_qk_norm`; GLM-4.7-Flash (`glm4_moe_lite`) DeepSeek-V3's MLA, MoE and MTP blocks;
    MiniMax-M2 (`minimax_m2`) q/k norms over all heads and `rotary_dim`; GPT-OSS adds sinks and
    alternating sliding-window layers.

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
    _check_per_layer_lists(config)
    check_implemented(config)
    if fp8_block_size(config) is not None:  # FP8 block-scaled: load_hf_model dequantizes it
        config = without_quantization(config)
    try:
        return _from_fields(config, param_dtype)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as err:  # LMConfig's own checks: fields that do not fit
        raise CheckpointError(f"{CONFIG_FILE}: {err}") from None


def _check_per_layer_lists(config: Mapping[str, Any]) -> None:
    """CheckpointError unless MiniMax's `attn_type_list` (one attention kind per layer) is a
    list of `num_hidden_layers` integers: a longer or shorter one was taken as it was, its
    extra entries ignored or its missing layers assumed."""
    kinds = config.get("attn_type_list")
    if kinds is None:
        return
    layers = config.get("num_hidden_layers")
    ints = isinstance(kinds, list | tuple) and all(
        isinstance(k, int) and not isinstance(k, bool) for k in kinds
    )
    if not ints or len(kinds) != layers:
        shown = [*kinds[:4], "..."] if isinstance(kinds, list | tuple) and len(kinds) > 4 else kinds
        size = f"{len(kinds)} entries" if isinstance(kinds, list | tuple) else type(kinds).__name__
        raise CheckpointError(
            f"{CONFIG_FILE} attn_type_list={shown!r} ({size}): need one integer per layer, "
            f"num_hidden_layers={layers}"
        )


def _is_hash(config) -> bool:
    types = config.get("mlp_layer_types")
    return isinstance(types, list | tuple) and any(str(t).startswith("hash") for t in types)


_RESIDUAL_SCALES = tuple(
    f"layernorm_{where}_{ab}"
    for where in ("full_attention", "linear_attention", "mlp")
    for ab in ("alpha", "beta")
)


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
        "attn_type_list", lambda c: any(t != 1 for t in c.get("attn_type_list") or ()),
        "linear (lightning) attention layers (MiniMax-01's attn_type_list entries 0) would need "
        "that attention in moejax.models; MiniMax-M2's layers are all 1 (softmax attention)",
    ),
    *(
        (
            key, lambda c, key=key: c.get(key) not in (None, 1),
            "MiniMax-01's scaled residuals (layernorm_*_alpha / _beta other than 1) would need "
            "residual scales in moejax.models' decoder layer",
        )
        for key in _RESIDUAL_SCALES
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
        if key in ("rope_theta", "partial_rotary_factor") and (config.get(key) or params.get(key)):
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
        latent_norm_eps=1e-6,  # transformers' q_a_layernorm / kv_a_layernorm: RMSNorm's default
    )


def _partial_rotary(config: dict, head_dim: int) -> float:
    """`partial_rotary_factor` (transformers 4: top level; 5: in `rope_parameters`), or
    `rotary_dim / head_dim` (MiniMax-M2's `rotary_dim`); 1.0 when absent."""
    params = config.get("rope_parameters") or {}
    values = {
        where + "partial_rotary_factor": float(c["partial_rotary_factor"])
        for where, c in (("", config), ("rope_parameters.", params))
        if c.get("partial_rotary_factor") is not None
    }
    if (rotary_dim := config.get("rotary_dim")) is not None:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 1:
            raise CheckpointError(f"{CONFIG_FILE} rotary_dim={rotary_dim!r}: need an int >= 1")
        values["rotary_dim / head_dim"] = rotary_dim / head_dim
    if len(set(values.values())) > 1:
        raise CheckpointError(f"{CONFIG_FILE} partial_rotary_factor: {values} differ")
    return next(iter(values.values()), 1.0)


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
        mtp_layers=_mtp_layers(config) if dec.mtp else 0,
        rope_theta=theta,
        norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=dec.qk_norm if dec.qk_norm_flag is None or config.get(dec.qk_norm_flag) else None,
        attention_bias=_flag(config, dec.qkv_bias),
        attention_out_bias=_flag(config, dec.out_bias),
        attention_sinks=dec.sinks,
        layer_types=layer_types,
        sliding_window=window,
        mla=mla,
        rope_scaling=scaling,
        partial_rotary_factor=_partial_rotary(config, head_dim),
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
