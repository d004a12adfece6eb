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
        }
        for s in range(1, steps + 1)
    ]


def test_plots_keep_the_callers_backend_and_figures(tmp_path):
    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")  # stands for a notebook's inline backend: anything but Agg
        mine = plt.figure()  # the caller's open figure
        records = _records()
        report.plot_loss(records, str(tmp_path / "loss.png"), baseline=3.1, eval_loss=2.5)
        report.plot_expert_load(records, str(tmp_path / "load.png"))
        report.plot_placement_forecast([], str(tmp_path / "forecast.png"))
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == [mine.number]
        plt.close(mine)
    finally:
        matplotlib.use(before)
    for name in ("loss.png", "load.png", "forecast.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
