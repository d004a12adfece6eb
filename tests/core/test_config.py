"""MoEConfig validation: every invalid value raises a ValueError naming the field and value."""

import pytest

import moejax
from moejax import presets

BASE = dict(d_model=16, d_ff=32, num_experts=8, top_k=2)

INVALID = [
    ({"top_k": 9}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"d_model": 0}, "d_model"),
    ({"d_ff": -4}, "d_ff"),
    ({"num_experts": 0}, "num_experts"),
    ({"d_model": 16.0}, "d_model"),
    ({"d_model": True}, "d_model"),
    ({"router": "sigmoid", "num_groups": 3, "topk_groups": 1}, "num_groups"),
    ({"router": "sigmoid", "num_groups": 4, "topk_groups": 5}, "topk_groups"),
    ({"router": "softmax", "num_groups": 4, "topk_groups": 2}, "num_groups"),
    ({"router": "sigmoid", "num_groups": 8, "topk_groups": 1}, "num_groups"),
    ({"router": "sigmoid", "num_groups": 4, "topk_groups": 1, "top_k": 3}, "top_k"),
    ({"capacity_factor": 0.0}, "capacity_factor"),
    ({"capacity_factor": -1.0}, "capacity_factor"),
    ({"capacity_factor": float("nan")}, "capacity_factor"),
    ({"expert_capacity": 0}, "expert_capacity"),
    ({"activation": "tanh"}, "activation"),
    ({"router": "hash"}, "router"),
    ({"drop_policy": "dropfull"}, "drop_policy"),
    ({"num_shared_experts": -1}, "num_shared_experts"),
    ({"shared_d_ff": 0, "num_shared_experts": 1}, "shared_d_ff"),
    ({"shared_gate": True}, "shared_gate"),
    ({"score_correction_bias": True}, "score_correction_bias"),
    ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
    ({"block_size": 0}, "block_size"),
    ({"swiglu_limit": 0.0}, "swiglu_limit"),
    ({"init_scale": 0.0}, "init_scale"),
    ({"router_dtype": "bfloat16"}, "router_dtype"),
    ({"param_dtype": "int8"}, "param_dtype"),
    ({"num_groups": 0}, "num_groups"),
    ({"router": "sigmoid", "num_groups": 4, "topk_groups": 0}, "topk_groups"),
    ({"block_size": 8.0}, "block_size"),
    ({"expert_capacity": -3}, "expert_capacity"),
    ({"expert_capacity": True}, "expert_capacity"),
    ({"num_shared_experts": 1.5}, "num_shared_experts"),
    ({"num_shared_experts": True}, "num_shared_experts"),
    ({"shared_d_ff": -8, "num_shared_experts": 1}, "shared_d_ff"),
    ({"capacity_factor": float("inf")}, "capacity_factor"),
    ({"capacity_factor": True}, "capacity_factor"),
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
    ({"routed_scaling_factor": -2.5}, "routed_scaling_factor"),
    ({"swiglu_limit": float("nan")}, "swiglu_limit"),
    ({"swiglu_limit": -7.0}, "swiglu_limit"),
    ({"swiglu_alpha": float("nan")}, "swiglu_alpha"),
    ({"swiglu_alpha": 0.0}, "swiglu_alpha"),
    ({"init_scale": float("inf")}, "init_scale"),
    ({"router_dtype": "float16"}, "router_dtype"),
    ({"router": "topk_softmax", "score_correction_bias": True}, "score_correction_bias"),
    ({"router": "expert_choice", "top_k": 9}, "top_k"),
]


@pytest.mark.parametrize("changes,field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_config_raises_naming_field_and_value(changes, field):
    with pytest.raises(ValueError) as err:
        moejax.MoEConfig(**{**BASE, **changes})
    message = str(err.value)
    assert f"MoEConfig.{field}=" in message
    assert repr(changes[field]) in message


@pytest.mark.parametrize(
    "changes",
    [
        {"swiglu_limit": float("inf")},  # no clamp
        {"router": "sigmoid", "num_groups": 4, "topk_groups": 4, "top_k": 8},
        {"num_shared_experts": 0, "shared_d_ff": 8},
        {"router_dtype": "float64"},
        {"capacity_factor": 1, "expert_capacity": 1},
    ],
)
def test_valid_edge_configs_construct(changes):
    moejax.MoEConfig(**{**BASE, **changes})


def test_config_is_frozen_and_replace_validates():
    cfg = moejax.MoEConfig(**BASE)
    with pytest.raises(AttributeError):
        cfg.top_k = 3
    assert cfg.replace(top_k=1).top_k == 1
    with pytest.raises(ValueError, match="top_k"):
        cfg.replace(top_k=100)


def test_capacity_rounds_up_and_absolute_capacity_wins():
    cfg = moejax.MoEConfig(**BASE, capacity_factor=1.25)
    assert cfg.capacity(100) == 32  # ceil(1.25 * 100 * 2 / 8) = ceil(31.25)
    assert cfg.replace(expert_capacity=7).capacity(100) == 7


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_builds(name):
    cfg = presets.PRESETS[name](d_model=16, d_ff=32, num_experts=16, top_k=4)
    assert cfg.num_experts == 16
