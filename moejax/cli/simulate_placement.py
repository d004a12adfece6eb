"""Placement simulator: static vs FasterMoE-style shadowing vs our controller vs perfect balance.

Replays routing traces through the analytic cost model (moejax/placement/cost_model.py) at
8 to 2048 devices and prints, per trace and device count: modeled step time, speedup over static
placement, gap to the perfect-balance bound, and controller overhead ((host decision wall time +
modeled migration time) / total modeled time). Saves a PNG and a JSON of the table. The last
column, ``repl. sync``, is the part of the modeled time spent combining the gradients of
experts replicated across devices every step (``cost_model.replica_sync_s``, a ring all-reduce
with no overlap, over the in-node link when all holders share a node, else over the cross-node
link): ``step_cost`` charges it, the controller's planner weighs it against balance and groups
the holders of each replicated expert into one node where it can (the planner's node order);
shadowing pays its own per-step sync, in its migration column.

Scaling: ``E = 2N`` experts (two home experts per device) and ``S = E/N + spare`` slots per
device (default one spare slot, the same expert memory for every strategy). Synthetic traces use
``T·K`` rows per device per step with multinomial noise; the Zipf exponent is calibrated per
``E`` so that the hottest expert gets ``--hot-ratio`` x the mean load (a fixed exponent would make
the skew grow with ``E``). The drifting trace rotates the hot set every ``steps/4`` steps.
A recorded trace (``--trace``) gives the routing distribution: by default each step's expert shares
are scaled to the workload's ``N·T·K`` rows (``--trace-rows as-is`` keeps its counts), so the
modeled times mean most when it was recorded at the ``Workload``'s batch size.

Reference cases (``--case``): the planner alone on fixed per-layer loads and slot counts, beside
the published EPLB example (``eplb-readme``, ``zipf-256``: rows only, no cost model), and a
DeepSeek-V3-like layer in expert groups on ``H100_IB`` (``deepseek-v3``), as
``moejax.placement.reference_cases`` computes them; each prints a Markdown table.

The simulation first prints the hardware and workload it models (``--help`` lists them too).

Run (10-20 s on 2 CPU cores; a ``--case`` well under 1 s; ``python -m
moejax.cli.simulate_placement`` is the same command):
  .venv/bin/python experiments/simulate_placement.py
  .venv/bin/python experiments/simulate_placement.py --trace counts.npy --devices 8
  .venv/bin/python experiments/simulate_placement.py --case eplb-readme --case zipf-256
  .venv/bin/python experiments/simulate_placement.py --case deepseek-v3   # about 2 s
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys

import numpy as np
from tqdm import tqdm

from moejax.cli._parser import OneLineParser, nonnegative_int, positive_int
from moejax.placement import (
    H100_IB,
    H100_NVLINK,
    TPU_V5P_ICI,
    ControllerConfig,
    Workload,
    load_trace,
    reference_cases,
)
from moejax.placement.replay import config_overrides
from moejax.placement.simulate import compare, summarize
from moejax.placement.traces import synthetic_traces
from pallas_kernels.targets import use_cpu_unless_accelerator

HARDWARE = {hw.name: hw for hw in (H100_IB, H100_NVLINK, TPU_V5P_ICI)}


def print_reference(result: dict) -> None:
    print(f"\ncase {result['case']}: {result['about']}.")
    print(
        "max / mean device load (rows split evenly over an expert's replicas); static: "
        "Placement.identity, or slot i -> expert i mod E when N does not divide E; moejax: "
        "moejax.placement.plan(static, loads) on rows alone (no hardware model, so nodes play "
        "no part); bound: max(1, max_e (n_e / d_e) / mean), d = apportion(loads, P, max N per "
        "expert), a lower bound for any placement"
        + ("; EPLB README: the placement its README prints" if "eplb" in result["rows"][0] else "")
        + ".\n"
    )
    eplb = "eplb" in result["rows"][0]
    cols = ["config", "layer", "static", "moejax plan"] + (["EPLB README"] if eplb else [])
    print("| " + " | ".join(cols + ["bound"]) + " |")
    print("|" + "---|" * (len(cols) + 1))
    for r in result["rows"]:
        vals = [r["config"], str(r["layer"]), f"{r['static']:.3f}", f"{r['moejax']:.3f}"]
        vals += [f"{r['eplb']:.3f}"] if eplb else []
        print("| " + " | ".join(vals + [f"{r['bound']:.3f}"]) + " |")


_LAYOUT_NAMES = dict(
    static="static",
    plan="moejax plan, no groups",
    whole="groups kept whole",
    plan_groups="moejax plan, groups",
)


def print_deepseek(result: dict) -> None:
    print(f"\ncase {result['case']}: {result['about']}.")
    print(f"hardware: {result['hardware']}\nworkload: {result['workload']}")
    print(
        "max / mean device rows; nodes per group (mean / max; the least the layout allows in "
        "brackets); cross-node token copies per token (groups.cross_node_copies); modeled "
        "step (compute + node-deduplicated all-to-all + replica sync, cost_model.step_cost); "
        "static: Placement.identity; moejax plan: plan(static, loads, hardware, workload) "
        "with num_groups=1 (today's node-aware planner) and with the groups; groups kept whole: "
        "placement.pack_by_group(spill=0), the planner's candidate with no replica "
        "outside its group's nodes; bound: any "
        "placement; groups bound: every group on its least nodes, no replica outside.\n"
    )
    cols = ["config", "layer", "layout", "max/mean", "nodes/group", "x-node copies/token"]
    cols += ["step ms", "bound", "groups bound"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in result["rows"]:
        vals = [r["config"], str(r["layer"]), _LAYOUT_NAMES[r["layout"]]]
        vals += [
            f"{r['imbalance']:.3f}",
            f"{r['nodes_mean']:.2f} / {r['nodes_max']} [{r['nodes_min']}]",
        ]
        vals += [f"{r['copies_per_token']:.2f}", f"{r['step_ms']:.2f}"]
        vals += [f"{r['bound']:.3f}", f"{r['group_bound']:.3f}"]
        print("| " + " | ".join(vals) + " |")


def _traces(args, num_devices: int, wl: Workload) -> dict[str, np.ndarray]:
    if args.trace:
        try:
            trace = load_trace(args.trace).astype(np.float64)  # [steps, L, E]
        except (ValueError, OSError) as err:  # an unreadable or empty trace: one line
            print(f"error: --trace {args.trace}: {err}", file=sys.stderr)
            sys.exit(2)
        if args.trace_rows == "workload":
            # The recorded run gives the routing distribution; the workload gives the size.
            total = trace.sum(-1, keepdims=True)
            trace = trace * (num_devices * wl.rows_per_step / np.maximum(total, 1))
        return {os.path.basename(args.trace): trace}
    return synthetic_traces(args.steps, num_devices, wl.rows_per_step, args.hot_ratio, args.seed)


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
    experts = sorted({r["experts"] for r in rows})
    synthetic = all(r["experts"] == 2 * r["devices"] for r in rows)
    # A recorded trace keeps its own E at every N; the synthetic ones have two experts per device.
    left.set_xlabel("devices N (E = 2N)" if synthetic else f"devices N (E = {experts[0]})")
    left.set_ylabel("modeled speedup vs static")
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    title, results = series
    for name, result in results.items():
        steps = np.arange(1, len(result.step_s) + 1)  # trace row i is step i + 1, as trained
        right.plot(steps, 1e3 * result.step_s, label=name, lw=1)
    right.set_xlabel("step")
    right.set_ylabel("modeled MoE-layer step time (ms)")
    right.set_title(title, fontsize=9)
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _models_line(hw, wl: Workload) -> str:
    """What the simulation models: the hardware and the workload, every field."""
    return f"modeling hardware: {hw}\nmodeling workload (one MoE layer): {wl}"


def _help_epilog() -> str:
    lines = ["what it models:", "  workload (one MoE layer, per device and step; E = 2N experts):"]
    lines.append(f"    {Workload()}")
    lines.append("  hardware (--hardware; default h100-ib):")
    lines += [f"    {hw}" for hw in HARDWARE.values()]
    lines.append(
        "  --case eplb-readme / zipf-256: rows only (no hardware, no workload); "
        f"--case deepseek-v3: {H100_IB.name} and"
    )
    lines.append(f"    {reference_cases.DEEPSEEK_V3}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    use_cpu_unless_accelerator()  # no GPU/TPU here: no plugin tracebacks (pallas_kernels.targets)
    parser = OneLineParser(
        description=__doc__.splitlines()[0],
        epilog=_help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--devices", type=positive_int, nargs="+", default=[8, 64, 512, 2048])
    parser.add_argument("--steps", type=positive_int, default=400)
    parser.add_argument(
        "--spare", type=nonnegative_int, default=1, help="spare expert slots per device"
    )
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
    parser.add_argument(
        "--out",
        help="where placement.png and placement.json go (default: runs/placement/synthetic, or "
        "runs/placement/<trace's run directory> with --trace)",
    )
    parser.add_argument(
        "--case",
        action="append",
        choices=reference_cases.CASES + reference_cases.GROUP_CASES,
        default=[],
        help="print a reference case's max / mean device loads instead of simulating "
        "(deepseek-v3: its own workload and hardware, see below); repeatable",
    )
    args = parser.parse_args(argv)
    if args.case:
        for name in args.case:
            if name in reference_cases.GROUP_CASES:
                print_deepseek(reference_cases.deepseek_case(args.seed))
            else:
                print_reference(reference_cases.reference_case(name, args.seed))
        return 0

    if args.trace and not os.path.isfile(args.trace):
        what = "not a file" if os.path.exists(args.trace) else "no such file"
        print(f"error: --trace {args.trace}: {what}", file=sys.stderr)
        return 2
    if args.out is None:
        # One directory per trace: a second simulation does not overwrite the first one's.
        name = "synthetic"
        if args.trace:
            parent = os.path.basename(os.path.dirname(os.path.abspath(args.trace)))
            name = parent or os.path.splitext(os.path.basename(args.trace))[0]
        args.out = os.path.join("runs", "placement", name)
    hw, wl = HARDWARE[args.hardware], Workload()
    print(_models_line(hw, wl))
    try:
        config = dataclasses.replace(ControllerConfig(), **config_overrides(args.set))
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    try:  # the synthetic traces check --hot-ratio against each N
        jobs = [(n, name, tr) for n in args.devices for name, tr in _traces(args, n, wl).items()]
    except ValueError as err:
        parser.error(f"--hot-ratio={args.hot_ratio} / --devices: {err}")
    rows, series = [], None
    for n, name, trace in jobs:
        if trace.shape[2] % n:
            parser.error(f"E={trace.shape[2]} of trace {name} is not a multiple of N={n}")
        if trace.shape[2] // n + args.spare < 1:
            parser.error(f"--spare={args.spare}: no slot per device for N={n}")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
