"""The placement controller and simulator on degenerate traces: all-zero layers and steps,
every row on one expert, one step. Each gets a defined result, never a ZeroDivisionError (the
probe's `simulate_placement.py` crash on a trace with an all-zero layer)."""

import math

import numpy as np
import pytest

from moejax.cli import simulate_placement
from moejax.placement import (
    H100_IB,
    ControllerConfig,
    Placement,
    PlacementController,
    Workload,
    zipf,
)
from moejax.placement.simulate import compare, summarize
from moejax.placement.traces import zipf_exponent_for

N, E, S = 8, 16, 3
WL = Workload(tokens_per_device=512, top_k=2, d_model=1024, d_ff=1024)
TOKENS = N * WL.rows_per_step


def _observe(trace):
    base = Placement.identity(E, N, S)
    ctl = PlacementController([base] * trace.shape[1], H100_IB, WL, ControllerConfig())
    for t in range(trace.shape[0]):
        ctl.observe(t, trace[t])
    return ctl


def test_an_all_zero_layer_is_left_alone_and_the_other_balanced():
    trace = zipf(200, E, TOKENS, s=zipf_exponent_for(E, 4.0), num_layers=2, seed=0)
    trace[:, 1, :] = 0  # layer 1 routes nothing (e.g. a layer whose tokens all dropped)
    ctl = _observe(trace)
    zero = [d for d in ctl.log if d.layer == 1]
    assert zero and all(not d.accepted for d in zero)
    assert all(d.reason == "no rows routed to this layer: nothing to balance" for d in zero)
    assert all(d.outcome == "no_rows" and not d.accepted for d in zero)
    assert [d.layer for d in ctl.accepted] == [0]  # the skewed layer is still re-placed
    assert ctl.placements[1] == Placement.identity(E, N, S)


def test_an_all_zero_trace_then_real_rows():
    """Steps without rows first (warm-up, a paused data loader), then a skewed load: the
    controller waits, then reacts."""
    trace = zipf(200, E, TOKENS, s=zipf_exponent_for(E, 4.0), seed=1)
    trace[:100] = 0
    ctl = _observe(trace)
    assert all(not d.accepted for d in ctl.log if d.step < 100)
    assert ctl.accepted and ctl.accepted[0].step >= 100


def test_every_row_on_one_expert():
    trace = np.zeros((100, 1, E), np.int64)
    trace[:, 0, 5] = TOKENS
    ctl = _observe(trace)
    assert ctl.accepted  # the hot expert is replicated into the spare slots
    new = ctl.placements[0]
    assert int(np.sum(new.slot_to_expert == 5)) > 1
    assert new.imbalance(trace[0, 0]) < Placement.identity(E, N, S).imbalance(trace[0, 0])


@pytest.mark.parametrize("kind", ["all-zero", "zero-layer", "one-step"])
def test_simulator_results_are_defined(kind):
    steps = 1 if kind == "one-step" else 60
    trace = zipf(steps, E, TOKENS, s=zipf_exponent_for(E, 4.0), num_layers=2, seed=2)
    if kind == "all-zero":
        trace[:] = 0
    elif kind == "zero-layer":
        trace[:, 1] = 0
    rows = {r["method"]: r for r in summarize(compare(trace, N, S, H100_IB, WL))}
    for r in rows.values():
        for key in ("step_ms", "speedup", "gap", "overhead", "migration", "replica_sync"):
            assert not math.isnan(r[key]), (kind, r)
    if kind == "all-zero":  # nothing routed: no method but shadowing (its sync) models time
        for name in ("static", "controller", "perfect"):
            assert rows[name]["step_ms"] == 0.0 and rows[name]["speedup"] == 1.0
            assert rows[name]["gap"] == 0.0 and rows[name]["migration"] == 0.0
        assert rows["static"]["overhead"] == 0.0
        assert rows["controller"]["overhead"] == math.inf  # host time spent, none modeled
        assert rows["shadowing"]["speedup"] == 0.0 and rows["shadowing"]["gap"] == math.inf
    else:
        assert rows["perfect"]["gap"] == 0.0 and rows["static"]["speedup"] == 1.0


def _simulate_main(capsys, *args):
    try:
        code = simulate_placement.main([*map(str, args)])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr()


def test_simulate_placement_command_on_degenerate_traces(tmp_path, capsys):
    zero = np.random.default_rng(0).integers(0, 100, (20, 2, E))
    zero[:, 1] = 0
    np.save(tmp_path / "zero_layer.npy", zero)
    code, printed = _simulate_main(
        capsys, "--trace", tmp_path / "zero_layer.npy", "--devices", N,
        "--out", tmp_path / "out",
    )  # fmt: skip
    assert code == 0 and "zero_layer.npy" in printed.out, printed.err[-2000:]
    np.save(tmp_path / "empty.npy", np.zeros((0, 1, E), np.int64))
    code, printed = _simulate_main(
        capsys, "--trace", tmp_path / "empty.npy", "--out", tmp_path / "out"
    )
    assert code == 2 and printed.err.count("\n") == 1
    assert "must have shape [steps, L, E], got (0, 1, 16)" in printed.err
