"""Placement simulator: static vs FasterMoE-style shadowing vs our controller vs perfect balance.

Replays routing traces through the analytic cost model (moejax/placement/cost_model.py) at
8 to 2048 devices and prints, per trace and device count: modeled step time, speedup over static
placement, gap to the perfect-balance bound, and controller overhead ((host decision wall time +
modeled migration time) / total modeled time). Saves a PNG and a JSON of the table. The last
column, ``repl. sync``, is the part of the modeled time spent combining the gradients of
experts replicated across devices every step (``cost_model.replica_sync_s``, a ring all-reduce
with no overlap, over the in-node link when all holders share a node, else over the cross-node
link): ``step_cost`` charges it, the controller's planner weighs it against balance and groups
the holders of each replicated expert into one node where it can (``packing_nodes.py``);
shadowing pays its own per-step sync, in its migration column.

Scaling: ``E = 2N`` experts (two home experts per device) and ``S = E/N + spare`` slots per
device (default one spare slot, the same expert memory for every strategy). Synthetic traces use
``T·K`` rows per device per step with multinomial noise; the Zipf exponent is calibrated per
``E`` so that the hottest expert gets ``--hot-ratio`` x the mean load (a fixed exponent would make
the skew grow with ``E``). The drifting trace rotates the hot set every ``steps/4`` steps.
A recorded trace (``--trace``) gives the routing distribution: by default each step's expert shares
are scaled to the workload's ``N·T·K`` rows (``--trace-rows as-is`` keeps its counts), so the
modeled times mean most when it was recorded at the ``Workload``'s batch size.

Run (10-20 s on 2 CPU cores):
  .venv/bin/python experiments/simulate_placement.py
  .venv/bin/python experiments/simulate_placement.py --trace counts.npy --devices 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform

import numpy as np
from tqdm import tqdm

from moejax.placement import (
    H100_IB,
    H100_NVLINK,
    TPU_V5P_ICI,
    ControllerConfig,
    Workload,
    balanced,
    drifting_zipf,
    load_trace,
    zipf,
)
from moejax.placement.replay import config_overrides
from moejax.placement.simulate import compare, summarize
from moejax.placement.traces import zipf_exponent_for

HARDWARE = {hw.name: hw for hw in (H100_IB, H100_NVLINK, TPU_V5P_ICI)}


def _traces(args, num_devices: int, wl: Workload) -> dict[str, np.ndarray]:
    if args.trace:
        trace = load_trace(args.trace).astype(np.float64)  # [steps, L, E]
        if args.trace_rows == "workload":
            # The recorded run gives the routing distribution; the workload gives the size.
            total = trace.sum(-1, keepdims=True)
            trace = trace * (num_devices * wl.rows_per_step / np.maximum(total, 1))
        return {os.path.basename(args.trace): trace}
    e = 2 * num_devices
    tokens = num_devices * wl.rows_per_step
    s = zipf_exponent_for(e, args.hot_ratio)
    common = dict(num_layers=1, seed=args.seed)
    return {
        "balanced": balanced(args.steps, e, tokens, **common),
        f"zipf(s={s:.2f})": zipf(args.steps, e, tokens, s=s, **common),
        f"drifting(s={s:.2f})": drifting_zipf(
            args.steps, e, tokens, s=s, shift_every=max(1, args.steps // 4), **common
        ),
    }


def _plot(path: str, rows: list[dict], series: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    kind = lambda r: r["trace"].split("(")[0]  # Zipf exponents differ per N; group by kind
    for trace in dict.fromkeys(kind(r) for r in rows):
        for method, style in (("shadowing", "--"), ("controller", "-")):
            pts = [
                (r["devices"], r["speedup"])
                for r in rows
                if kind(r) == trace and r["method"] == method
            ]
            left.plot(*zip(*pts, strict=True), style, marker="o", label=f"{method}, {trace}")
    left.set_xscale("log", base=2)
    left.set_xlabel("devices N (E = 2N)")
    left.set_ylabel("modeled speedup vs static")
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    title, results = series
    for name, result in results.items():
        right.plot(1e3 * result.step_s, label=name, lw=1)
    right.set_xlabel("step")
    right.set_ylabel("modeled MoE-layer step time (ms)")
    right.set_title(title, fontsize=9)
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64, 512, 2048])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--spare", type=int, default=1, help="spare expert slots per device")
    parser.add_argument("--hot-ratio", type=float, default=4.0)
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default=H100_IB.name)
    parser.add_argument("--trace", help="recorded trace (.npy [steps, L, E] or .jsonl)")
    parser.add_argument(
        "--trace-rows",
        choices=("workload", "as-is"),
        default="workload",
        help="rows of a recorded trace: its expert shares scaled to the workload's N*T*K rows "
        "per step (default), or its counts as they are",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a ControllerConfig field (JSON value), e.g. react_urgent=1.0; repeatable",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/placement")
    args = parser.parse_args()

    hw, wl = HARDWARE[args.hardware], Workload()
    try:
        config = dataclasses.replace(ControllerConfig(), **config_overrides(args.set))
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    jobs = [(n, name, tr) for n in args.devices for name, tr in _traces(args, n, wl).items()]
    rows, series = [], None
    for n, name, trace in jobs:
        if trace.shape[2] % n:
            parser.error(f"E={trace.shape[2]} of trace {name} is not a multiple of N={n}")
    for n, name, trace in tqdm(jobs, desc="simulating"):
        home = trace.shape[2] // n
        results = compare(trace, n, home + args.spare, hw, wl, config)
        for row in summarize(results):
            rows.append(dict(trace=name, devices=n, experts=trace.shape[2], **row))
        if name.startswith("drifting") or series is None:
            series = (f"{name}, N={n}, {hw.name}", results)

    print(f"\nhardware={hw.name} workload={wl} controller={config}")
    header = f"{'trace':<18}{'N':>6}{'E':>6}  {'method':<11}{'step ms':>9}{'vs static':>10}"
    header += f"{'gap to perfect':>15}{'overhead':>10}{'(migr.)':>9}{'host s':>8}"
    print(header + f"{'re-placed':>10}{'repl. sync':>11}")
    for r in rows:
        print(
            f"{r['trace']:<18}{r['devices']:>6}{r['experts']:>6}  {r['method']:<11}"
            f"{r['step_ms']:>9.2f}{r['speedup']:>9.2f}x{r['gap']:>14.1%}"
            f"{r['overhead']:>10.2%}{r['migration']:>9.2%}{r['host_s']:>8.3f}{r['replacements']:>10}"
            f"{r['replica_sync']:>11.1%}"
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "placement.json"), "w") as f:
        json.dump(dict(machine=platform.platform(), args=vars(args), rows=rows), f, indent=1)
    _plot(os.path.join(args.out, "placement.png"), rows, series)
    print(f"wrote {args.out}/placement.png and placement.json")


if __name__ == "__main__":
    main()
