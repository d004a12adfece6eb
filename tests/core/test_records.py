"""`moejax.record_to_json` / `record_from_json`: every config record moejax writes to disk
round-trips with `==`, nested records rebuilt from the annotations alone; files written before a
field existed, or under a field's old name, still read; a key that names no field is refused."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

import moejax
from moejax import MoEConfig
from moejax.models import LMConfig, MLAConfig, RopeScaling
from moejax.models import presets as lm_presets
from moejax.placement import ControllerConfig, HardwareModel, Workload
from moejax.records import flatten, unflatten
from moejax.training import presets as train_presets


def _round_trip(record):
    text = json.dumps(moejax.record_to_json(record), allow_nan=False)  # strict JSON
    return moejax.record_from_json(type(record), json.loads(text))


@pytest.mark.parametrize("name", sorted(lm_presets.PRESETS))
def test_lm_presets_round_trip(name):
    cfg = lm_presets.get(name)
    assert _round_trip(cfg) == cfg
    # the checkpoint metadata's layout: flattened to dotted keys and back
    flat = flatten(json.loads(json.dumps(moejax.record_to_json(cfg))))
    assert moejax.record_from_json(LMConfig, unflatten(flat)) == cfg


@pytest.mark.parametrize("name", sorted(moejax.presets.PRESETS))
def test_moe_presets_round_trip(name):
    cfg = moejax.presets.PRESETS[name](d_model=64, d_ff=32, num_experts=16)
    assert _round_trip(cfg) == cfg


@pytest.mark.parametrize("name", sorted(train_presets.TRAIN_PRESETS))
def test_train_presets_round_trip(name):
    cfg = train_presets.get(name)
    assert _round_trip(cfg) == cfg


def test_placement_records_round_trip():
    hardware = HardwareModel("h100", 989e12, 50e9, devices_per_node=8, node_link_bytes_per_s=450e9)
    workload = Workload(tokens_per_device=4096, top_k=2, d_model=1024, d_ff=2048)
    for record in (ControllerConfig(), hardware, workload):
        assert _round_trip(record) == record


def test_nested_records_and_tuples_are_rebuilt():
    cfg = lm_presets.get("deepseek_v3_4l")
    back = _round_trip(cfg)
    assert isinstance(back.mla, MLAConfig) and isinstance(back.rope_scaling, RopeScaling)
    assert isinstance(back.moe, MoEConfig) and isinstance(back.mlp_layer_types, tuple)


def test_nonfinite_floats_are_strict_json():
    @dataclasses.dataclass(frozen=True)
    class Budget:
        seconds: float = math.inf
        floor: float | None = -math.inf

    obj = moejax.record_to_json(Budget())
    assert obj == {"seconds": "inf", "floor": "-inf"}
    assert moejax.record_from_json(Budget, obj) == Budget()


def test_older_files_read():
    """A model written before later fields existed (no `mla`, `partial_rotary_factor`, ...) and
    with `MoEConfig.dispatch` (renamed `drop_policy`) reads with the defaults."""
    cfg = lm_presets.get("tiny")
    obj = moejax.record_to_json(cfg)
    for later in ("mla", "partial_rotary_factor", "attention_sinks", "layer_types", "mtp_layers"):
        del obj[later]
    obj["moe"]["dispatch"] = obj["moe"].pop("drop_policy")
    assert moejax.record_from_json(LMConfig, obj) == cfg


def test_unknown_and_missing_keys_are_refused():
    obj = moejax.record_to_json(lm_presets.get("tiny"))
    obj["moe"]["expert_colour"] = "blue"
    with pytest.raises(ValueError, match=r"LMConfig\.moe: no field 'expert_colour'"):
        moejax.record_from_json(LMConfig, obj)
    with pytest.raises(TypeError):
        moejax.record_from_json(MoEConfig, {"d_model": 8})
    with pytest.raises(ValueError, match="expected a JSON object"):
        moejax.record_from_json(LMConfig, [1, 2])
    with pytest.raises(TypeError, match="not a dataclass instance"):
        moejax.record_to_json({"d_model": 8})


def test_a_value_the_record_refuses_is_its_own_error():
    obj = moejax.record_to_json(lm_presets.get("tiny"))
    obj["num_heads"] = 0
    with pytest.raises(ValueError, match="num_heads"):
        moejax.record_from_json(LMConfig, obj)
