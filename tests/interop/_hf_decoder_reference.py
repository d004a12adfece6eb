"""A numpy transcription of the Hugging Face MoE decoders, and tiny random checkpoint directories.

Transcribed (not imported: CI has no torch) from transformers 5.x
`src/transformers/models/{mixtral,qwen3_moe,olmoe,qwen2_moe}/modeling_*.py`, eval mode, eager
attention, no cache: `*RMSNorm` (fp32 statistic), `*RotaryEmbedding` with `rotate_half`
(`apply_rotary_pos_emb`), `*Attention` (q/k/v projections with the family's biases; Qwen3-MoE's
`q_norm`/`k_norm` per head on `[B, S, H, Dh]`, OLMoE's over the whole projection `[B, S, H*Dh]`,
both before RoPE; `repeat_kv`; `eager_attention_forward` with scaling `Dh**-0.5` and a causal
mask), the decoder layer (pre-norm residuals), the sparse MoE blocks (softmax router over all
experts, top-k, optional renormalisation, per-expert SwiGLU loop; Qwen2-MoE's shared expert
gated by `sigmoid(shared_expert_gate(x))`), dense MLP layers where `decoder_sparse_step > 1`,
the final norm and `lm_head` (tied to the embedding when `tie_word_embeddings`). Computes in
float64 on the per-expert state dict of the published checkpoints.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from moejax.interop.hf import lm_config_from_hf, model_recipes
from moejax.interop.hf._model import FP32_TENSORS
from moejax.interop.hf._recipes import mtp_copies

INDEX_NAME = "model.safetensors.index.json"

EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
MOE_MODULE = {"mixtral": "block_sparse_moe"}


def softmax(x, axis=-1):
    z = np.exp(x - x.max(axis, keepdims=True))
    return z / z.sum(axis, keepdims=True)


def silu(x):
    return x / (1.0 + np.exp(-x))


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def decoder_logits(sd, config, tokens, inv_freq, attention_scaling=1.0):
    """Logits `[B, S, V]` and per-MoE-layer routing indices `[T, K]` of `tokens [B, S]`.

    `inv_freq [Dh/2]` and `attention_scaling` are the rotary embedding's (`rope_init_fn`).
    """
    kind = config["model_type"]
    g = lambda name: np.asarray(sd[name], np.float64)  # noqa: E731
    eps = config.get("rms_norm_eps", 1e-6)
    d, h = config["hidden_size"], config["num_attention_heads"]
    hkv = config.get("num_key_value_heads", h)
    dh = config.get("head_dim") or d // h
    b, s = tokens.shape
    pos = np.arange(s, dtype=np.float64)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb) * attention_scaling, np.sin(emb) * attention_scaling
    x = g("model.embed_tokens.weight")[tokens]
    routing = []
    step = config.get("decoder_sparse_step", 1)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        hs = rms_norm(x, g(p + "input_layernorm.weight"), eps)
        proj = {}
        for n in "qkv":
            y = hs @ g(f"{p}self_attn.{n}_proj.weight").T
            if f"{p}self_attn.{n}_proj.bias" in sd:
                y = y + g(f"{p}self_attn.{n}_proj.bias")
            proj[n] = y
        if kind == "olmoe":  # over the whole projection
            proj["q"] = rms_norm(proj["q"], g(p + "self_attn.q_norm.weight"), eps)
            proj["k"] = rms_norm(proj["k"], g(p + "self_attn.k_norm.weight"), eps)
        q = proj["q"].reshape(b, s, h, dh).transpose(0, 2, 1, 3)
        k = proj["k"].reshape(b, s, hkv, dh).transpose(0, 2, 1, 3)
        v = proj["v"].reshape(b, s, hkv, dh).transpose(0, 2, 1, 3)
        if kind == "qwen3_moe":  # per head
            q = rms_norm(q, g(p + "self_attn.q_norm.weight"), eps)
            k = rms_norm(k, g(p + "self_attn.k_norm.weight"), eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, h // hkv, axis=1), np.repeat(v, h // hkv, axis=1)
        scores = q @ k.transpose(0, 1, 3, 2) * dh**-0.5
        scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
        out = (softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(b, s, h * dh)
        out = out @ g(p + "self_attn.o_proj.weight").T
        if p + "self_attn.o_proj.bias" in sd:
            out = out + g(p + "self_attn.o_proj.bias")
        x = x + out
        hs = rms_norm(x, g(p + "post_attention_layernorm.weight"), eps).reshape(b * s, d)
        if (i + 1) % step == 0:
            y, index = _moe_block(sd, config, f"{p}{MOE_MODULE.get(kind, 'mlp')}.", hs)
            routing.append(index)
        else:
            y = _mlp(g, f"{p}mlp.", hs, ("gate_proj", "up_proj", "down_proj"))
        x = x + y.reshape(b, s, d)
    x = rms_norm(x, g("model.norm.weight"), eps)
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    return x @ g(head).T, routing


def _mlp(g, pre, x, names):
    gate, up, down = names
    return (silu(x @ g(f"{pre}{gate}.weight").T) * (x @ g(f"{pre}{up}.weight").T)) @ g(
        f"{pre}{down}.weight"
    ).T


def _moe_block(sd, config, pre, hidden):
    kind = config["model_type"]
    g = lambda name: np.asarray(sd[name], np.float64)  # noqa: E731
    names = EXPERT_NAMES.get(kind, ("gate_proj", "up_proj", "down_proj"))
    top_k = config["num_experts_per_tok"]
    norm = True if kind == "mixtral" else config.get("norm_topk_prob", False)
    probs = softmax(hidden @ g(pre + "gate.weight").T)
    index = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, index, -1)
    if norm:
        weights = weights / weights.sum(-1, keepdims=True)
    out = np.zeros_like(hidden)
    for e in range(probs.shape[-1]):
        tok, pos = np.nonzero(index == e)
        if tok.size:
            y = _mlp(g, f"{pre}experts.{e}.", hidden[tok], names) * weights[tok, pos, None]
            np.add.at(out, tok, y)
    if kind == "qwen2_moe":
        shared = _mlp(g, pre + "shared_expert.", hidden, ("gate_proj", "up_proj", "down_proj"))
        gate = 1 / (1 + np.exp(-(hidden @ g(pre + "shared_expert_gate.weight").T)))
        out = out + gate * shared
    return out, index


# ---------------------------------------------------------------------------------------------
# Tiny random checkpoints

_BASE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "num_experts_per_tok": 2,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
CONFIGS = {
    "mixtral": _BASE
    | {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "intermediate_size": 48,
        "num_local_experts": 4,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    "qwen3_moe": _BASE
    | {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "head_dim": 16,  # not hidden / heads, as in Qwen3-MoE
        "intermediate_size": 40,
        "moe_intermediate_size": 24,
        "num_experts": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
    },
    "olmoe": _BASE
    | {
        "model_type": "olmoe",
        "architectures": ["OlmoeForCausalLM"],
        "intermediate_size": 24,
        "num_experts": 8,
        "norm_topk_prob": False,
        "clip_qkv": None,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "pad_token_id": 1,  # OlmoeConfig's default (and OLMoE-1B-7B's)
        "eos_token_id": 50,  # within this vocabulary
    },
    "qwen2_moe": _BASE
    | {
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        "num_hidden_layers": 4,
        "intermediate_size": 40,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [],
        "use_sliding_window": False,
    },
}


# Whole decoders the numpy transcription above does not cover (MLA, MTP, partial RoPE, sinks,
# windows):
# `test_hf_fidelity.py` compares them with transformers' own outputs.
CONFIGS_2026 = {
    "deepseek_v3": _BASE
    | {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,  # [dense, moe, moe], then one MTP layer
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 12,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,  # != qk_nope + qk_rope
        "intermediate_size": 40,
        "moe_intermediate_size": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rope_interleave": True,
        "num_nextn_predict_layers": 1,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },  # fmt: skip
    },
    "deepseek_v2": _BASE
    | {
        "model_type": "deepseek_v2",
        "architectures": ["DeepseekV2ForCausalLM"],
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,  # [dense, moe, moe]
        "num_key_value_heads": 4,
        "q_lora_rank": None,  # DeepSeek-V2-Lite: a full-rank query projection
        "kv_lora_rank": 12,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,
        "intermediate_size": 40,
        "moe_intermediate_size": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "routed_scaling_factor": 2.0,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },  # fmt: skip  (DeepSeek-V2-Lite's mscale)
    },
    "glm4_moe": _BASE
    | {
        "model_type": "glm4_moe",
        "architectures": ["Glm4MoeForCausalLM"],
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,  # [dense, moe, moe], then one MTP layer
        "head_dim": 16,  # not hidden / heads
        "partial_rotary_factor": 0.5,  # RoPE over 8 of the 16 features
        "attention_bias": True,
        "use_qk_norm": True,
        "intermediate_size": 40,
        "moe_intermediate_size": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5,
    },
    "glm4_moe_lite": _BASE
    | {
        "model_type": "glm4_moe_lite",
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,  # [dense, moe, moe] (transformers' default), one MTP layer
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 12,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 10,  # != qk_nope + qk_rope (GLM-4.7-Flash: 256 = 192 + 64)
        "intermediate_size": 40,
        "moe_intermediate_size": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 3,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 1.8,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5,
    },
    "minimax_m2": _BASE
    | {
        "model_type": "minimax_m2",
        "architectures": ["MiniMaxM2ForCausalLM"],
        "head_dim": 16,  # not hidden / heads
        "rotary_dim": 8,  # RoPE over 8 of the 16 features (MiniMax-M2's own field)
        "intermediate_size": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 3,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",  # over all heads: 4 query, 2 key heads
        "attn_type_list": [1, 1],
        "shared_intermediate_size": 0,
        "router_jitter_noise": 0.0,
    },
    "gpt_oss": _BASE
    | {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": 4,
        "head_dim": 8,
        "intermediate_size": 16,
        "num_local_experts": 4,
        "experts_per_token": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 3,  # shorter than the fixtures' 10 positions
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },  # fmt: skip
    },
}


def stored(draw: np.ndarray, dtype) -> np.ndarray:
    """A float64 `draw` as a stored tensor of `dtype`, rounded to float32 first: float64 ->
    float32 is numpy's own IEEE rounding and float32 -> bfloat16 one round-to-nearest-even, so
    the bytes do not depend on how a dependency casts float64 to a 16-bit type (ml_dtypes 0.6
    rounded through float32, 0.7 rounds once: `1 + 2**-8 + 2**-30` gave 1.0, then 1.0078125)."""
    return np.asarray(draw, np.float64).astype(np.float32).astype(dtype)


def random_state_dict(config: dict, seed: int = 0, dtype=ml_dtypes.bfloat16) -> dict:
    """Random tensors of every name of `config`'s model (the family's published layout, with
    DeepSeek-V3's MTP copies of the embedding and head), stored `dtype`."""
    cfg, family = lm_config_from_hf(config)
    rng = np.random.default_rng(seed)
    out = {}
    for recipe in model_recipes(cfg, family):
        for name, shape in zip(recipe.tensors, recipe.shapes, strict=True):
            if name.endswith("norm.weight") or "layernorm" in name:
                t = 1.0 + 0.1 * rng.standard_normal(shape)
            elif name.endswith("embed_tokens.weight"):
                t = rng.standard_normal(shape)
            else:
                t = rng.standard_normal(shape) * (shape[-1] ** -0.5)
            # float32 as published (transformers keeps the router bias buffer in fp32)
            out[name] = stored(t, np.float32 if name.endswith(FP32_TENSORS) else dtype)
    for copy, original in mtp_copies(cfg).items():
        out[copy] = out[original]
    return out


def write_safetensors(path: str, tensors: list[tuple[str, np.ndarray]]) -> None:
    """`(name, array)` pairs as one safetensors file at `path`, in place (the `safetensors`
    package's writer, not moejax's: the files the tests read are not moejax's own)."""
    save_file({name: np.ascontiguousarray(array) for name, array in tensors}, path)


def write_checkpoint(path: str, config: dict, sd: dict, shards: int = 3) -> None:
    """`config.json` + `sd` over `shards` safetensors files with an index (or one file)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    names = list(sd)
    if shards == 1:
        write_safetensors(os.path.join(path, "model.safetensors"), [(n, sd[n]) for n in names])
        return
    weight_map = {}
    for k, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(os.path.join(path, file), [(names[j], sd[names[j]]) for j in part])
        weight_map.update({names[j]: file for j in part})
    total = sum(t.nbytes for t in sd.values())
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
