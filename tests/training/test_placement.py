"""Dynamic expert placement in training: re-placing experts never changes what is trained.

The reference is the same run without placement (experts in logical order). A scripted
controller re-places every MoE layer every few steps with random layouts (hot and cold experts
replicated, experts moved across devices), so every mechanism runs many times: physical slots,
the even split of rows over replicas, combined replica gradients, the logical clipping norm, and
the migration of parameters and Adam moments.
"""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
from _helpers import MODEL, TRAIN, corpus, host_tree, mesh

from moejax.cli import replay_placement
from moejax.placement import (
    H100_NVLINK,
    ControllerConfig,
    Decision,
    Placement,
    PlacementController,
    Workload,
    save_trace,
)
from moejax.placement.controller import SPEC_FILE
from moejax.placement.decision import OUTCOMES
from moejax.placement.replay import replay
from moejax.training import SetupError, placed, report, train
from moejax.training.placement_runtime import mean_fall, measured_effect, read_events

STEPS, EVERY, SLOTS = 54, 4, 3
BASE = TRAIN.replace(steps=STEPS, warmup_steps=5, checkpoint_every=0, eval_batches=0)
PLACED = BASE.replace(expert_slots_per_device=SLOTS)


class ScriptedController:
    """Re-places every layer every `every` observed steps, at random (a seeded stream)."""

    def __init__(self, placements, every=EVERY, seed=0):
        self.placements = list(placements)
        self.every = every
        self.rng = np.random.default_rng(seed)

    def _random(self, p: Placement) -> Placement:
        extra = self.rng.integers(0, p.num_experts, p.num_slots - p.num_experts)
        table = np.concatenate([np.arange(p.num_experts), extra])
        self.rng.shuffle(table)
        return p.with_table(table)

    def observe(self, step, counts):
        assert counts.shape == (MODEL.num_moe_layers, MODEL.moe.num_experts)
        if step % self.every:
            return []
        out = []
        for layer, old in enumerate(self.placements):
            new = self._random(old)
            out.append(Decision(step, layer, old, new, 0.0, 0, 0.0, True, "scripted"))
            self.placements[layer] = new
        return out


def _close(got, want):
    # Relative to each tensor's scale: parameters near zero carry no relative precision.
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)


def _run(run_dir, cfg, controller=None, stop_at=None, m=None):
    return train(
        MODEL,
        cfg,
        corpus(),
        run_dir=str(run_dir),
        mesh=m or mesh(),
        progress=False,
        outputs=False,
        tensorboard=False,
        async_checkpoints=False,
        controller=controller,
        stop_at=stop_at,
    )


def _logical_params(result, cfg):
    state = result.state
    if cfg.expert_slots_per_device:
        state = placed.to_logical(state, result.placements, MODEL, cfg, mesh())
    return host_tree(state.params)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("reference"), BASE)


@pytest.fixture(scope="module")
def replaced(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("replaced"), PLACED, controller=ScriptedController)


