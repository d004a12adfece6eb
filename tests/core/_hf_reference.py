"""Numpy transcriptions of the published MoE blocks, each in its own parameter layout.

Sources, read line by line (transcribed, not imported, so CI needs neither torch nor transformers):

- Hugging Face transformers 5.23.0 (the wheel; the same code as huggingface/transformers
  `src/transformers/models/<family>/modeling_<family>.py` on main at that release):
  `MixtralTopKRouter` / `MixtralExperts` / `MixtralSparseMoeBlock`, the identical
  `Qwen3MoeTopKRouter`, `OlmoeTopKRouter` (with `norm_topk_prob`), `Qwen2MoeSparseMoeBlock`
  (+ `Qwen2MoeMLP` shared expert and `shared_expert_gate`), `DeepseekV3TopkRouter` /
  `DeepseekV3MoE`, `MiniMaxM2TopKRouter` / `MiniMaxM2SparseMoeBlock` (5.24.0),
  `GptOssTopKRouter` / `GptOssExperts` / `GptOssMLP`, `SwitchTransformersTop1Router` /
  `SwitchTransformersSparseMLP`, and the Switch/Mixtral `load_balancing_loss_func` and
  `router_z_loss_func`.
- Expert choice and GShard-style top-k capacity: flaxformer's `ExpertsChooseMaskedRouter` and
  `TokensChooseMaskedRouter` (google/flaxformer `flaxformer/architectures/moe/routing.py`, as
  copied into huggingface/transformers `src/transformers/models/switchtransformers/router_flax.py`
  at commit 09068706) with `MoeLayer._mask_and_dispatch_to_experts` (google/flaxformer
  `flaxformer/architectures/moe/moe_layers.py` at commit 6254e11a).

Every function takes a state dict keyed exactly like the torch module's `state_dict()` (so the
optional torch test loads the same dict into the real module) and `x [B, S, D]`, computes in
float64, and returns `(y [B, S, D], routing dict)`. `to_hf_*` maps a moejax parameter tree onto
that layout: this mapping is part of what the family tests check.
"""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------------------------------------
# torch ops, in numpy


def softmax(x, axis=-1):
    z = np.exp(x - x.max(axis, keepdims=True))
    return z / z.sum(axis, keepdims=True)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):  # ACT2FN["silu"]
    return x * sigmoid(x)


