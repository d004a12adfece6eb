"""The end-of-run plots write PNGs without touching the caller's matplotlib state: its backend
(a notebook's inline one keeps drawing after `train()`) and its open figures."""

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from moejax.training import report


def _records(steps=6, layers=2, experts=4):
    rng = np.random.default_rng(0)
    return [
        {
            "step": s,
            "loss": 3.0 - 0.1 * s,
            "skipped": s == 3,
            "device_imbalance": list(1.0 + rng.random(layers)),
            "expert_counts": rng.integers(0, 10, (layers, experts)).tolist(),
            "dropped_fraction": [0.0] * layers,
        }
        for s in range(1, steps + 1)
    ]


def test_plots_keep_the_callers_backend_and_figures(tmp_path):
    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")  # stands for a notebook's inline backend: anything but Agg
        earlier = plt.get_fignums()  # figures another test in this worker left open
        mine = plt.figure()  # the caller's open figure
        records = _records()
        report.plot_loss(records, str(tmp_path / "loss.png"), baseline=3.1, eval_loss=2.5)
        report.plot_expert_load(records, str(tmp_path / "load.png"))
        report.plot_placement_forecast([], str(tmp_path / "forecast.png"))
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == [*earlier, mine.number]  # none added, none closed
        plt.close(mine)
    finally:
        matplotlib.use(before)
    for name in ("loss.png", "load.png", "forecast.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_a_short_runs_final_loss_and_curve_average_its_last_quarter_only():
    # A 20-step run: the final loss is the mean of its last 5 steps, not of all 20 from step 1
    # (which read 3.35 where the loss ended at 2.7, below the held-out loss).
    assert [report.loss_window(n) for n in (1, 3, 8, 20, 79, 80, 300)] == [1, 1, 2, 5, 19, 20, 20]
    from moejax.training.loop import _result

    class State:
        step = np.int32(20)

    records = [{**r, "loss": 3.0 - 0.05 * r["step"]} for r in _records(steps=20)]
    result = _result("run", State(), 0, records, 2.3, 3.1, 0, 1.0, False)
    assert result.final_loss_steps == 5
    np.testing.assert_allclose(result.final_loss, np.mean([3.0 - 0.05 * s for s in range(16, 21)]))
    # Held out at 2.3: above where training ended, below the mean over the whole short run.
    assert result.final_loss < 2.3 < np.mean([r["loss"] for r in records])
    row = dict(report.summary_rows(result))
    assert row["final train loss (mean of last 5 steps)"] == f"{result.final_loss:.4f} nats"


def test_short_runs_plot_whole_step_ticks_and_label_the_mean_they_draw(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: saved.append(fig))
    records = _records(steps=3)  # matplotlib's own ticks here: 1.00, 1.25, 1.50, ...
    report.plot_loss(records, str(tmp_path / "loss.png"))
    report.plot_expert_load(records, str(tmp_path / "load.png"))
    loss, load = saved
    top, bottom = loss.axes
    assert [t.get_text() for t in top.get_legend().get_texts()][:2] == [
        "train loss",
        "1-step mean",
    ]
    for ax in (bottom, load.axes[0]):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_summary_of_a_run_stopped_before_the_tuners_first_decision():
    """SIGTERM early in a tuned run: the runner reports kind "none" (no decision yet), which
    the summary table names instead of failing on it."""
    tuning = {"chosen": "dropless", "kind": "none", "reason": "the run stopped before the "
              "tuner's first decision", "times": {}, "decisions": 0, "rounds": 0,
              "spent_s": 0.0, "budget_s": 30.0}  # fmt: skip
    rows = dict(report._tuning_rows(tuning))
    assert rows["parallel strategy"] == "dropless (not decided: the run stopped first)"
    assert rows["strategy decision"] == "the run stopped before the tuner's first decision"
