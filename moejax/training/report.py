"""End-of-run outputs: PNG plots (loss curve, per-layer expert-load heatmaps) and the summary
table, all from the per-step records of `moejax.training.metrics`."""

from __future__ import annotations

import math

import numpy as np


def _figure(**kwargs):
    """A matplotlib `Figure` outside pyplot: saving it needs no GUI and leaves the caller's
    backend and open figures alone (a notebook keeps drawing inline after `train()`)."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def loss_window(steps: int) -> int:
    """Steps the final train loss and the loss curve's mean average over: 20, but at most a
    quarter of the run (at least 1), so that a short run's figure is not an average over its
    first steps, far above where its loss ended (a 20-step run averaged from step 1 read 3.35 while
    its loss was 2.7, below its held-out loss)."""
    return max(1, min(20, steps // 4))


def _integer_steps(ax) -> None:
    """Whole-step ticks on the x axis (a short run's would otherwise read 2.5, 3.5, ...)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to `window` values (NaNs ignored)."""
    out = np.empty(len(values))
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        chunk = chunk[np.isfinite(chunk)]
        out[i] = chunk.mean() if len(chunk) else np.nan
    return out


def _series(records, key) -> np.ndarray:
    return np.array([np.nan if r[key] is None else r[key] for r in records], float)


def plot_loss(
    records: list[dict],
    path: str,
    *,
    baseline: float | None = None,
    eval_loss=None,
    events=(),
    switches=(),
):
    """Training loss (raw and its trailing mean over `loss_window` steps, the same window as the
    summary's final loss), the unigram-entropy baseline, the final eval
    loss, skipped steps, the steps where the parallel strategy changed (`switches`: `(step,
    label)`, from `moejax.training.tuning`); below it the device-load imbalance of every MoE
    layer, raw per step and a 10-step average, with expert re-placement `events`
    (`placement_events.jsonl` records) marked where they took effect."""
    steps = np.array([r["step"] for r in records])
    loss = _series(records, "loss")
    fig = _figure(figsize=(9, 7))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    top.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8, label="train loss")
    window = loss_window(len(records))
    top.plot(
        steps, moving_average(loss, window), color="tab:blue", lw=2, label=f"{window}-step mean"
    )
    if baseline is not None:
        top.axhline(baseline, color="gray", ls="--", label=f"unigram entropy {baseline:.2f}")
    if eval_loss is not None:
        top.scatter([steps[-1]], [eval_loss], color="tab:red", zorder=3, label="held-out loss")
    skipped = [r["step"] for r in records if r["skipped"]]
    if skipped:
        top.vlines(skipped, *top.get_ylim(), color="tab:orange", lw=0.8, label="skipped step")
    for i, (step, label) in enumerate(switches):
        top.axvline(
            step - 0.5, color="tab:green", ls=":", lw=1, label="strategy" if not i else None
        )
        top.annotate(label, (step, 1), xycoords=("data", "axes fraction"), fontsize=7,
                     rotation=90, va="top", ha="left", color="tab:green")  # fmt: skip
    top.set_ylabel("cross-entropy (nats / byte)")
    top.legend()
    top.grid(alpha=0.3)
    imbalance = np.array(
        [[np.nan if v is None else v for v in r["device_imbalance"]] for r in records]
    )
    for layer in range(imbalance.shape[1]):
        color = f"C{layer % 10}"
        bottom.plot(steps, imbalance[:, layer], color=color, lw=0.5, alpha=0.35)
        bottom.plot(
            steps,
            moving_average(imbalance[:, layer], 10),
            color=color,
            lw=1.2,
            label=f"MoE {layer}",
        )
        moved = [e["applied_after_step"] + 0.5 for e in events if e["layer"] == layer]
        if moved:  # a marker on the layer's average where the new layout took effect
            smooth = moving_average(imbalance[:, layer], 10)
            bottom.scatter(
                moved,
                np.interp(moved, steps, smooth),
                marker="v",
                color=color,
                s=30,
                zorder=3,
                label=f"re-placed, MoE {layer}",
            )
    bottom.axhline(1.0, color="gray", ls="--", lw=0.8)
    bottom.set_ylabel("device load max/mean")
    bottom.set_xlabel("step")
    _integer_steps(bottom)
    bottom.legend(ncol=4, fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_expert_load(records: list[dict], path: str) -> None:
    """One heatmap per MoE layer: share of the layer's assignments per expert (rows) and step
    (columns); 1/E everywhere is perfect balance."""
    counts = np.array([r["expert_counts"] for r in records], float)  # [steps, Lm, E]
    steps = [r["step"] for r in records]
    share = counts / np.maximum(counts.sum(-1, keepdims=True), 1)
    num_layers, num_experts = share.shape[1:]
    cols = min(num_layers, 2)
    rows = math.ceil(num_layers / cols)
    fig = _figure(figsize=(6 * cols, 2.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = max(2.0 / num_experts, float(np.nanmax(share)))
    for layer in range(num_layers):
        ax = axes[layer // cols][layer % cols]
        im = ax.imshow(
            share[:, layer].T,
            aspect="auto",
            origin="lower",
            cmap="viridis",
            vmin=0,
            vmax=vmax,
            extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, num_experts - 0.5),
            interpolation="nearest",
        )
        ax.set_title(f"MoE layer {layer}: expert load share")
        ax.set_ylabel("expert")
        ax.set_xlabel("step")
        _integer_steps(ax)
        fig.colorbar(im, ax=ax, fraction=0.04)
    for layer in range(num_layers, rows * cols):
        axes[layer // cols][layer % cols].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_placement_forecast(rows: list[dict], path: str) -> None:
    """Per re-placement (`placement_runtime.measured_effect` rows): the forecast imbalance fall
    against the measured one (10 steps before -> after, and old -> new table on the same steps
    after), with the in-sample forecast beside it; color is the step. On the diagonal the
    forecast was right."""
    keys = ("forecast_before", "forecast_after", "measured_before", "measured_after")
    rows = [r for r in rows if all(r.get(k) is not None for k in keys)]
    fig = _figure(figsize=(6.5, 5.5))
    ax = fig.subplots()
    if not rows:
        ax.text(0.5, 0.5, "no re-placement with a full window", ha="center", transform=ax.transAxes)
        fig.savefig(path, dpi=110)
        return
    forecast = np.array([r["forecast_before"] - r["forecast_after"] for r in rows])
    measured = np.array([r["measured_before"] - r["measured_after"] for r in rows])
    steps = np.array([r["applied_after_step"] for r in rows])
    dots = ax.scatter(forecast, measured, c=steps, cmap="viridis", s=28, zorder=3)
    ax.scatter(
        [], [], color="gray", s=28, label=f"measured, before -> after (mean {measured.mean():.3f})"
    )
    same = [r for r in rows if r.get("counterfactual_before") is not None]
    if same:
        x = np.array([r["forecast_before"] - r["forecast_after"] for r in same])
        y = np.array([r["counterfactual_before"] - r["measured_after"] for r in same])
        ax.scatter(
            x,
            y,
            facecolors="none",
            edgecolors="tab:red",
            s=40,
            lw=0.8,
            label=f"measured, old -> new table on the same steps (mean {y.mean():.3f})",
        )
    if rows[0].get("per_step_before") is not None:
        inside = np.array([r["per_step_before"] - r["per_step_after"] for r in rows])
        ax.scatter(
            inside,
            measured,
            marker="x",
            color="gray",
            s=18,
            lw=0.7,
            label=f"in-sample forecast vs measured (mean {inside.mean():.3f})",
        )
    ax.set_title(f"imbalance fall per re-placement: forecast mean {forecast.mean():.3f}")
    lo = min(0.0, float(np.min(measured)))
    hi = max(float(np.max(forecast)), float(np.max(measured)), 0.05)
    ax.plot([lo, hi], [lo, hi], color="gray", ls="--", lw=0.8)
    ax.axhline(0.0, color="gray", lw=0.5)
    ax.set_xlabel("forecast fall (busiest device / mean)")
    ax.set_ylabel("measured fall")
    fig.colorbar(dots, ax=ax, label="applied after step")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the token frequencies: the loss of the best context-free model."""
    p = np.bincount(np.asarray(tokens), minlength=vocab_size) / max(len(tokens), 1)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def summary_rows(result) -> list[tuple[str, str]]:
    """`(name, value)` rows of the summary table of a `RunResult` (with placement: the
    re-placements and the controller's host overhead)."""
    rows = [
        ("steps", f"{result.step} (this run: {result.steps_this_run})"),
        (
            f"final train loss (mean of last {getattr(result, 'final_loss_steps', 20)} steps)",
            _fmt(result.final_loss, "{:.4f} nats"),
        ),
        ("held-out loss", _fmt(result.eval_loss, "{:.4f} nats")),
        ("unigram entropy of the corpus", f"{result.unigram_entropy:.4f} nats"),
        ("skipped non-finite steps", str(result.skipped)),
        ("tokens/s (median)", _fmt(result.tokens_per_s, "{:,.0f}")),
        ("achieved FLOP/s (median)", _fmt(result.flops_per_s, "{:.3g}")),
        ("device-load imbalance (mean)", _fmt(result.mean_imbalance, "{:.3f}")),
        ("dropped fraction (mean)", _fmt(result.mean_dropped, "{:.4f}")),
        ("wall time", f"{result.wall_s:.1f} s"),
        *(("training recipe", line) for line in getattr(result, "recipes", ())),
        *_tuning_rows(getattr(result, "tuning", None)),
        *_placement_rows(getattr(result, "placement", None)),
        ("run directory", result.run_dir),
    ]
    if result.interrupted:
        signal = getattr(result, "stop_signal", None) or "a signal"
        rows.insert(0, ("stopped early", f"{signal}: checkpoint saved, rerun to resume"))
    return rows


def summary_table(result) -> str:
    """The summary as an aligned two-column text table."""
    rows = summary_rows(result)
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    body = "\n".join(f"{k:<{width}} | {v}" for k, v in rows)
    return f"{line}\n{body}\n{line}"


def _fmt(value, pattern: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else pattern.format(value)


def _seconds(x: float) -> str:
    return f"{x:.3g} s"


def _tuning_rows(summary: dict | None) -> list[tuple[str, str]]:
    """The strategy the run ended on, why, and what tuning cost (`tuning.StepRunner.summary`)."""
    if not summary:
        return []
    if summary["kind"] == "fixed":
        return [("parallel strategy", f"{summary['chosen']} ({summary['reason']})")]
    times = summary.get("times") or {}
    compared = ", ".join(f"{label} {_seconds(t)}" for label, t in times.items())
    how = {
        "measured": f"fastest median step of {len(times)} timed",
        "cost": f"lowest cost of {len(times)}",
        "followed": "followed the routing load",
        "skipped": "kept, not re-timed",
        "probe": "the default, the only candidate",
        "none": "not decided: the run stopped first",
    }[summary["kind"]]
    budget = summary.get("budget_s")
    budget = "n/a" if budget is None else "no limit" if math.isinf(budget) else _seconds(budget)
    rows = [
        ("parallel strategy", f"{summary['chosen']} ({how})"),
        ("strategy decision", summary["reason"]),
    ]
    if compared:
        rows.append(("step times measured (median)", compared))
    rows.append(
        (
            "strategy tuning",
            f"{summary['decisions']} decisions, {summary['rounds']} timed rounds; cost "
            f"{_seconds(summary['spent_s'])} (budget {budget}; tuning_events.jsonl)",
        )
    )
    return rows


def _placement_rows(summary: dict | None) -> list[tuple[str, str]]:
    if not summary:
        return []
    overhead = summary["decision_wall_s"] + summary["migration_wall_s"]
    rows = [("expert re-placements", str(summary["replacements"]))]
    if summary.get("hardware"):
        hw, platform = summary["hardware"], summary.get("platform") or "this"
        figures = (
            f"{hw['flops_per_s'] / 1e9:,.1f} GFLOP/s, {hw['link_bytes_per_s'] / 1e9:,.3f} GB/s "
            "per device"
        )
        if hw["name"] == "measured":
            source = f"measured on this {platform} mesh at start"
        else:
            source = f"{hw['name']} datasheet"
            if platform == "cpu":
                source += ", not this cpu mesh's (--placement-hardware measured)"
        rows.append(("placement cost model", f"{source}: {figures}"))
    if summary.get("replacements"):
        rows.append(
            (
                "migrations, priced / measured",
                f"{_seconds(summary['modeled_migration_s'])} / "
                f"{_seconds(summary['measured_migration_s'])} in all",
            )
        )
    if summary.get("checks"):
        checks = summary["checks"]
        counts = ", ".join(f"{k} {v}" for k, v in sorted(checks.items(), key=lambda kv: -kv[1]))
        rows.append(
            (
                "placement checks",
                f"{sum(checks.values())}: {counts} (placement_decisions.jsonl)",
            )
        )
    for d in summary.get("never_replaced", ()):
        rows.append(
            (f"MoE {d['layer']} never re-placed", f"last check, step {d['step']}: {d['reason']}")
        )
    rows += [
        (
            "placement overhead (decide + migrate)",
            f"{overhead:.2f} s = {_fmt(summary['overhead_fraction'], '{:.2%}')} of wall time",
        ),
    ]
    if "predicted_fall" in summary:
        rows.append(
            (
                "imbalance fall per re-placement",
                f"predicted {summary['predicted_fall']:.3f} (in sample "
                f"{summary['in_sample_fall']:.3f}), measured {summary['measured_fall']:.3f} "
                f"(10 steps before -> after; old -> new table on the steps after: "
                f"{summary['counterfactual_fall']:.3f}; {summary['fall_events']} events)",
            )
        )
    return rows
