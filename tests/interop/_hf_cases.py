"""Tiny `config.json` of each family, shared by the interop tests and the fixture script.

Sizes are small enough for committed fixtures; each family's routing features are switched on
(DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash: 4 groups, 2 kept; GPT-OSS: a clamp limit low enough to
be active; Switch: a capacity that drops tokens).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

D, F, E = 16, 8, 8


def load_reference():
    """tests/core/_hf_reference.py (numpy transcriptions of the published blocks) as a module."""
    if "_hf_reference" not in sys.modules:
        path = Path(__file__).parents[1] / "core" / "_hf_reference.py"
        spec = importlib.util.spec_from_file_location("_hf_reference", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_hf_reference"] = module
    return sys.modules["_hf_reference"]


CONFIGS: dict[str, dict] = {
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": D,
        "intermediate_size": F,
        "num_local_experts": E,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "router_jitter_noise": 0.0,
        "dtype": "float32",
    },
    "qwen2_moe": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": D,
        "intermediate_size": 24,  # the dense layers' width, not read
        "moe_intermediate_size": F,
        "shared_expert_intermediate_size": 12,
        "num_experts": E,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "dtype": "float32",
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": D,
        "moe_intermediate_size": F,
        "num_experts": E,
        "num_experts_per_tok": 3,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "dtype": "float32",
    },
    "olmoe": {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "hidden_size": D,
        "intermediate_size": F,
        "num_experts": E,
        "num_experts_per_tok": 3,
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "dtype": "float32",
    },
    "deepseek_v2": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": D,
        "moe_intermediate_size": F,
        "n_routed_experts": E,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "routed_scaling_factor": 2.0,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "hidden_act": "silu",
        "dtype": "float32",
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": D,
        "moe_intermediate_size": F,
        "n_routed_experts": E,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "dtype": "float32",
    },
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_size": D,
        "moe_intermediate_size": F,
        "n_routed_experts": E,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "dtype": "float32",
    },
    "glm4_moe_lite": {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "model_type": "glm4_moe_lite",
        "hidden_size": D,
        "moe_intermediate_size": F,
        "n_routed_experts": E,
        "n_shared_experts": 1,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.8,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "dtype": "float32",
    },
    "minimax_m2": {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "hidden_size": D,
        "intermediate_size": F,
        "num_local_experts": E,
        "num_experts_per_tok": 3,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "router_jitter_noise": 0.0,
        "hidden_act": "silu",
        "dtype": "float32",
    },
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": D,
        "intermediate_size": F,
        "num_local_experts": E,
        "num_experts_per_tok": 2,
        "swiglu_limit": 1.0,
        "swiglu_alpha": 1.702,
        "dtype": "float32",
    },
    "switch": {
        "architectures": ["SwitchTransformersForConditionalGeneration"],
        "model_type": "switch_transformers",
        "d_model": D,
        "d_ff": F,
        "num_experts": E,
        "expert_capacity": 3,
        "router_bias": False,
        "router_jitter_noise": 0.0,
        "router_dtype": "float32",
        "dense_act_fn": "relu",
        "dtype": "float32",
    },
}
