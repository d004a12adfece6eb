"""Simulator strategies and the public surface."""

import ast
import pathlib

import numpy as np
import pytest

import moejax.placement as placement
from moejax.placement import H100_IB, TPU_V5P_ICI, Placement, Workload, zipf
from moejax.placement.simulate import compare, run_static, shadow_placement, summarize
from moejax.placement.traces import zipf_exponent_for

WL = Workload(tokens_per_device=512, top_k=2, d_model=1024, d_ff=1024)


def test_public_names_import():
    for name in placement.__all__:
        assert getattr(placement, name) is not None, name
    assert set(placement.__all__) >= {"Placement", "plan", "PlacementController", "H100_IB"}


def test_placement_package_never_imports_jax():
    root = pathlib.Path(placement.__file__).parent
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(
                n == "jax" or n.startswith(("jax.", "flax", "moejax._")) for n in names
            ), (
                path.name,
                names,
            )


def test_shadow_placement_uses_spare_slots():
    base = Placement.identity(8, 4, 4)
    counts = np.array([1, 50, 2, 3, 40, 5, 6, 7])
    shadow = shadow_placement(base, counts, 2)
    assert shadow.device_table()[:, 2:].tolist() == [[1, 4]] * 4
    assert shadow.device_table()[:, :2].tolist() == base.device_table()[:, :2].tolist()
    with pytest.raises(ValueError, match="k must lie in \\[0, 2\\], got 3"):
        shadow_placement(base, counts, 3)


@pytest.mark.parametrize("hw", [H100_IB, TPU_V5P_ICI])
def test_controller_beats_static_on_skew(hw):
    n, e = 8, 16
    trace = zipf(300, e, n * WL.rows_per_step, s=zipf_exponent_for(e, 4.0), seed=0)
    results = compare(trace, n, 3, hw, WL)
    rows = {r["method"]: r for r in summarize(results)}
    assert rows["static"]["speedup"] == 1.0
    assert rows["controller"]["speedup"] >= 1.3
    # This small workload's replica gradient sync is large next to its work; charged in the
    # totals, it keeps the gap above 10%. Without it (compute + all-to-all) the gap is < 10%.
    ctl_row = rows["controller"]
    assert (1.0 + ctl_row["gap"]) * (1.0 - ctl_row["replica_sync"]) - 1.0 < 0.10
    assert rows["perfect"]["gap"] == 0.0
    for name in ("static", "shadowing", "controller"):
        assert results[name].total_s >= results["perfect"].total_s * 0.99
    ctl = results["controller"]
    assert ctl.replacements == 1
    assert ctl.overhead_fraction == pytest.approx(
        (ctl.decision_wall_s + ctl.migration_s) / ctl.total_s
    )


def test_static_totals_are_per_step_sums():
    trace = zipf(5, 8, 1000, num_layers=2, seed=0)
    r = run_static(trace, Placement.identity(8, 4, 2), H100_IB, WL)
    assert r.step_s.shape == (5,) and r.total_s == pytest.approx(r.step_s.sum())
    assert r.overhead_fraction == 0.0


def test_docstring_examples_run():
    import doctest

    from moejax.placement import controller, planner, table

    for module in (placement, table, planner, controller):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_controller_close_to_perfect_on_drifting_trace_at_scale():
    # The targets on the modeled drifting trace (hot set rotates every 50 steps) at
    # N = 64: >= 1.3x over static and within 10% of perfect balance, migration included.
    from moejax.placement import drifting_zipf

    n, e, wl = 64, 128, Workload()
    trace = drifting_zipf(
        200, e, n * wl.rows_per_step, s=zipf_exponent_for(e, 4.0), shift_every=50, seed=0
    )
    rows = {r["method"]: r for r in summarize(compare(trace, n, 3, H100_IB, wl))}
    ctl = rows["controller"]
    # Replica gradient sync is charged in the totals (``replica_sync``, its share); the 10%
    # target holds on compute + all-to-all + migration, not with the sync (BENCHMARKS.md).
    assert ctl["speedup"] >= 1.3 and ctl["replica_sync"] > 0.0
    assert (1.0 + ctl["gap"]) * (1.0 - ctl["replica_sync"]) - 1.0 < 0.10
    assert ctl["migration"] < 0.02
    assert ctl["replacements"] == 4  # one per phase, no refinements


def test_many_experts_on_few_devices_plan_in_seconds(tmp_path):
    """The probe's hang: 65,536 experts on 8 devices (8,193 slots each) never finished its first
    controller decision. Every pair re-split tried all S^2 single swaps (a [S^2, 2S] mask and
    matmul per pass) and the differencing start re-sorted its S parts each round; at 4,096
    experts on 8 devices (S = 513) the decision took 236 s on the development VM, now 0.24 s
    (65,536 experts: about 6 s)."""
    import json

    from moejax.cli import simulate_placement

    rng = np.random.default_rng(0)
    p = rng.zipf(1.5, 4096).astype(float)
    trace = rng.multinomial(8 * 8192 * 8, p / p.sum(), size=(4, 1)).astype(np.int64)
    np.save(tmp_path / "trace.npy", trace)
    argv = ["--trace", str(tmp_path / "trace.npy"), "--devices", "8", "--out", str(tmp_path)]
    assert simulate_placement.main(argv) == 0
    rows = json.loads((tmp_path / "placement.json").read_text())["rows"]
    controller = next(r for r in rows if r["method"] == "controller")
    assert controller["replacements"] == 1  # it did decide (and re-place) within the 4 steps
    assert controller["host_s"] < 20.0, controller


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--devices", "0"], "argument --devices: 0: need an integer >= 1"),
        (["--devices", "-8"], "argument --devices: -8: need an integer >= 1"),
        (["--steps", "0"], "argument --steps: 0: need an integer >= 1"),
        (["--spare", "-1"], "argument --spare: -1: need an integer >= 0"),
        (["--hot-ratio", "nan"], "--hot-ratio=nan / --devices: hot_ratio must lie in (1, 16)"),
        (["--hot-ratio", "0"], "--hot-ratio=0.0 / --devices: hot_ratio must lie in (1, 16)"),
    ],
)
def test_simulate_placement_flag_errors_are_one_line(argv, says, capsys, tmp_path):
    """Each was a traceback (a ValueError of the trace generator or the cost model)."""
    from moejax.cli import simulate_placement

    with pytest.raises(SystemExit) as exit_:
        devices = [] if "--devices" in argv else ["--devices", "8"]
        simulate_placement.main([*argv, *devices, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not list(tmp_path.iterdir())


def test_replay_placement_errors_are_one_line(capsys, tmp_path):
    """A run directory whose controller spec is not JSON, or whose trace is junk, and a
    `--window 0`: one line each, exit 2 (were tracebacks, or accepted)."""
    from moejax.cli import replay_placement

    (tmp_path / "placement_controller.json").write_text("{bad")
    (tmp_path / "routing_trace.npy").write_text("junk")
    for argv, says in (
        ([str(tmp_path)], "placement_controller.json: cannot be read"),
        ([str(tmp_path), "--window", "0"], "argument --window: 0: need an integer >= 1"),
    ):
        with pytest.raises(SystemExit) as exit_:
            replay_placement.main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