def gelu_new(x):
    """transformers `NewGELUActivation` (ACT2FN["gelu_new"]), the tanh approximation."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def topk(x, k):
    """`torch.topk(x, k, dim=-1)`: values and indices, largest first."""
    index = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, index, -1), index


def _np(tree):
    return {k: np.asarray(v, np.float64) for k, v in tree.items()}


# ---------------------------------------------------------------------------------------------
# Parameter layouts: moejax tree -> Hugging Face state dict (torch Linear weights are [out, in])


def _gate_up_chunked(experts):
    """`gate_up_proj [E, 2F, D]`: `linear(x, gate_up_proj[e]).chunk(2)` gives gate, then up."""
    return np.concatenate(
        [np.swapaxes(experts["w_gate"], 1, 2), np.swapaxes(experts["w_up"], 1, 2)], axis=1
    )


def to_hf_mixtral(params, router_name="gate"):
    """Mixtral, Qwen3-MoE, OLMoE (and the routed part of Qwen2-MoE, DeepSeek-V3)."""
    e = {k: np.asarray(v, np.float64) for k, v in params["experts"].items()}
    return {
        f"{router_name}.weight": np.asarray(params["router"]["kernel"], np.float64).T,
        "experts.gate_up_proj": _gate_up_chunked(e),
        "experts.down_proj": np.swapaxes(e["w_down"], 1, 2),  # [E, D, F]
    }


def _hf_mlp(shared, prefix):
    s = _np(shared)
    return {
        f"{prefix}.gate_proj.weight": s["w_gate"].T,
        f"{prefix}.up_proj.weight": s["w_up"].T,
        f"{prefix}.down_proj.weight": s["w_down"].T,
    }


def to_hf_qwen2_moe(params):
    sd = to_hf_mixtral(params)
    sd.update(_hf_mlp(params["shared"], "shared_expert"))
    sd["shared_expert_gate.weight"] = np.asarray(params["shared"]["gate"], np.float64).T  # [1, D]
    return sd


def to_hf_deepseek_v2(params):
    sd = to_hf_mixtral(params)
    sd.update(_hf_mlp(params["shared"], "shared_experts"))
    return sd


def to_hf_deepseek_v3(params):
    sd = to_hf_mixtral(params)
    sd["gate.e_score_correction_bias"] = np.asarray(
        params["router"]["score_correction_bias"], np.float64
    )
    sd.update(_hf_mlp(params["shared"], "shared_experts"))
    return sd


def to_hf_minimax_m2(params):
    sd = to_hf_mixtral(params)
    sd["e_score_correction_bias"] = np.asarray(
        params["router"]["score_correction_bias"], np.float64
    )
    return sd


def to_hf_gpt_oss(params):
    """GPT-OSS stores gate and up interleaved along the last axis: gate at even, up at odd."""
    e = _np(params["experts"])
    n, d, f = e["w_up"].shape
    gate_up = np.empty((n, d, 2 * f))
    gate_up[..., ::2], gate_up[..., 1::2] = e["w_gate"], e["w_up"]
    gate_up_bias = np.empty((n, 2 * f))
    gate_up_bias[:, ::2], gate_up_bias[:, 1::2] = e["b_gate"], e["b_up"]
    return {
        "router.weight": np.asarray(params["router"]["kernel"], np.float64).T,
        "router.bias": np.asarray(params["router"]["bias"], np.float64),
        "experts.gate_up_proj": gate_up,  # [E, D, 2F], used as x @ W (not transposed)
        "experts.gate_up_proj_bias": gate_up_bias,
        "experts.down_proj": e["w_down"],  # [E, F, D]
        "experts.down_proj_bias": e["b_down"],
    }


def to_hf_switch(params):
    e = _np(params["experts"])
    sd = {"router.classifier.weight": np.asarray(params["router"]["kernel"], np.float64).T}
    for i in range(e["w_up"].shape[0]):
        sd[f"experts.expert_{i}.wi.weight"] = e["w_up"][i].T  # [F, D]
        sd[f"experts.expert_{i}.wo.weight"] = e["w_down"][i].T  # [D, F]
    return sd


def to_flaxformer(params):
    """flaxformer `MlpBlock` experts with activations ('swish', 'linear'): wi_0, wi_1, wo."""
    e = _np(params["experts"])
    return {
        "router.w": np.asarray(params["router"]["kernel"], np.float64),  # [D, E]
        "wi_0": e["w_gate"],
        "wi_1": e["w_up"],
        "wo": e["w_down"],
    }


# ---------------------------------------------------------------------------------------------
# Hugging Face blocks


def _experts_gate_up(sd, hidden, top_k_index, top_k_weights, act=silu):
    """`MixtralExperts.forward` (identical in Qwen2/Qwen3-MoE, OLMoE and DeepSeek-V3)."""
    final = np.zeros_like(hidden)
    num_experts = sd["experts.gate_up_proj"].shape[0]
    for expert_idx in range(num_experts):
        token_idx, top_k_pos = np.nonzero(top_k_index == expert_idx)
        if token_idx.size == 0:
            continue
        current_state = hidden[token_idx]
        gate, up = np.split(current_state @ sd["experts.gate_up_proj"][expert_idx].T, 2, axis=-1)
        current = act(gate) * up
        current = current @ sd["experts.down_proj"][expert_idx].T
        current = current * top_k_weights[token_idx, top_k_pos, None]
        np.add.at(final, token_idx, current)
    return final


def topk_router(sd, hidden, top_k, norm_topk_prob):
    """`MixtralTopKRouter` (norm always) / `Qwen3MoeTopKRouter`, `OlmoeTopKRouter` (flag)."""
    router_logits = hidden @ sd["gate.weight"].T
    router_probs = softmax(router_logits)
    router_top_value, router_indices = topk(router_probs, top_k)
    if norm_topk_prob:
        router_top_value = router_top_value / router_top_value.sum(-1, keepdims=True)
    return router_logits, router_top_value, router_indices


def mixtral_block(sd, x, *, top_k, norm_topk_prob=True):
    """`MixtralSparseMoeBlock` (eval: no jitter); with `norm_topk_prob` also Qwen3-MoE/OLMoE."""
    b, s, d = x.shape
    hidden = x.reshape(-1, d)
    logits, weights, index = topk_router(sd, hidden, top_k, norm_topk_prob)
    y = _experts_gate_up(sd, hidden, index, weights)
    return y.reshape(b, s, d), {"logits": logits, "index": index, "weight": weights}


def _mlp(sd, prefix, x):
    """`Qwen2MoeMLP` / `DeepseekV3MLP`: down(silu(gate(x)) * up(x))."""
    g = x @ sd[f"{prefix}.gate_proj.weight"].T
    u = x @ sd[f"{prefix}.up_proj.weight"].T
    return (silu(g) * u) @ sd[f"{prefix}.down_proj.weight"].T


def qwen2_moe_block(sd, x, *, top_k, norm_topk_prob=False):
    """`Qwen2MoeSparseMoeBlock`: routed experts + sigmoid-gated shared expert."""
    b, s, d = x.shape
    hidden = x.reshape(-1, d)
    shared = _mlp(sd, "shared_expert", hidden)
    logits, weights, index = topk_router(sd, hidden, top_k, norm_topk_prob)
    out = _experts_gate_up(sd, hidden, index, weights)
    shared = sigmoid(hidden @ sd["shared_expert_gate.weight"].T) * shared
    y = out + shared
    return y.reshape(b, s, d), {"logits": logits, "index": index, "weight": weights}


def deepseek_v2_block(sd, x, *, top_k, scaling, norm_topk_prob=False):
    """`DeepseekV2Moe` with `topk_method="greedy"`: softmax top-k (unsorted: compare index sets)
    scaled by `routed_scaling_factor`, routed experts + shared experts."""
    b, s, d = x.shape
    hidden = x.reshape(-1, d)
    logits, weights, index = topk_router(sd, hidden, top_k, norm_topk_prob)
    weights = weights * scaling
    y = _experts_gate_up(sd, hidden, index, weights) + _mlp(sd, "shared_experts", hidden)
    return y.reshape(b, s, d), {"logits": logits, "index": index, "weight": weights}


def deepseek_v3_router(sd, hidden, *, top_k, n_group, topk_group, norm_topk_prob, scaling):
    """`DeepseekV3TopkRouter.forward`. Its topk calls use `sorted=False`: compare index sets."""
    num_experts = sd["gate.weight"].shape[0]
    router_logits = hidden @ sd["gate.weight"].T
    scores = sigmoid(router_logits)
    scores_for_choice = scores + sd["gate.e_score_correction_bias"]
    grouped = scores_for_choice.reshape(-1, n_group, num_experts // n_group)
    group_scores = topk(grouped, 2)[0].sum(-1)
    group_idx = topk(group_scores, topk_group)[1]
    group_mask = np.zeros_like(group_scores)
    np.put_along_axis(group_mask, group_idx, 1, axis=1)
    score_mask = np.repeat(group_mask, num_experts // n_group, axis=1)
    scores_for_choice = np.where(score_mask.astype(bool), scores_for_choice, -np.inf)
    topk_indices = topk(scores_for_choice, top_k)[1]
    topk_weights = np.take_along_axis(scores, topk_indices, 1)
    if norm_topk_prob:
        denominator = topk_weights.sum(-1, keepdims=True) + 1e-20
        topk_weights = topk_weights / denominator
    topk_weights = topk_weights * scaling
    return router_logits, topk_weights, topk_indices


def deepseek_v3_block(sd, x, **router_kw):
    """`DeepseekV3MoE`: group-limited sigmoid routing, routed experts + shared experts."""
    b, s, d = x.shape
    hidden = x.reshape(-1, d)
    logits, weights, index = deepseek_v3_router(sd, hidden, **router_kw)
    y = _experts_gate_up(sd, hidden, index, weights) + _mlp(sd, "shared_experts", hidden)
    return y.reshape(b, s, d), {"logits": logits, "index": index, "weight": weights}


def minimax_m2_router(sd, hidden, *, top_k):
    """`MiniMaxM2TopKRouter.forward`: sigmoid scores, the correction bias picks the top-k, the
    chosen scores renormalised. Its topk uses `sorted=False`: compare index sets."""
    router_logits = hidden @ sd["gate.weight"].T
    scores = sigmoid(router_logits)
    topk_indices = topk(scores + sd["e_score_correction_bias"], top_k)[1]
    topk_weights = np.take_along_axis(scores, topk_indices, 1)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdims=True)
    return router_logits, topk_weights, topk_indices


def minimax_m2_block(sd, x, *, top_k):
    """`MiniMaxM2SparseMoeBlock` (eval: no jitter): its router, Mixtral's experts."""
    b, s, d = x.shape
    hidden = x.reshape(-1, d)
    logits, weights, index = minimax_m2_router(sd, hidden, top_k=top_k)
    y = _experts_gate_up(sd, hidden, index, weights)
    return y.reshape(b, s, d), {"logits": logits, "index": index, "weight": weights}


