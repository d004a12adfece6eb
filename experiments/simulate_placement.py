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

Reference cases (``--case``, issue 17 item 6): the planner alone, on fixed per-layer loads and
slot counts, beside the published EPLB example (no cost model; rows only). ``eplb-readme`` is the
example of DeepSeek's EPLB README (github.com/deepseek-ai/EPLB): 2 layers, 12 experts, 16
slots on 8 GPUs in 2 nodes; ``zipf-256`` is E = 256 with Zipf loads (fixed seed) on 32 GPUs
(4 nodes, 9 slots each) and 64 GPUs (8 nodes, 5 slots each). Each prints a Markdown table of
max / mean device load for the static layout, moejax's plan and (``eplb-readme``) the
placement printed in EPLB's README, and a lower bound on any placement's max / mean.
``deepseek-v3`` (issue 17 item 3) models a DeepSeek-V3-like layer (``DEEPSEEK_V3``: E = 256 in
8 groups, top-4 groups, top-8 experts) on ``H100_IB`` at 32 GPUs in 4 nodes (9 slots each) and
64 GPUs in 8 nodes (5 slots each), Zipf loads: per layout (static, moejax's plan without and
with the groups, the groups kept whole) max / mean device rows beside nodes per group,
cross-node token copies per token and the modeled step.

The simulation first prints the hardware and workload it models (``--help`` lists them too).

Run (10-20 s on 2 CPU cores; a ``--case`` well under 1 s):
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

from moejax.placement import (
    H100_IB,
    H100_NVLINK,
    TPU_V5P_ICI,
    ControllerConfig,
    Placement,
    Workload,
    apportion,
    balanced,
    drifting_zipf,
    load_trace,
    pack_by_group,
    plan,
    step_cost,
    zipf,
)
from moejax.placement.groups import cross_node_copies, min_nodes_per_group, nodes_per_group
from moejax.placement.replay import config_overrides
from moejax.placement.simulate import compare, summarize
from moejax.placement.traces import zipf_exponent_for

HARDWARE = {hw.name: hw for hw in (H100_IB, H100_NVLINK, TPU_V5P_ICI)}

