"""Replay of routing traces through a controller rebuilt from its spec, as training feeds it."""

import dataclasses
import json

import numpy as np
import pytest

from moejax.placement import (
    H100_NVLINK,
    ControllerConfig,
    Placement,
    PlacementController,
    Workload,
    drifting_zipf,
)
from moejax.placement.replay import replay

WL = Workload(tokens_per_device=256, top_k=2, d_model=256, d_ff=512)
CONFIG = ControllerConfig(decide_every=2, patience=1, min_interval=4, forecast_window=3)


def _controller(config=CONFIG, layers=2):
    return PlacementController([Placement.identity(8, 4, 3)] * layers, H100_NVLINK, WL, config)


def _trace(steps=60, layers=2, seed=0):
    return drifting_zipf(
        steps, 8, 4 * WL.rows_per_step, s=1.2, shift_every=15, num_layers=layers, seed=seed
    )


def test_spec_round_trips_through_json_and_decides_the_same():
    spec = json.loads(json.dumps(_controller().spec()))
    trace = _trace()
    a, b = replay(_controller(), trace), replay(PlacementController.from_spec(spec), trace)
    assert a.events, "a drifting Zipf trace must make the controller re-place"
    assert [(e["applied_after_step"], e["layer"], e["new"]) for e in a.events] == [
        (e["applied_after_step"], e["layer"], e["new"]) for e in b.events
    ]
    np.testing.assert_array_equal(a.placed_imbalance, b.placed_imbalance)


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_decisions_run_from_step_seen_plus_lag(lag):
    trace = _trace()
    result = replay(_controller(dataclasses.replace(CONFIG, apply_lag=lag)), trace)
    assert result.events
    for e in result.events:
        assert e["applied_after_step"] == e["step"] + lag - 1
        t, layer = e["applied_after_step"], e["layer"]
        new = Placement(np.array(e["new"]), 8, e["num_devices"], 3)
        old = Placement(np.array(e["old"]), 8, e["num_devices"], 3)
        # Step t (row t - 1) ran on the old table, step t + 1 on the new one.
        assert result.placed_imbalance[t - 1, layer] == old.imbalance(trace[t - 1, layer])
        if t < len(trace):
            assert result.placed_imbalance[t, layer] == new.imbalance(trace[t, layer])
    rec = result.records[4]
    assert rec["step"] == 5 and rec["expert_counts"] == trace[4].tolist()
    static = Placement.identity(8, 4, 3)
    np.testing.assert_array_equal(
        result.static_imbalance, [[static.imbalance(c) for c in row] for row in trace]
    )


def test_overrides_change_the_knobs_and_unknown_ones_fail():
    spec = _controller().spec()
    assert PlacementController.from_spec(spec, react_steps=1).config.react_steps == 1
    with pytest.raises(ValueError, match="unknown ControllerConfig fields"):
        PlacementController.from_spec(spec, react_stepz=1)
    with pytest.raises(ValueError, match="react_steps"):
        PlacementController.from_spec(spec, react_steps=0)


def test_replay_rejects_a_trace_of_another_shape():
    with pytest.raises(ValueError, match=r"trace must have shape \[steps, 2, 8\]"):
        replay(_controller(), np.ones((5, 3, 8)))


def test_config_overrides_parse_json_values_and_reject_unknown_keys():
    from moejax.placement.replay import config_overrides

    got = config_overrides(["react_steps=1", "react_urgent=null", "ema_decay=0.9"])
    assert got == {"react_steps": 1, "react_urgent": None, "ema_decay": 0.9}
    with pytest.raises(ValueError, match="expected KEY=VALUE, got 'react_steps'"):
        config_overrides(["react_steps"])
    with pytest.raises(ValueError, match="unknown ControllerConfig field 'react'"):
        config_overrides(["react=1"])


def test_replay_cli_names_a_junk_trace_in_one_line(tmp_path, capsys):
    """A run directory whose routing_trace.npy is not an array: one line naming it, exit 2 (a
    traceback of load_trace before)."""
    from moejax.cli import replay_placement
    from moejax.placement.controller import SPEC_FILE

    (tmp_path / SPEC_FILE).write_text(json.dumps(_controller().spec()))
    (tmp_path / "routing_trace.npy").write_text("junk")
    with pytest.raises(SystemExit) as exit_:
        replay_placement.main([str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "routing_trace.npy: " in err, err