def gpt_oss_block(sd, x, *, top_k, limit=7.0, alpha=1.702):
    """`GptOssMLP`: `GptOssTopKRouter` (top-k on biased logits, softmax over the k) and
    `GptOssExperts` (interleaved gate/up, clamped SwiGLU, biases)."""
    b, s, d = x.shape
    hidden = x.reshape(-1, d)
    router_logits = hidden @ sd["router.weight"].T + sd["router.bias"]
    router_top_value, router_indices = topk(router_logits, top_k)
    router_scores = softmax(router_top_value, axis=1)

    def apply_gate(gate_up):  # GptOssExperts._apply_gate
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
        glu = gate * sigmoid(gate * alpha)
        return (up + 1) * glu

    next_states = np.zeros_like(hidden)
    for expert_idx in range(sd["experts.gate_up_proj"].shape[0]):
        token_idx, top_k_pos = np.nonzero(router_indices == expert_idx)
        if token_idx.size == 0:
            continue
        current_state = hidden[token_idx]
        gate_up = (
            current_state @ sd["experts.gate_up_proj"][expert_idx]
            + sd["experts.gate_up_proj_bias"][expert_idx]
        )
        gated_output = apply_gate(gate_up)
        out = (
            gated_output @ sd["experts.down_proj"][expert_idx]
            + sd["experts.down_proj_bias"][expert_idx]
        )
        weighted_output = out * router_scores[token_idx, top_k_pos, None]
        np.add.at(next_states, token_idx, weighted_output)
    routing = {"logits": router_logits, "index": router_indices, "weight": router_scores}
    return next_states.reshape(b, s, d), routing


