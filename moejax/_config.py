"""`MoEConfig`: the one frozen, validated description of an MoE layer.

Shape letters (see docs/design.md): `T` tokens, `D` d_model, `F` d_ff of one expert, `E` experts,
`K` top-k, `Fs` d_ff of the shared-expert MLP.

Model families differ by fields, never by name branches. Ready-made settings for the published
families live in `moejax.presets`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

RouterKind = Literal["softmax", "sigmoid", "topk_softmax", "expert_choice"]
Activation = Literal["swiglu", "geglu", "gelu", "relu", "clamped_swiglu"]
DropPolicy = Literal["dropless", "capacity"]
ExpertPrecision = Literal["bf16", "fp8"]
Fp8Format = Literal["e4m3", "e5m2"]

ROUTER_KINDS: tuple[str, ...] = RouterKind.__args__
ACTIVATIONS: tuple[str, ...] = Activation.__args__
DROP_POLICIES: tuple[str, ...] = DropPolicy.__args__
EXPERT_PRECISIONS: tuple[str, ...] = ExpertPrecision.__args__
FP8_FORMATS: tuple[str, ...] = Fp8Format.__args__
GATED_ACTIVATIONS = frozenset({"swiglu", "geglu", "clamped_swiglu"})
_BOOL_FIELDS = (
    "norm_topk_prob",
    "router_bias",
    "score_correction_bias",
    "expert_bias",
    "shared_gate",
)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """An MoE feed-forward layer. Frozen and validated at construction.

    Args:
      d_model: `D`, width of the token vectors.
      d_ff: `F`, hidden width of one routed expert.
      num_experts: `E`, routed experts.
      top_k: `K`, experts per token (token-choice routers). For `expert_choice` it sets the
        expert capacity: each expert takes `capacity_factor * T * top_k / E` tokens.
      router: how experts are chosen and weighted.
        - `"softmax"`: softmax over all E logits, then top-k; `norm_topk_prob` renormalises the k
          weights (Mixtral: always; OLMoE, Qwen2-MoE, Qwen3-MoE: a flag). Switch Transformer is this
          with `top_k=1` and `drop_policy="capacity"`.
        - `"sigmoid"`: sigmoid scores; choice on scores + `score_correction_bias` (aux-loss-free
          balancing), weights from the unbiased scores; optional group-limited choice
          (`num_groups`, `topk_groups`); `norm_topk_prob`; `routed_scaling_factor` (DeepSeek-V3).
        - `"topk_softmax"`: top-k on the logits (router has a bias), softmax over those k (GPT-OSS).
        - `"expert_choice"`: each expert takes its top-C tokens by softmax score (Zhou et al. 2022).
      norm_topk_prob: renormalise the k chosen weights to sum to one.
      router_bias: the router projection has a bias `router/bias [E]`.
      score_correction_bias: keep `router/score_correction_bias [E]` (sigmoid router only), added
        to the scores for choosing experts only, updated outside the optimizer by
        `moejax.update_correction_bias`.
      num_groups: expert groups for group-limited routing (sigmoid router); 1 = off.
      topk_groups: groups kept per token (<= num_groups).
      routed_scaling_factor: multiplies the routed weights of the token-choice routers
        (DeepSeek-V3: 2.5; DeepSeek-V2-Lite's softmax router: 1.0); expert choice needs 1.
      activation: expert activation. `swiglu`: `silu(gate) * up` (Mixtral, Qwen, OLMoE,
        DeepSeek); `geglu`: `gelu(gate) * up`; `gelu`, `relu`: ungated (Switch: relu). GELU is
        the tanh approximation (transformers' `gelu_new` / `gelu_pytorch_tanh`, as in T5 v1.1 and
        Gemma), not the erf form of transformers' `"gelu"`. `clamped_swiglu` is GPT-OSS's: gate
        clamped above at `swiglu_limit`, up clamped to +-`swiglu_limit`, output
        `(up + 1) * gate * sigmoid(alpha * gate)` with `alpha = swiglu_alpha`.
      swiglu_limit: clamp limit of `clamped_swiglu`.
      swiglu_alpha: sigmoid slope of `clamped_swiglu`.
      expert_bias: expert projections have biases (`experts/b_gate`, `b_up [E, F]`,
        `b_down [E, D]`). The down bias is scaled by the routing weight like the rest of the output.
      num_shared_experts: shared experts applied to every token; they are fused into one MLP of
        width `Fs = num_shared_experts * shared_d_ff` (DeepSeek and Qwen2-MoE do the same).
      shared_d_ff: d_ff of one shared expert (default: `d_ff`).
      shared_gate: the shared output is scaled by `sigmoid(x @ shared/gate [D, 1])` (Qwen2-MoE).
      drop_policy: `"dropless"` never drops an assignment; `"capacity"` keeps at most a capacity per
        expert (per sequence when x has a sequence axis), dropped assignments contribute zero.
      capacity_factor: capacity = ceil(capacity_factor * tokens * K / E) (capacity mode and
        expert choice).
      expert_capacity: an absolute capacity per expert (as Switch checkpoints give it); overrides
        `capacity_factor` when set.
      block_size: row alignment of the `"blocked"` XLA path: each expert's rows are padded to a
        multiple of it (at most one block of padding per expert).
      router_dtype: the router's compute dtype (fp32 whatever the activation dtype).
      param_dtype: dtype of the initialised parameters.
      init_scale: standard deviation of the normal initialiser of projection weights, divided by
        sqrt(fan_in).
      expert_precision: the routed experts' matmuls. `"bf16"`: in the activation dtype (fp32
        accumulation). `"fp8"`: the DeepSeek-V3 recipe (forward, lhs and weight gradients on
        block-scaled fp8 operands: activations e4m3 in 1 x 128 tiles, weights e4m3 in 128 x 128
        blocks, fp32 scales and accumulation; `pallas_kernels.fp8_ops`): fp8 Mosaic GPU kernels
        with `implementation="pallas"` on Hopper, emulated (quantize, dequantize, fp32 matmul)
        everywhere else. Router, shared experts, parameters and optimizer state are untouched.
        `implementation="reference"` (the per-expert oracle) does not quantize.
      fp8_grad_format: fp8 format of the output gradients in the backward with
        `expert_precision="fp8"`: `"e4m3"` (DeepSeek-V3) or `"e5m2"` (more range, less precision).
    """

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int = 2
    router: RouterKind = "softmax"
    norm_topk_prob: bool = True
    router_bias: bool = False
    score_correction_bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    activation: Activation = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    expert_bias: bool = False
    num_shared_experts: int = 0
    shared_d_ff: int | None = None
    shared_gate: bool = False
    drop_policy: DropPolicy = "dropless"
    capacity_factor: float = 1.25
    expert_capacity: int | None = None
    block_size: int = 128
    router_dtype: str = "float32"
    param_dtype: str = "float32"
    init_scale: float = 1.0
    expert_precision: ExpertPrecision = "bf16"
    fp8_grad_format: Fp8Format = "e4m3"

    def __post_init__(self):
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool | np.bool_):
                raise TypeError(f"MoEConfig.{name}={value!r}: must be a bool (True or False)")
        for name in ("d_model", "d_ff", "num_experts", "top_k", "num_groups", "topk_groups"):
            _positive_int(name, getattr(self, name))
        _positive_int("block_size", self.block_size)
        if not _is_int(self.num_shared_experts) or self.num_shared_experts < 0:
            _bad("num_shared_experts", self.num_shared_experts, "must be an int >= 0")
        if self.shared_d_ff is not None:
            _positive_int("shared_d_ff", self.shared_d_ff)
        if self.router not in ROUTER_KINDS:
            _bad("router", self.router, f"must be one of {ROUTER_KINDS}")
        if self.activation not in ACTIVATIONS:
            _bad("activation", self.activation, f"must be one of {ACTIVATIONS}")
        if self.drop_policy not in DROP_POLICIES:
            _bad("drop_policy", self.drop_policy, f"must be one of {DROP_POLICIES}")
        if self.top_k > self.num_experts:
            _bad("top_k", self.top_k, f"must be <= num_experts={self.num_experts}")
        if self.num_experts % self.num_groups:
            _bad("num_groups", self.num_groups, f"must divide num_experts={self.num_experts}")
        if self.topk_groups > self.num_groups:
            _bad("topk_groups", self.topk_groups, f"must be <= num_groups={self.num_groups}")
        if self.num_groups > 1:
            if self.router != "sigmoid":
                _bad("num_groups", self.num_groups, "group-limited routing needs router='sigmoid'")
            per_group = self.num_experts // self.num_groups
            if per_group < 2:
                _bad("num_groups", self.num_groups, "each group needs >= 2 experts (top-2 score)")
            if self.top_k > self.topk_groups * per_group:
                _bad(
                    "top_k",
                    self.top_k,
                    f"must be <= topk_groups * experts per group = {self.topk_groups * per_group}",
                )
        if self.score_correction_bias and self.router != "sigmoid":
            _bad("score_correction_bias", True, "needs router='sigmoid'")
        _positive_finite("capacity_factor", self.capacity_factor)
        if self.expert_capacity is not None:
            _positive_int("expert_capacity", self.expert_capacity)
        _positive_finite("routed_scaling_factor", self.routed_scaling_factor)
        if self.router == "expert_choice" and self.routed_scaling_factor != 1:
            _bad("routed_scaling_factor", self.routed_scaling_factor, "must be 1 for expert_choice")
        if not _is_real(self.swiglu_limit) or not self.swiglu_limit > 0:  # inf = no clamp
            _bad("swiglu_limit", self.swiglu_limit, "must be a number > 0")
        _positive_finite("swiglu_alpha", self.swiglu_alpha)
        _positive_finite("init_scale", self.init_scale)
        if self.router_dtype not in ("float32", "float64"):
            _bad("router_dtype", self.router_dtype, "must be 'float32' (or 'float64')")
        if self.param_dtype not in ("float32", "bfloat16", "float16", "float64"):
            _bad("param_dtype", self.param_dtype, "must be a float dtype name")
        if self.expert_precision not in EXPERT_PRECISIONS:
            _bad("expert_precision", self.expert_precision, f"must be one of {EXPERT_PRECISIONS}")
        if self.fp8_grad_format not in FP8_FORMATS:
            _bad("fp8_grad_format", self.fp8_grad_format, f"must be one of {FP8_FORMATS}")
        if self.shared_gate and self.num_shared_experts == 0:
            _bad("shared_gate", True, "needs num_shared_experts >= 1")

    # Derived sizes -------------------------------------------------------------------------------
    @property
    def gated(self) -> bool:
        """Whether the expert activation has a gate projection (`w_gate`)."""
        return self.activation in GATED_ACTIVATIONS

    @property
    def fp8_swiglu_ffn(self) -> bool:
        """Whether the routed experts run as one fp8 op (`pallas_kernels.fp8_ops.fp8_swiglu_ffn`:
        fp8 precision, SwiGLU, no expert biases), which quantizes each operand where it is made
        and the expert weights as they are stored (fp32 master weights without a 16-bit copy)."""
        return (
            self.expert_precision == "fp8" and self.activation == "swiglu" and not self.expert_bias
        )

    @property
    def shared_width(self) -> int:
        """`Fs`: width of the fused shared-expert MLP (0 when there are no shared experts)."""
        return self.num_shared_experts * (self.shared_d_ff or self.d_ff)

    def capacity(self, tokens: int) -> int:
        """Per-expert capacity for `tokens` tokens in one capacity group (e.g. one sequence)."""
        if self.expert_capacity is not None:
            return self.expert_capacity
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts))

    def replace(self, **changes) -> MoEConfig:
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def _bad(field: str, value, why: str):
    raise ValueError(f"MoEConfig.{field}={value!r}: {why}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_int(field: str, value):
    if not _is_int(value) or value <= 0:
        _bad(field, value, "must be a positive int")


def _positive_finite(field: str, value):
    if not (_is_real(value) and math.isfinite(value) and value > 0):
        _bad(field, value, "must be a finite number > 0")
