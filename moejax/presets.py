"""Routing and expert settings of published MoE families, as `MoEConfig` factories.

Each takes the sizes (and any field override) and fills in the family's routing and activation.
Model families differ by config fields only; the layer has no model-name branches. A preset's
signature lists the fields it sets, with their values (`help(presets.deepseek_v3)`); every
other `MoEConfig` field (`d_model`, `d_ff`, `num_experts`, ...) passes through `**kw`.

>>> from moejax import presets
>>> presets.deepseek_v3(d_model=64, d_ff=32, num_experts=16, top_k=4).router
'sigmoid'
"""

from __future__ import annotations

import functools
import inspect

from moejax._config import MoEConfig


def _preset(**defaults):
    """Decorator: the preset returns `MoEConfig(**{**defaults, **kw})`; its signature shows
    `defaults` as keyword arguments (`help()` and IDEs list them) and `**kw` for the rest."""

    def wrap(fn):
        @functools.wraps(fn)
        def make(**kw) -> MoEConfig:
            return MoEConfig(**{**defaults, **kw})

        params = [
            inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v)
            for k, v in defaults.items()
        ]
        params.append(inspect.Parameter("kw", inspect.Parameter.VAR_KEYWORD))
        make.__signature__ = inspect.Signature(params, return_annotation=MoEConfig)
        return make

    return wrap


@_preset(top_k=2, router="softmax", norm_topk_prob=True)
def mixtral(**kw) -> MoEConfig:
    """Mixtral: softmax over all experts, top-2, renormalised; SwiGLU experts."""


@_preset(top_k=8, router="softmax", norm_topk_prob=True)
def qwen3_moe(**kw) -> MoEConfig:
    """Qwen3-MoE (and OLMoE): softmax, top-k, `norm_topk_prob` per checkpoint (Qwen3: True)."""


@_preset(top_k=8, router="softmax", norm_topk_prob=False)
def olmoe(**kw) -> MoEConfig:
    """OLMoE: softmax, top-8, not renormalised."""


@_preset(top_k=4, router="softmax", norm_topk_prob=False, num_shared_experts=1, shared_gate=True)
def qwen2_moe(**kw) -> MoEConfig:
    """Qwen2-MoE: softmax top-k without renormalisation, one sigmoid-gated shared expert."""


@_preset(
    top_k=6, router="softmax", norm_topk_prob=False, routed_scaling_factor=1.0, num_shared_experts=2
)
def deepseek_v2(**kw) -> MoEConfig:
    """DeepSeek-V2-Lite: softmax top-k without renormalisation ("greedy"), scaled, 2 shared."""


@_preset(
    top_k=8,
    router="sigmoid",
    norm_topk_prob=True,
    score_correction_bias=True,
    num_groups=8,
    topk_groups=4,
    routed_scaling_factor=2.5,
    num_shared_experts=1,
)
def deepseek_v3(**kw) -> MoEConfig:
    """DeepSeek-V3: sigmoid scores, correction bias, group-limited top-k, scaling 2.5, 1 shared."""


@_preset(
    top_k=8,
    router="sigmoid",
    norm_topk_prob=True,
    score_correction_bias=True,
    num_groups=1,
    topk_groups=1,
    routed_scaling_factor=1.0,
    num_shared_experts=0,
)
def minimax_m2(**kw) -> MoEConfig:
    """MiniMax-M2: sigmoid scores, correction bias, top-8 renormalised; no groups, no shared."""


@_preset(
    top_k=4, router="topk_softmax", router_bias=True, activation="clamped_swiglu", expert_bias=True
)
def gpt_oss(**kw) -> MoEConfig:
    """GPT-OSS: router with bias, top-k on logits then softmax, clamped SwiGLU with biases."""


@_preset(
    top_k=1,
    router="softmax",
    norm_topk_prob=False,
    drop_policy="capacity",
    capacity_factor=1.0,
    activation="relu",
)
def switch(**kw) -> MoEConfig:
    """Switch Transformer: top-1 softmax, capacity per sequence, dropped tokens output zero."""


@_preset(router="expert_choice", capacity_factor=1.0)
def expert_choice(**kw) -> MoEConfig:
    """Expert choice (Zhou et al. 2022): each expert takes its top-C tokens."""


PRESETS = {
    f.__name__: f
    for f in (
        mixtral,
        qwen3_moe,
        olmoe,
        qwen2_moe,
        deepseek_v2,
        deepseek_v3,
        minimax_m2,
        gpt_oss,
        switch,
        expert_choice,
    )  # fmt: skip
}
