"""Reference cases of the placement planner: fixed per-layer loads and slot counts, beside the
published EPLB example and a lower bound on any placement (`python -m moejax.cli.simulate_placement
--case NAME` prints them; BENCHMARKS.md records the figures).

- ``eplb-readme``: the example of DeepSeek's EPLB README (github.com/deepseek-ai/EPLB): 2 layers,
  12 experts, 16 slots on 8 GPUs in 2 nodes; rows only, no cost model.
- ``zipf-256``: E = 256 with Zipf loads (fixed seed) on 32 GPUs (4 nodes, 9 slots each) and 64
  GPUs (8 nodes, 5 slots each); rows only.
- ``deepseek-v3``: a DeepSeek-V3-like layer (``DEEPSEEK_V3``: E = 256 in 8 groups, top-4 groups,
  top-8 experts) on ``H100_IB`` at the same two sizes: per layout, max / mean device rows beside
  nodes per group, cross-node token copies per token and the modeled step.

Shape letters: ``E`` experts, ``N`` devices, ``S`` slots per device, ``P = N·S`` slots.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.placement._packing import apportion, pack_by_group
from moejax.placement.cost_model import H100_IB, Workload, step_cost
from moejax.placement.groups import cross_node_copies, min_nodes_per_group, nodes_per_group
from moejax.placement.planner import plan
from moejax.placement.table import Placement
from moejax.placement.traces import zipf, zipf_exponent_for

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


def static_layout(num_experts: int, num_devices: int, slots: int) -> Placement:
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
            start = static_layout(counts.shape[0], n, s)
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
            start = static_layout(256, n, s)
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