def switch_block(sd, x, *, expert_capacity):
    """`SwitchTransformersSparseMLP` with `SwitchTransformersTop1Router` (relu `DenseActDense`
    experts): capacity counted per batch row by a cumsum over the sequence, dropped tokens output
    zero."""
    b, s, d = x.shape
    num_experts = sd["router.classifier.weight"].shape[0]
    router_logits = x @ sd["router.classifier.weight"].T  # [B, S, E]
    router_probs = softmax(router_logits)
    expert_index = np.argmax(router_probs, axis=-1)
    one_hot = np.eye(num_experts, dtype=np.int64)[expert_index]
    token_priority = np.cumsum(one_hot, axis=-2)
    expert_capacity_mask = token_priority <= expert_capacity
    one_hot = one_hot * expert_capacity_mask
    router_probs_max = router_probs.max(-1, keepdims=True)

    hidden = x.reshape(-1, d)
    selected = one_hot.reshape(-1, num_experts)
    weights = router_probs_max.reshape(-1, 1)
    final = np.zeros_like(hidden)
    for e in range(num_experts):
        top_x = np.nonzero(selected[:, e])[0]
        if top_x.size == 0:
            continue
        h = np.maximum(hidden[top_x] @ sd[f"experts.expert_{e}.wi.weight"].T, 0.0)
        out = h @ sd[f"experts.expert_{e}.wo.weight"].T
        np.add.at(final, top_x, out * weights[top_x, 0, None])
    routing = {
        "logits": router_logits.reshape(-1, num_experts),
        "index": expert_index.reshape(-1, 1),
        "weight": weights,
        "dropped": ~selected.any(-1, keepdims=True).astype(bool),
    }
    return final.reshape(b, s, d), routing


def load_balancing_loss_mixtral(gate_logits, num_experts, top_k):
    """Mixtral `load_balancing_loss_func` for one layer without an attention mask."""
    routing_weights = softmax(gate_logits)
    _, selected = topk(routing_weights, top_k)
    tokens_per_expert = np.bincount(selected.reshape(-1), minlength=num_experts) / len(gate_logits)
    router_prob_per_expert = routing_weights.mean(0)
    return np.sum(tokens_per_expert * router_prob_per_expert) * num_experts


def load_balancing_loss_switch(router_probs, expert_indices):
    """Switch `load_balancing_loss_func`: `[B, S, E]` probabilities, `[B, S]` top-1 experts."""
    num_experts = router_probs.shape[-1]
    expert_mask = np.eye(num_experts)[expert_indices]  # [B, S, E]
    tokens_per_group_and_expert = expert_mask.mean(-2)
    router_prob_per_group_and_expert = router_probs.mean(-2)
    return np.mean(tokens_per_group_and_expert * router_prob_per_group_and_expert) * num_experts**2


