"""Routing and expert settings of published MoE families, as `MoEConfig` factories.

Each takes the sizes (and any field override) and fills in the family's routing and activation.
Model families differ by config fields only; the layer has no model-name branches.

>>> from moejax import presets
>>> presets.deepseek_v3(d_model=64, d_ff=32, num_experts=16, top_k=4).router
'sigmoid'
"""

from __future__ import annotations

from moejax._config import MoEConfig


def mixtral(**kw) -> MoEConfig:
    """Mixtral: softmax over all experts, top-2, renormalised; SwiGLU experts."""
    return MoEConfig(**{"top_k": 2, "router": "softmax", "norm_topk_prob": True, **kw})


def qwen3_moe(**kw) -> MoEConfig:
    """Qwen3-MoE (and OLMoE): softmax, top-k, `norm_topk_prob` per checkpoint (Qwen3: True)."""
    return MoEConfig(**{"top_k": 8, "router": "softmax", "norm_topk_prob": True, **kw})


def olmoe(**kw) -> MoEConfig:
    """OLMoE: softmax, top-8, not renormalised."""
    return MoEConfig(**{"top_k": 8, "router": "softmax", "norm_topk_prob": False, **kw})


def qwen2_moe(**kw) -> MoEConfig:
    """Qwen2-MoE: softmax top-k without renormalisation, one sigmoid-gated shared expert."""
    defaults = {
        "top_k": 4,
        "router": "softmax",
        "norm_topk_prob": False,
        "num_shared_experts": 1,
        "shared_gate": True,
    }
    return MoEConfig(**{**defaults, **kw})


def deepseek_v3(**kw) -> MoEConfig:
    """DeepSeek-V3: sigmoid scores, correction bias, group-limited top-k, scaling 2.5, 1 shared."""
    defaults = {
        "top_k": 8,
        "router": "sigmoid",
        "norm_topk_prob": True,
        "score_correction_bias": True,
        "num_groups": 8,
        "topk_groups": 4,
        "routed_scaling_factor": 2.5,
        "num_shared_experts": 1,
    }
    return MoEConfig(**{**defaults, **kw})


def gpt_oss(**kw) -> MoEConfig:
    """GPT-OSS: router with bias, top-k on logits then softmax, clamped SwiGLU with biases."""
    defaults = {
        "top_k": 4,
        "router": "topk_softmax",
        "router_bias": True,
        "activation": "clamped_swiglu",
        "expert_bias": True,
    }
    return MoEConfig(**{**defaults, **kw})


def switch(**kw) -> MoEConfig:
    """Switch Transformer: top-1 softmax, capacity per sequence, dropped tokens output zero."""
    defaults = {
        "top_k": 1,
        "router": "softmax",
        "norm_topk_prob": False,
        "dispatch": "capacity",
        "capacity_factor": 1.0,
        "activation": "relu",
    }
    return MoEConfig(**{**defaults, **kw})


def expert_choice(**kw) -> MoEConfig:
    """Expert choice (Zhou et al. 2022): each expert takes its top-C tokens."""
    return MoEConfig(**{"router": "expert_choice", "capacity_factor": 1.0, **kw})


PRESETS = {
    f.__name__: f
    for f in (mixtral, qwen3_moe, olmoe, qwen2_moe, deepseek_v3, gpt_oss, switch, expert_choice)
}