# DeepSeek EPLB README example (github.com/deepseek-ai/EPLB): its input, and the physical-to-
# logical map its README prints as the output of rebalance_experts(weight, 16, 4, 2, 8). Data
# only: EPLB's algorithm is not reproduced here.
EPLB_README_WEIGHT = np.array(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
EPLB_README_PHY2LOG = np.array(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)
CASES = ("eplb-readme", "zipf-256")  # rows only, no cost model
GROUP_CASES = ("deepseek-v3",)  # expert groups, with the cost model

# DeepSeek-V3-like MoE layer (arXiv 2412.19437, sections 2.1.2 and 4.2): 256 routed experts of
# d_ff 2048 on d_model 7168, top-8 among the top-4 of 8 groups (each group's best two experts
# score it); 8192 tokens per GPU per step, bf16 activations (V3 dispatches in FP8). Hardware:
# H100_IB, 8 GPUs per node (V3 trained on H800s: the same 50 GB/s InfiniBand per GPU, a slower
# NVLink).
DEEPSEEK_V3 = Workload(
    tokens_per_device=8192, top_k=8, d_model=7168, d_ff=2048, num_groups=8, topk_groups=4
)


def _static(num_experts: int, num_devices: int, slots: int) -> Placement:
    """Load-unaware layout: ``Placement.identity`` (spare slots repeat a device's own experts)
    when ``N`` divides ``E``, else slot ``i`` holds expert ``i mod E`` (device by device)."""
    if num_experts % num_devices == 0:
        return Placement.identity(num_experts, num_devices, slots)
    table = np.arange(num_devices * slots) % num_experts
    return Placement(table, num_experts, num_devices, slots)


def load_bound(counts: np.ndarray, num_devices: int, slots: int) -> float:
    """Lower bound on any placement's busiest-device rows / mean rows for ``counts [E]``.

    ``max(1, max_e (n_e / d_e) / mean)``: an expert held on ``d_e`` distinct devices gives one of
    them at least ``n_e / d_e`` rows, ``sum d_e <= P`` and ``d_e <= N``, and the largest
    ``n_e / d_e`` is smallest for ``d = apportion(counts, P, max_replicas=N)`` (highest averages,
    as in the planner's re-pack). It ignores that each device has exactly ``S`` slots.
    """
    counts = np.asarray(counts, np.float64)
    mean = counts.sum() / num_devices
    d = apportion(counts, num_devices * slots, max_replicas=num_devices)
    return max(1.0, float((counts / d).max() / mean))


def reference_case(name: str, seed: int = 0) -> dict:
    """One ``--case``: what it models and one row per (config, layer) with max / mean loads."""
    if name == "eplb-readme":
        configs = [("E=12 N=8 (2 nodes) S=2", 8, 2, EPLB_README_WEIGHT, EPLB_README_PHY2LOG)]
        about = (
            "DeepSeek EPLB README example: 2 layers, 12 logical experts, 16 physical slots, "
            "8 GPUs in 2 nodes (2 slots per GPU), 4 expert groups; loads = its weight matrix"
        )
    elif name == "zipf-256":
        configs = []
        for n, nodes, s in ((32, 4, 9), (64, 8, 5)):
            tokens = 256 * 1024  # rows per layer; only the shares matter for max / mean
            loads = zipf(1, 256, tokens, s=1.0, num_layers=2, seed=seed)[0]
            configs.append((f"E=256 N={n} ({nodes} nodes) S={s}", n, s, loads, None))
        about = (
            f"E=256 experts, Zipf(s=1.0) loads (ranks shuffled per layer, seed={seed}, 2 layers, "
            "262144 rows per layer): 32 GPUs in 4 nodes with 9 slots each (288 = 256 + 32 "
            "redundant) and 64 GPUs in 8 nodes with 5 slots each (320 = 256 + 64)"
        )
    else:
        raise ValueError(f"unknown case {name!r}; choose from {CASES}")
    rows = []
    for config, n, s, loads, eplb in configs:
        for layer, counts in enumerate(np.asarray(loads, np.float64)):
            start = _static(counts.shape[0], n, s)
            row = dict(
                case=name,
                config=config,
                layer=layer,
                static=start.imbalance(counts),
                moejax=plan(start, counts).imbalance(counts),
                bound=load_bound(counts, n, s),
            )
            if eplb is not None:
                row["eplb"] = Placement(eplb[layer], counts.shape[0], n, s).imbalance(counts)
            rows.append(row)
    return dict(case=name, about=about, rows=rows)


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


def group_bound(
    counts: np.ndarray, num_groups: int, num_devices: int, num_nodes: int, slots: int
) -> float:
    """Lower bound on max / mean device rows for placements that keep every group on its
    ``groups.min_nodes_per_group`` nodes with no replica outside them: ``load_bound``, and the
    busiest node's share. Such a node carries all the rows of its groups (``num_groups / M``
    whole groups per node: the busiest group's node at least that group and the
    ``num_groups / M - 1`` lightest others) or ``1 / (M / num_groups)`` of its group's at best
    (a group over ``M / num_groups`` nodes), and its busiest device at least ``1 / G`` of that.
    Other shapes: ``load_bound`` alone.
    """
    counts = np.asarray(counts, np.float64)
    e, total = counts.shape[0], float(counts.sum())
    group_rows = counts.reshape(num_groups, e // num_groups).sum(axis=1)
    node = total / num_nodes
    if num_groups % num_nodes == 0:  # the node of the busiest group, with the lightest others
        light = np.sort(group_rows)[: num_groups // num_nodes - 1].sum()
        node = max(node, float(group_rows.max() + light))
    elif num_nodes % num_groups == 0:
        node = max(node, float(group_rows.max()) / (num_nodes // num_groups))
    return max(load_bound(counts, num_devices, slots), node / (total / num_nodes))


def deepseek_case(seed: int = 0) -> dict:
    """``--case deepseek-v3``: E = 256 in 8 groups (top-4 groups, top-8 experts), 32 GPUs in 4
    nodes (9 slots each) and 64 GPUs in 8 nodes (5 slots), Zipf loads (hottest expert 4x the
    mean, ranks shuffled, ``seed``, 2 layers); per layout: max / mean device rows, nodes per
    group, cross-node token copies per token and the modeled step (``DEEPSEEK_V3`` on
    ``H100_IB``)."""
    wl, hw = DEEPSEEK_V3, H100_IB
    flat = dataclasses.replace(wl, num_groups=1, topk_groups=1)  # the planner without groups
    g, ng = hw.devices_per_node, wl.num_groups
    rows = []
    for n, s in ((32, 9), (64, 5)):
        m, tokens = n // g, n * wl.rows_per_step
        loads = zipf(1, 256, tokens, s=zipf_exponent_for(256, 4.0), num_layers=2, seed=seed)[0]
        config = f"E=256 N={n} ({m} nodes) S={s}"
        for layer, counts in enumerate(loads.astype(np.float64)):
            start = _static(256, n, s)
            whole = pack_by_group(counts, n, s, g, ng, spill=0.0).reshape(-1)
            layouts = dict(
                static=start,
                plan=plan(start, counts, hardware=hw, workload=flat),
                whole=Placement(whole, 256, n, s),
                plan_groups=plan(start, counts, hardware=hw, workload=wl),
            )
            for name, p in layouts.items():
                spans = nodes_per_group(p, ng, g)
                copies = cross_node_copies(p, counts, ng, wl.picks_per_group, g)
                rows.append(
                    dict(
                        config=config,
                        layer=layer,
                        layout=name,
                        imbalance=p.imbalance(counts),
                        nodes_mean=float(spans.mean()),
                        nodes_max=int(spans.max()),
                        nodes_min=int(min_nodes_per_group(256, ng, m).max()),
                        copies_per_token=float(copies.sum() / (counts.sum() / wl.top_k)),
                        step_ms=1e3 * step_cost(p, counts, hw, wl).total_s,
                        bound=load_bound(counts, n, s),
                        group_bound=group_bound(counts, ng, n, m, s),
                    )
                )
    about = (
        f"DeepSeek-V3-like layer, E=256 in {ng} groups, top-{wl.topk_groups} groups, "
        f"top-{wl.top_k} experts; Zipf loads (hottest expert 4x the mean, ranks shuffled, "
        f"seed={seed}, 2 layers); 32 GPUs in 4 nodes with 9 slots each and 64 GPUs in 8 nodes "
        "with 5 slots each"
    )
    return dict(case="deepseek-v3", about=about, hardware=hw, workload=wl, rows=rows)


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
    lines.append(f"    {DEEPSEEK_V3}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=_help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    parser.add_argument(
        "--out",
        help="where placement.png and placement.json go (default: runs/placement/synthetic, or "
        "runs/placement/<trace's run directory> with --trace)",
    )
    parser.add_argument(
        "--case",
        action="append",
        choices=CASES + GROUP_CASES,
        default=[],
        help="print a reference case's max / mean device loads instead of simulating "
        "(deepseek-v3: its own workload and hardware, see below); repeatable",
    )
    args = parser.parse_args()
    if args.case:
        for name in args.case:
            if name in GROUP_CASES:
                print_deepseek(deepseek_case(args.seed))
            else:
                print_reference(reference_case(name, args.seed))
        return

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