def test_training_with_replacements_every_few_steps_equals_training_without(reference, replaced):
    assert replaced.step == reference.step == STEPS
    events = read_events(replaced.run_dir)
    assert len(events) == MODEL.num_moe_layers * ((STEPS - 2) // EVERY)
    assert {e["layer"] for e in events} == set(range(MODEL.num_moe_layers))
    losses = lambda r: np.array([rec["loss"] for rec in r.records])
    # fp32: an expert's weight gradient is summed in another order when its rows are split over
    # replicas on several devices; those last-bit differences are all that may separate the runs.
    np.testing.assert_allclose(losses(replaced), losses(reference), rtol=1e-5)
    got, want = _logical_params(replaced, PLACED), _logical_params(reference, BASE)
    jax.tree.map(lambda a, b: _close(a, b), got, want)


def test_replicas_stay_identical_bit_for_bit(replaced):
    layout = replaced.placements
    assert [e["new"] for e in read_events(replaced.run_dir)[-2:]] == [
        p.slot_to_expert.tolist() for p in layout
    ]
    assert any(p.expert_replica_counts().max() > 1 for p in layout)
    params = host_tree(replaced.state.params)
    opt = host_tree(replaced.state.opt_state)
    moments = [leaf for leaf in jax.tree.leaves(opt) if leaf.ndim == 3]  # [P, D, F] expert moments
    assert moments
    for j, i in enumerate(MODEL.moe_layers):
        p = layout[j]
        for name, w in params["layers"][i]["moe"]["experts"].items():
            assert w.shape[0] == p.num_slots, name
            for e in range(p.num_experts):
                slots = p.replicas_of(e)
                for s in slots[1:]:
                    np.testing.assert_array_equal(w[s], w[slots[0]], err_msg=f"{name} e={e}")


def test_checkpoint_restores_across_placements(reference, replaced, tmp_path):
    # A checkpoint written mid-run by the re-placing run continues (a) without placement and
    # (b) with another slot count; both finish like the reference run.
    half = STEPS // 2
    first = _run(tmp_path / "a", PLACED, controller=ScriptedController, stop_at=half)
    assert first.step == half
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    plain = _run(tmp_path / "a", BASE)
    wider = PLACED.replace(expert_slots_per_device=SLOTS + 1)
    other = _run(tmp_path / "b", wider, controller=ScriptedController)
    want = _logical_params(reference, BASE)
    for result, cfg in ((plain, BASE), (other, wider)):
        assert result.step == STEPS and result.steps_this_run == STEPS - half
        got = _logical_params(result, cfg)
        jax.tree.map(lambda a, b: _close(a, b), got, want)


SKEW = ControllerConfig(
    decide_every=2, patience=1, min_interval=4, min_relative_gain=0.02, forecast_window=3
)
REAL = PLACED.replace(steps=16, warmup_steps=2)


# Fixed figures: on CPU the default ("auto") times this mesh, and timings differ from run to run,
# so two runs (the whole one and the resumed one) could decide differently. Compute-bound ones
# (an H100 at 1/10^4 of its FLOP/s): at micro's size on H100 figures a replica's gradient sync
# costs about what balance saves, so whether a layer is re-placed at all hangs on the last bits
# of its routing (jax 0.12 re-placed one layer once in 16 steps where 0.10.2 re-placed three
# times); with balance dominating, both re-place 4-6 times, after the resume cuts too.
COMPUTE_BOUND = dataclasses.replace(
    H100_NVLINK, name="compute-bound", flops_per_s=H100_NVLINK.flops_per_s / 1e4
)


def _real_factory():
    return placed.controller_factory(
        MODEL, PLACED, mesh(), MODEL.max_seq_len, config=SKEW, hardware=COMPUTE_BOUND
    )


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("real"), REAL, controller=_real_factory())


