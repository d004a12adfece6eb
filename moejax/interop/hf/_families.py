"""The Hugging Face MoE families moejax reads, in one table (`FAMILIES`): how each names its MoE
block's tensors, which `MoEConfig` features a block can carry, and, for the families whose whole
decoders moejax loads (`HFFamily.decoder`), what their `config.json` implies for attention. The
table also holds the dense decoders moejax loads whole (Llama, Qwen2, Qwen3: `HFFamily.dense`, no
MoE block), as all-dense `LMConfig`s that `moejax.models.upcycle` turns into MoE models.

Names are local to the block module (the caller adds the block's prefix, e.g.
`model.layers.3.mlp.`). Two layouts exist:

- `"per_expert"`: one Linear per expert and projection, as published checkpoints store them
  (`experts.{i}.w1.weight [F, D]`, ...) and as transformers 5 `save_pretrained` writes them.
- `"fused"`: the stacked 3-D parameters of transformers 5 modules: `experts.gate_up_proj
  [E, 2F, D]` (gate rows then up rows) and `experts.down_proj [E, D, F]`; GPT-OSS's
  `experts.gate_up_proj [E, D, 2F]` with gate at even and up at odd columns, plus biases.

Shape letters: `E` experts, `D` d_model, `F` d_ff of one expert, `Fs` shared-expert width.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Layout = Literal["fused", "per_expert"]
LAYOUTS: tuple[str, ...] = Layout.__args__
# Tensor dtypes a moejax parameter can hold (safetensors F32, BF16, F16, F64).
FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class HFDecoder:
    """The whole-decoder facts of a family whose models `load_hf_model` reads: the `LMConfig`
    options its `config.json` implies (the rest of the decoder is the same in every family).

    Attributes:
      qk_norm: `LMConfig.qk_norm` (`"head"`: one RMSNorm per head, `"full"`: over all heads).
      qk_norm_flag: None (`qk_norm` always), or the `config.json` field that turns `qk_norm`
        on (GLM-4.5's `use_qk_norm`).
      qkv_bias: q/k/v projection biases: True, False, or the `config.json` field that says.
      out_bias: the output projection's bias, likewise.
      window_caps_length: `config.json` `sliding_window`, when set, caps `LMConfig.max_seq_len`
        (Mixtral: full attention equals the windowed one up to the window).
      mla: multi-head latent attention (`LMConfig.mla`, DeepSeek-V3).
      mtp: `num_nextn_predict_layers` multi-token-prediction layers stored as
        `model.layers.{num_hidden_layers + k}` (DeepSeek-V3, GLM-4.5).
      sinks: attention sinks (`LMConfig.attention_sinks`, GPT-OSS `self_attn.sinks`).
      defaults: transformers' defaults of decoder fields where they differ from the common
        ones (`rope_theta` 10000, no rope scaling, no biases), applied to absent fields (a
        callable: of the config).
    """

    qk_norm: Literal["head", "full"] | None
    qkv_bias: str | bool
    out_bias: str | bool
    window_caps_length: bool = False
    mla: bool = False
    mtp: bool = False
    sinks: bool = False
    qk_norm_flag: str | None = None
    defaults: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """How one family names its MoE block's tensors, and which moejax features it can carry.

    Attributes:
      name: moejax's name of the family (the `family` argument everywhere).
      model_type: `config.json` `model_type`.
      architecture_prefix: `config.json` `architectures[0]` starts with it.
      router: the router Linear (`{router}.weight [E, D]`, `{router}.bias [E]`); None for a
        dense family (no MoE block: `dense`).
      correction_bias: DeepSeek-V3's `e_score_correction_bias [E]` buffer, or None.
      expert_pattern: per-expert Linear name, formatted with `i` and `proj`; None when the family
        has no per-expert layout.
      projections: per-expert `(gate, up, down)` Linear names (gate None when ungated).
      fused: `"chunked"` (`gate_up_proj [E, 2F, D]`), `"interleaved"` (GPT-OSS, `[E, D, 2F]` with
        biases) or None when the family has no fused layout.
      shared: the shared-expert MLP module (`gate_proj`, `up_proj`, `down_proj`), or None.
      shared_gate: Qwen2-MoE's `shared_expert_gate` Linear `[1, D]`, or None.
      features: for each tree-shaping `MoEConfig` property, the values the layout can carry.
      prefix: the block's prefix in a whole decoder-only model, per layout, with `{layer}`.
      config_keys: `MoEConfig` field -> the `config.json` field that carries it
        (`moe_config_to_hf` writes these; reading also accepts transformers' aliases).
      decoder: the whole-decoder facts (`HFDecoder`), or None when moejax reads only this
        family's MoE blocks.
      aliases: other `model_type`s of checkpoints that are this family's models (Kimi K2's
        `kimi_k2`: DeepSeek-V3's architecture, renamed so that inference engines can tell the
        two apart). Read as the family; `moe_config_to_hf` writes `model_type`.
    """

    name: str
    model_type: str
    architecture_prefix: str
    router: str | None
    correction_bias: str | None
    expert_pattern: str | None
    projections: tuple[str | None, str, str] | None
    fused: Literal["chunked", "interleaved"] | None
    shared: str | None
    shared_gate: str | None
    features: dict[str, frozenset]
    prefix: dict[str, str]
    config_keys: dict[str, str]
    decoder: HFDecoder | None = None
    aliases: tuple[str, ...] = ()

    @property
    def dense(self) -> bool:
        """A dense decoder family: its models have no MoE block (every MLP dense)."""
        return self.router is None

    @property
    def layouts(self) -> tuple[str, ...]:
        """The layouts this family's checkpoints come in."""
        have = {"per_expert": self.expert_pattern is not None, "fused": self.fused is not None}
        return tuple(layout for layout in LAYOUTS if have[layout])


_NO, _YES, _ANY = frozenset({False}), frozenset({True}), frozenset({False, True})


def _features(**overrides) -> dict[str, frozenset]:
    base = {
        "router_bias": _NO,
        "score_correction_bias": _NO,
        "expert_bias": _NO,
        "gated": _YES,
        "shared": _NO,
        "shared_gate": _NO,
    }
    return {**base, **overrides}


_DECODER = "model.layers.{layer}.mlp."


def _family(
    name: str, architecture_prefix: str, d_ff: str, experts: str, keys=None, **fields
) -> HFFamily:
    """An `HFFamily` with the fields most families share: a `gate` router, per-expert
    `experts.{i}.{gate,up,down}_proj` and chunked fused tensors, both in the decoder's `mlp.`,
    `config_keys` `hidden_size`, `d_ff`, `experts`, `num_experts_per_tok`, then `keys`."""
    base = dict(
        model_type=name,
        router="gate",
        correction_bias=None,
        expert_pattern="experts.{i}.{proj}.weight",
        projections=("gate_proj", "up_proj", "down_proj"),
        fused="chunked",
        shared=None,
        shared_gate=None,
        features=_features(),
        prefix={"per_expert": _DECODER, "fused": _DECODER},
    )
    config_keys = {"d_model": "hidden_size", "d_ff": d_ff, "num_experts": experts}
    config_keys.update(top_k="num_experts_per_tok", **(keys or {}))
    fields = {**base, "config_keys": config_keys, **fields}
    return HFFamily(name, architecture_prefix=architecture_prefix, **fields)


def _dense(name: str, architecture_prefix: str, decoder: HFDecoder) -> HFFamily:
    """A dense decoder family: no MoE block fields, only its whole-decoder facts."""
    return HFFamily(
        name, name, architecture_prefix, router=None, correction_bias=None, expert_pattern=None,
        projections=None, fused=None, shared=None, shared_gate=None, features={}, prefix={},
        config_keys={}, decoder=decoder,
    )  # fmt: skip


_NORM = {"norm_topk_prob": "norm_topk_prob"}


# DeepSeek-V3's MoE block (GLM-4.5's and GLM-4.7-Flash's too): the sigmoid grouped router's
# fields, its correction bias, shared experts.
_SIGMOID_GROUPED = dict(
    keys={
        "num_groups": "n_group",
        "topk_groups": "topk_group",
        "routed_scaling_factor": "routed_scaling_factor",
        **_NORM,
        "num_shared_experts": "n_shared_experts",
    },
    correction_bias="gate.e_score_correction_bias",
    shared="shared_experts",
    features=_features(score_correction_bias=_YES, shared=_YES),
)


def _alternating_windows(config: dict) -> list[str]:
    """GPT-OSS's `layer_types` when absent: sliding at even layers, full at odd ones."""
    n = config.get("num_hidden_layers") or 0
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


FAMILIES: dict[str, HFFamily] = {
    f.name: f
    for f in (
        _family(
            "mixtral",
            "Mixtral",
            "intermediate_size",
            "num_local_experts",
            projections=("w1", "w3", "w2"),
            # transformers 5 renames block_sparse_moe to mlp when it fuses the experts.
            prefix={"per_expert": "model.layers.{layer}.block_sparse_moe.", "fused": _DECODER},
            decoder=HFDecoder(None, False, False, window_caps_length=True),
        ),
        _family(
            "qwen2_moe",
            "Qwen2Moe",
            "moe_intermediate_size",
            "num_experts",
            {**_NORM, "shared_width": "shared_expert_intermediate_size"},
            shared="shared_expert",
            shared_gate="shared_expert_gate",
            features=_features(shared=_YES, shared_gate=_YES),
            decoder=HFDecoder(None, True, False),
        ),
        _family(
            "qwen3_moe",
            "Qwen3Moe",
            "moe_intermediate_size",
            "num_experts",
            _NORM,
            decoder=HFDecoder("head", "attention_bias", "attention_bias"),
        ),
        _family(
            "olmoe",
            "Olmoe",
            "intermediate_size",
            "num_experts",
            _NORM,
            decoder=HFDecoder("full", "attention_bias", "attention_bias"),
        ),
        _family(
            "deepseek_v3",
            "DeepseekV3For",  # not DeepseekV32*
            "moe_intermediate_size",
            "n_routed_experts",
            **_SIGMOID_GROUPED,
            decoder=HFDecoder(
                None, False, False, mla=True, mtp=True, defaults={"first_k_dense_replace": 3}
            ),
            aliases=("kimi_k2",),  # Kimi K2 (architectures DeepseekV3ForCausalLM)
        ),
        # DeepSeek-V2-Lite (and Coder-V2-Lite): MLA (rope interleaved, a full-rank query when
        # q_lora_rank is null), softmax routing without groups ("greedy"), shared experts.
        _family(
            "deepseek_v2",
            "DeepseekV2",
            "moe_intermediate_size",
            "n_routed_experts",
            {
                "routed_scaling_factor": "routed_scaling_factor",
                **_NORM,
                "num_shared_experts": "n_shared_experts",
            },
            shared="shared_experts",
            features=_features(shared=_YES),
            decoder=HFDecoder(None, False, False, mla=True, defaults={"first_k_dense_replace": 0}),
        ),
        # GLM-4.5/4.6/4.7: DeepSeek-V3's MoE blocks and MTP layers, grouped-query attention
        # with q/k/v biases, optional per-head q/k norms, RoPE over half of each head.
        _family(
            "glm4_moe",
            "Glm4MoeFor",  # not Glm4MoeLite*
            "moe_intermediate_size",
            "n_routed_experts",
            **_SIGMOID_GROUPED,
            decoder=HFDecoder(
                "head",
                "attention_bias",
                False,
                mtp=True,
                qk_norm_flag="use_qk_norm",
                defaults={
                    "first_k_dense_replace": 1,
                    "partial_rotary_factor": 0.5,
                    "rms_norm_eps": 1e-5,
                },
            ),
        ),
        # GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's MLA attention, MoE blocks and MTP layers
        # with GLM's defaults (one dense first layer, one group).
        _family(
            "glm4_moe_lite",
            "Glm4MoeLiteFor",
            "moe_intermediate_size",
            "n_routed_experts",
            **_SIGMOID_GROUPED,
            decoder=HFDecoder(
                None,
                False,
                False,
                mla=True,
                mtp=True,
                defaults={"first_k_dense_replace": 1, "rms_norm_eps": 1e-5},
            ),
        ),
        # MiniMax-M2 (M2.1, M2.5): Mixtral's module and tensor names, a sigmoid router with
        # DeepSeek-V3's correction bias (stored beside the gate) but no groups, no scaling and
        # no shared experts; grouped-query attention with q/k RMSNorm over all heads, RoPE over
        # the first `rotary_dim` features of each head.
        _family(
            "minimax_m2",
            "MiniMaxM2",
            "intermediate_size",
            "num_local_experts",
            projections=("w1", "w3", "w2"),
            correction_bias="e_score_correction_bias",
            features=_features(score_correction_bias=_YES),
            prefix={"per_expert": "model.layers.{layer}.block_sparse_moe.", "fused": _DECODER},
            decoder=HFDecoder("full", False, False, defaults={"rope_theta": 5e6, "head_dim": 128}),
        ),
        _family(
            "gpt_oss",
            "GptOss",
            "intermediate_size",
            "num_local_experts",
            {"swiglu_limit": "swiglu_limit", "swiglu_alpha": "swiglu_alpha"},
            router="router",
            expert_pattern=None,  # GPT-OSS checkpoints store only the fused tensors
            projections=None,
            fused="interleaved",
            features=_features(router_bias=_YES, expert_bias=_YES),
            prefix={"fused": _DECODER},
            decoder=HFDecoder(
                None,
                "attention_bias",
                "attention_bias",
                sinks=True,
                defaults={
                    "attention_bias": True,
                    "rope_theta": 150000.0,
                    "rope_scaling": {
                        "rope_type": "yarn",
                        "factor": 32.0,
                        "beta_fast": 32.0,
                        "beta_slow": 1.0,
                        "truncate": False,
                        "original_max_position_embeddings": 4096,
                    },  # fmt: skip
                    "sliding_window": 128,
                    "layer_types": _alternating_windows,
                    "head_dim": 64,
                    "rms_norm_eps": 1e-5,
                },
            ),
        ),
        _family(
            "switch",
            "SwitchTransformers",
            "d_ff",
            "num_experts",
            model_type="switch_transformers",
            config_keys={
                "d_model": "d_model",
                "d_ff": "d_ff",
                "num_experts": "num_experts",
                "expert_capacity": "expert_capacity",
                "router_bias": "router_bias",
            },
            router="router.classifier",
            expert_pattern="experts.expert_{i}.{proj}.weight",
            projections=(None, "wi", "wo"),
            fused=None,
            features=_features(router_bias=_ANY, gated=_NO),
            prefix={},  # encoder-decoder: `encoder.block.{i}.layer.1.mlp.`, decoder `layer.2`
        ),
        # Dense decoders (upcycling sources). Prefixes end in "For" so that Qwen2MoeFor* and
        # Llama4For* do not read as Qwen2 and Llama.
        _dense("llama", "LlamaFor", HFDecoder(None, "attention_bias", "attention_bias")),
        _dense("qwen2", "Qwen2For", HFDecoder(None, True, False)),
        # Qwen3Config's head_dim default is 128, not hidden // heads as elsewhere
        _dense(
            "qwen3",
            "Qwen3For",
            HFDecoder("head", "attention_bias", "attention_bias", defaults={"head_dim": 128}),
        ),
    )
}


def get_family(family: str) -> HFFamily:
    """The `HFFamily` record named `family`; a `ValueError` naming the known ones otherwise."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(f"family={family!r}: not one of {tuple(FAMILIES)}") from None


def block_family(family: str) -> HFFamily:
    """The `HFFamily` named `family`, which must have MoE blocks (`ValueError` otherwise)."""
    fam = get_family(family)
    if fam.dense:
        raise ValueError(
            f"family={family!r}: a dense decoder family, without MoE blocks (load_hf_model reads "
            "its whole models; moejax.models.upcycle makes MoE models of them)"
        )
    return fam


def check_layout(fam: HFFamily, layout: str) -> None:
    """Raise a `ValueError` unless `fam` has checkpoints in `layout`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: must be one of {LAYOUTS}")
    if layout not in fam.layouts:
        raise ValueError(
            f"layout={layout!r}: {fam.name} checkpoints come only in the {fam.layouts} layout"
        )


def block_prefix(family: str, layer: int, layout: str = "fused") -> str:
    """The prefix of layer `layer`'s MoE block in a whole decoder-only checkpoint.

    >>> block_prefix("mixtral", 3, "per_expert")
    'model.layers.3.block_sparse_moe.'
    """
    fam = block_family(family)
    check_layout(fam, layout)
    if layout not in fam.prefix:
        raise ValueError(
            f"family={family!r}: its MoE blocks sit in an encoder and a decoder; give the prefix"
        )
    return fam.prefix[layout].format(layer=layer)