def router_z_loss(router_logits):
    """Switch `router_z_loss_func` over `[B, S, E]` logits."""
    num_groups, tokens_per_group, _ = router_logits.shape
    m = router_logits.max(-1, keepdims=True)
    log_z = (m + np.log(np.exp(router_logits - m).sum(-1, keepdims=True)))[..., 0]
    return np.sum(log_z**2) / (num_groups * tokens_per_group)


# ---------------------------------------------------------------------------------------------
# flaxformer routers (groups = sequences) with masked dispatch and combine


def _flaxformer_experts(p, expert_inputs):
    """`MlpBlock` per expert, activations ('swish', 'linear'): `[G, E, C, D]` -> same."""
    h0 = np.einsum("gecd,edf->gecf", expert_inputs, p["wi_0"])
    h1 = np.einsum("gecd,edf->gecf", expert_inputs, p["wi_1"])
    return np.einsum("gecf,efd->gecd", silu(h0) * h1, p["wo"])


def _masked_moe_layer(p, x, dispatch_mask, combine_array):
    """`MoeLayer._mask_and_dispatch_to_experts` with the router's masks."""
    expert_inputs = np.einsum("gtd,gtec->gecd", x, dispatch_mask)
    expert_outputs = _flaxformer_experts(p, expert_inputs)
    return np.einsum("gecd,gtec->gtd", expert_outputs, combine_array)


def experts_choose_block(p, x, *, expert_capacity):
    """`ExpertsChooseMaskedRouter`: each expert takes its top-`expert_capacity` tokens of each
    group by router probability; the combine weight is that probability."""
    router_probs = softmax(x @ p["router.w"])  # [G, S, E]
    tokens_per_group = router_probs.shape[1]
    router_probs_t = np.swapaxes(router_probs, 1, 2)
    expert_gate, expert_index = topk(router_probs_t, expert_capacity)  # [G, E, C]
    dispatch_mask = np.eye(tokens_per_group)[expert_index]  # [G, E, C, S]
    dispatch_mask = np.moveaxis(dispatch_mask, 3, 1)  # [G, S, E, C]
    combine_array = np.einsum("gec,gtec->gtec", expert_gate, dispatch_mask)
    y = _masked_moe_layer(p, x, dispatch_mask, combine_array)
    e = router_probs.shape[-1]
    routing = {
        "kept": dispatch_mask.sum(-1).reshape(-1, e) > 0,
        "weight": combine_array.sum(-1).reshape(-1, e),
    }
    return y, routing


def tokens_choose_block(p, x, *, num_selected_experts, expert_capacity):
    """`TokensChooseMaskedRouter` without batch-prioritized routing: top-k choices, every
    token's first choice before any second choice, then position order, within each group."""
    router_probs = softmax(x @ p["router.w"])  # [G, S, E]
    num_groups, _, num_experts = router_probs.shape
    expert_gate, expert_index = topk(router_probs, num_selected_experts)
    expert_index = np.swapaxes(expert_index, 1, 2).reshape(num_groups, -1)
    expert_mask = np.eye(num_experts, dtype=np.int64)[expert_index]
    token_priority = np.cumsum(expert_mask, axis=1) * expert_mask - 1.0
    token_priority = token_priority.reshape(num_groups, num_selected_experts, -1, num_experts)
    token_priority = np.swapaxes(token_priority, 1, 2)
    token_priority = np.max(token_priority, axis=2).astype(np.int64)  # [G, S, E]
    # jax.nn.one_hot ignores indices outside [0, expert_capacity).
    dispatch_mask = (token_priority[..., None] == np.arange(expert_capacity)).astype(np.float64)
    combine_array = np.einsum("gte,gtec->gtec", router_probs, dispatch_mask)
    y = _masked_moe_layer(p, x, dispatch_mask, combine_array)
    index = np.swapaxes(expert_index.reshape(num_groups, num_selected_experts, -1), 1, 2)
    index = index.reshape(-1, num_selected_experts)
    kept_expert = dispatch_mask.sum(-1).reshape(-1, num_experts) > 0
    routing = {
        "index": index,
        "weight": expert_gate.reshape(-1, num_selected_experts),
        "dropped": ~np.take_along_axis(kept_expert, index, 1),
    }
    return y, routing
