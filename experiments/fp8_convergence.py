"""FP8 experts vs unquantized experts: the same model, seed and batches trained twice, loss
curves compared and plotted (`MoEConfig.expert_precision`; on CPU the fp8 path is emulated,
the same numerics as the fp8 kernels up to fp32 summation order).

  python experiments/fp8_convergence.py                     # tiny (300 steps) and small
  python experiments/fp8_convergence.py --presets small --steps 40 --batch-size 8  # CPU-sized
  python experiments/fp8_convergence.py --presets tiny --out runs/fp8

Runs `experiments/train_lm.py` with `--expert-precision bf16` and `fp8` (the baseline's expert
matmuls run in the model's activation dtype: fp32 for these presets, unless `--bf16`), pinned
to one strategy so both runs execute the same program but for the expert matmuls. Writes
`<out>/fp8_vs_bf16.png` and `<out>/fp8_vs_bf16.json`: per preset, the largest difference of the
`--window`-step moving averages of the loss over the run, the final losses, and whether the
difference stays within `--tolerance` (relative to the baseline's moving average).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_STEPS = {"tiny": None, "small": 200}  # small's 2000 steps take hours on 2 CPU cores


def _run(preset, precision, args) -> str:
    out = os.path.join(args.out, f"{preset}_{precision}")
    cmd = [
        sys.executable, os.path.join(HERE, "train_lm.py"), "--preset", preset, "--out", out,
        "--expert-precision", precision, "--strategy", args.strategy, "--no-progress",
        "--no-outputs", "--seed", str(args.seed),
    ]  # fmt: skip
    steps = args.steps if args.steps is not None else DEFAULT_STEPS.get(preset)
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if args.batch_size is not None:
        cmd += ["--batch-size", str(args.batch_size)]
    if args.bf16:
        cmd.append("--bf16")
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return os.path.join(out, "metrics.jsonl")


def _losses(path: str) -> dict[int, float]:
    losses = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec and "step" in rec:
                losses[int(rec["step"])] = float(rec["loss"])
    return losses


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def compare(base: dict[int, float], fp8: dict[int, float], window: int) -> dict:
    """Loss curves over their common steps: the largest |difference| of the moving averages,
    relative and absolute, and the final losses."""
    steps = sorted(set(base) & set(fp8))
    b = _smooth([base[s] for s in steps], window)
    f = _smooth([fp8[s] for s in steps], window)
    diffs = [abs(x - y) for x, y in zip(b, f, strict=True)]
    rel = [d / abs(x) for d, x in zip(diffs, b, strict=True)]
    worst = max(range(len(steps)), key=lambda i: rel[i])
    return {
        "steps": len(steps),
        "max_abs_diff_smoothed": max(diffs),
        "max_rel_diff_smoothed": rel[worst],
        "at_step": steps[worst],
        "final_loss_bf16": base[steps[-1]],
        "final_loss_fp8": fp8[steps[-1]],
        "final_smoothed_bf16": b[-1],
        "final_smoothed_fp8": f[-1],
    }


def plot(curves: dict, path: str, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
    for ax, (preset, (base, fp8)) in zip(axes[0], curves.items(), strict=True):
        # "bf16" is `--expert-precision bf16`: experts unquantized, in the run's compute dtype
        # (fp32 for the presets unless --bf16).
        series = (("unquantized experts", base, "-", "C0"), ("fp8 experts", fp8, "--", "C3"))
        for name, losses, style, color in series:
            steps = sorted(losses)
            ax.plot(steps, [losses[s] for s in steps], style, color=color, alpha=0.25)
            ax.plot(steps, _smooth([losses[s] for s in steps], window), style, color=color,
                    label=name)  # fmt: skip
        ax.set_title(f"{preset}: loss ({window}-step moving average bold)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/byte)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", default="tiny,small", help="comma-separated model presets")
    p.add_argument("--out", default="runs/fp8_convergence", help="output directory")
    p.add_argument("--steps", type=int, help="steps per run (default: tiny 300, small 200)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="seed of both runs")
    p.add_argument("--strategy", default="dropless", help="train_lm --strategy, pinned")
    p.add_argument("--bf16", action="store_true", help="bf16 activations in both runs")
    p.add_argument("--window", type=int, default=20, help="moving-average window, steps")
    p.add_argument("--tolerance", type=float, default=0.02, help="max relative smoothed diff")
    p.add_argument("--reuse", action="store_true", help="read existing runs, do not train")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    curves, report = {}, {}
    for preset in args.presets.split(","):
        paths = {}
        for precision in ("bf16", "fp8"):
            existing = os.path.join(args.out, f"{preset}_{precision}", "metrics.jsonl")
            paths[precision] = existing if args.reuse else _run(preset, precision, args)
        base, fp8 = _losses(paths["bf16"]), _losses(paths["fp8"])
        curves[preset] = (base, fp8)
        report[preset] = compare(base, fp8, args.window)
        worst = report[preset]["max_rel_diff_smoothed"]
        report[preset]["within_tolerance"] = worst <= args.tolerance
    report["tolerance"] = args.tolerance
    report["window"] = args.window
    with open(os.path.join(args.out, "fp8_vs_bf16.json"), "w") as f:
        json.dump(report, f, indent=1)
    plot(curves, os.path.join(args.out, "fp8_vs_bf16.png"), args.window)
    print(json.dumps(report, indent=1))
    return 0 if all(r["within_tolerance"] for k, r in report.items() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