def test_real_controller_logs_predictions_and_measurements(real):
    result = real
    events = read_events(result.run_dir)
    summary = result.placement
    assert events, "micro's early routing is skewed enough to re-place (see the controller log)"
    assert summary["replacements"] == len(events)
    assert summary["decision_wall_s"] >= 0 and summary["overhead_fraction"] < 1
    for e in events:
        assert e["imbalance_after"] < e["imbalance_before"]
        assert e["predicted_gain_s"] > 0 and e["bytes_moved"] > 0 and e["migration_wall_s"] > 0
    rows = measured_effect(result.records, events, window=3)
    assert len(rows) == len(events)
    assert all(r["measured_before"] >= 1 and r["measured_after"] >= 1 for r in rows)
    by_step = {r["step"]: r for r in result.records}
    for e, row in zip(events, rows, strict=True):
        # The controller's per-step prediction, and the old table on the steps after the event.
        assert e["per_step_before"] >= 1 and e["per_step_after"] >= 1
        # The calibrated forecast scales the in-sample fall by the realized share so far.
        r, fall = e["realized_ratio"], e["per_step_before"] - e["per_step_after"]
        assert e["forecast_before"] == e["per_step_before"]
        np.testing.assert_allclose(e["forecast_after"], e["per_step_before"] - r * fall, rtol=1e-12)
        old = Placement(np.array(e["old"]), MODEL.moe.num_experts, e["num_devices"], SLOTS)
        t = e["applied_after_step"]
        steps = [s for s in range(t + 1, t + 4) if s in by_step]
        if steps:
            want = np.mean([old.imbalance(by_step[s]["expert_counts"][e["layer"]]) for s in steps])
            np.testing.assert_allclose(row["counterfactual_before"], want, rtol=1e-12)
    # Later events are forecast with the realized share of earlier ones (measured 3 steps).
    assert any(e["realized_ratio"] != 1.0 for e in events)
    full = [r for r in rows if r["counterfactual_before"] is not None]
    fall = mean_fall(rows)
    assert fall["fall_events"] == len(full) > 0
    want = np.mean([r["counterfactual_before"] - r["measured_after"] for r in full])
    np.testing.assert_allclose(fall["counterfactual_fall"], want, rtol=1e-12)
    want = np.mean([r["forecast_before"] - r["forecast_after"] for r in full])
    np.testing.assert_allclose(fall["predicted_fall"], want, rtol=1e-12)
    want = np.mean([r["per_step_before"] - r["per_step_after"] for r in full])
    np.testing.assert_allclose(fall["in_sample_fall"], want, rtol=1e-12)
    assert summary.keys() >= {"replacements", "overhead_fraction"}
    path = real.run_dir + "/placement_forecast.png"
    report.plot_placement_forecast(rows, path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_every_check_is_logged_and_the_summary_says_why_a_layer_stayed(real):
    # placement_decisions.jsonl: accepted and declined checks alike, each with its reason; the
    # accepted ones are the re-placements, each with a forecast gain that repays its migration.
    with open(os.path.join(real.run_dir, "placement_decisions.jsonl")) as f:
        decisions = [json.loads(line) for line in f]
    events = read_events(real.run_dir)
    accepted = [d for d in decisions if d["accepted"]]
    assert [(d["step"], d["layer"]) for d in accepted] == [(e["step"], e["layer"]) for e in events]
    assert len(decisions) > len(accepted) > 0
    assert all(d["outcome"] in OUTCOMES and d["reason"] for d in decisions)
    for d in accepted:
        assert d["forecast_after"] < d["forecast_before"] or d["forecast_gain_s"] > 0
        assert d["forecast_gain_s"] * SKEW.horizon_steps > d["modeled_migration_s"]
    summary = real.placement
    assert sum(summary["checks"].values()) == len(decisions)
    assert summary["checks"]["accepted"] == len(events)
    moved = {e["layer"] for e in events}
    stayed = [d["layer"] for d in summary["never_replaced"]]
    assert stayed == [j for j in range(MODEL.num_moe_layers) if j not in moved]
    for row in summary["never_replaced"]:
        last = [d for d in decisions if d["layer"] == row["layer"]][-1]
        assert (row["step"], row["reason"]) == (last["step"], last["reason"])
    rows = dict(report.summary_rows(real))
    assert rows["placement checks"].startswith(f"{len(decisions)}: ")
    assert rows["migrations, priced / measured"].endswith(" in all")


# 7: the checkpoint holds a re-placement just applied; 9: one followed (steps 8-10), unmeasured.
@pytest.mark.parametrize("stop", [7, 9])
def test_resumed_controller_decides_as_if_never_stopped(real, tmp_path, stop):
    # The checkpoint holds the controller's state and the counts it had not seen yet: the
    # resumed run re-places at the same steps with the same tables, and ends equal.
    cfg = REAL.replace(checkpoint_every=4)
    first = _run(tmp_path, cfg, controller=_real_factory(), stop_at=stop)
    assert first.step == stop
    resumed = _run(tmp_path, REAL, controller=_real_factory())
    assert resumed.steps_this_run == REAL.steps - stop
    fields = ("step", "applied_after_step", "layer", "old", "new", "per_step_before")
    got = [{k: e[k] for k in fields} for e in read_events(str(tmp_path))]
    want = [{k: e[k] for k in fields} for e in read_events(real.run_dir)]
    assert got == want

    def checks(run_dir):
        with open(os.path.join(run_dir, "placement_decisions.jsonl")) as f:
            return [json.loads(line) for line in f]

    assert checks(str(tmp_path)) == checks(real.run_dir)  # every check, once
    assert any(e["applied_after_step"] > stop for e in want), "a re-placement after the cut"
    losses = lambda r: [rec["loss"] for rec in r.records]
    assert losses(resumed) == losses(real)
    jax.tree.map(
        np.testing.assert_array_equal,
        _logical_params(resumed, REAL),
        _logical_params(real, REAL),
    )


def test_replay_of_the_run_makes_its_decisions(real, tmp_path, capsys):
    # The run wrote its controller's spec; fed the run's own counts the way the loop fed them,
    # the rebuilt controller makes the same re-placements with the same forecasts.
    with open(os.path.join(real.run_dir, SPEC_FILE)) as f:
        spec = json.load(f)
    trace = np.array([r["expert_counts"] for r in real.records], np.int64)
    result = replay(PlacementController.from_spec(spec), trace)
    recorded = read_events(real.run_dir)
    fields = ("step", "applied_after_step", "layer", "old", "new", "bytes_moved")
    assert [{k: e[k] for k in fields} for e in result.events] == [
        {k: e[k] for k in fields} for e in recorded
    ]
    for key in ("forecast_before", "forecast_after", "per_step_after", "realized_ratio"):
        np.testing.assert_allclose([e[key] for e in result.events], [e[key] for e in recorded])
    np.testing.assert_allclose(
        result.placed_imbalance, [r["device_imbalance"] for r in real.records], rtol=1e-6
    )
    # The script on a copy of the run with its trace (train writes it with its outputs).
    run = tmp_path / "run"
    shutil.copytree(real.run_dir, run)
    save_trace(str(run / "routing_trace.npy"), trace)
    assert replay_placement.main([str(run), "--phases", "8"]) == 0
    out = capsys.readouterr().out
    assert f"recorded re-placements: {len(recorded)}; replayed: {len(recorded)}" in out
    assert "same decisions: yes" in out and "1-8 " in out
    assert replay_placement.main([str(run), "--set", "react_steps=3"]) == 0
    assert "same decisions" not in capsys.readouterr().out  # other knobs: nothing to match


def test_measured_hardware_figures():
    workload = Workload(tokens_per_device=64, top_k=2, d_model=32, d_ff=64, activation_bytes=4)
    hw = placed.measure_hardware(mesh(), workload, repeats=2)
    assert hw.name == "measured" and hw.devices_per_node == 1
    for figure in (hw.flops_per_s, hw.link_bytes_per_s):
        assert np.isfinite(figure) and figure > 0
    with pytest.raises(ValueError, match="expert axis of >= 2, got 1"):
        placed.measure_hardware(mesh((8, 1)), workload)
    factory = placed.controller_factory(MODEL, PLACED, mesh(), 16, hardware="measured")
    assert factory(placed.initial_placements(MODEL, PLACED, mesh())).hardware.name == "measured"
    with pytest.raises(ValueError, match="HardwareModel, 'auto' or 'measured', got 'h200'"):
        placed.controller_factory(MODEL, PLACED, mesh(), 16, hardware="h200")


def test_auto_hardware_is_measured_on_cpu_and_the_summary_says_which_figures(tmp_path):
    # "auto" (the default): a CPU mesh is timed (H100 figures price a CPU migration 10^4x low);
    # with no expert axis to time it falls back to the H100 datasheet.
    initial = placed.initial_placements(MODEL, PLACED, mesh())
    auto = placed.controller_factory(MODEL, PLACED, mesh(), 16)(initial)
    assert auto.hardware.name == "measured" and auto.config == placed.TRAINING_CONTROLLER
    flat, cfg = mesh((8, 1)), PLACED.replace(expert_slots_per_device=MODEL.moe.num_experts)
    one = placed.initial_placements(MODEL, cfg, flat)
    assert placed.controller_factory(MODEL, cfg, flat, 16)(one).hardware == H100_NVLINK
    rows = dict(
        report._placement_rows(
            {"hardware": dataclasses.asdict(H100_NVLINK), "platform": "cpu", "replacements": 0}
            | {"decision_wall_s": 0.0, "migration_wall_s": 0.0, "overhead_fraction": 0.0}
        )
    )
    assert rows["placement cost model"].startswith(
        "h100-nvlink datasheet, not this cpu mesh's (--placement-hardware measured): 989,000.0"
    )
    measured = dataclasses.asdict(auto.hardware)
    rows = dict(
        report._placement_rows(
            {"hardware": measured, "platform": "cpu", "replacements": 0}
            | {"decision_wall_s": 0.0, "migration_wall_s": 0.0, "overhead_fraction": 0.0}
        )
    )
    assert rows["placement cost model"].startswith("measured on this cpu mesh at start: ")


def test_controller_factory_charges_the_steps_replica_sync():
    # No `replica_sync_overlap=1` shortcut: the controller charges the packed all-reduce that
    # `combine_replica_grads` runs, all of it.
    wl = placed.controller_factory(MODEL, PLACED, mesh(), 16).keywords["workload"]
    assert wl.replica_sync == "packed" and wl.replica_sync_overlap == 0.0


def test_placement_setup_errors(tmp_path):
    with pytest.raises(SetupError, match="expert_slots_per_device=1"):
        _run(tmp_path / "few", PLACED.replace(expert_slots_per_device=1))
    with pytest.raises(ValueError, match="expert_slots_per_device > 0"):
        _run(tmp_path / "off", BASE, controller=ScriptedController)
    assert not os.path.exists(tmp_path / "off" / "metrics.jsonl")
