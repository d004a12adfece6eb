"""Host wall time of `placement.plan` at scale (node-aware, H100_IB), median of repeats.

    python experiments/bench_planner.py --experts 256 --devices 64 --slots 6 8
    python experiments/bench_planner.py --groups 8 --topk-groups 4 --slots 5 6 8  # DeepSeek-V3

Zipf loads (hottest expert 4x the mean, ranks shuffled; 5 seeds, 3 timed calls each after a
warm-up), planned from the identity placement and, the controller's case, re-planned from that
plan after the loads drift 30% toward the next seed's. Prints the median / min / max wall time,
the median process CPU time (steadier on a shared machine) and the modeled step time of the
result relative to the start (so a speed-up that changed the plan shows). ``--groups``: expert
groups of group-limited routing (``Workload.num_groups``), which the planner keeps on few
nodes. About 5 s.

``--compare-greedy``: the packers alone (no planner, no cost model) over 24 shapes (``E`` in
64 / 128 / 256, ``N`` in 8 / 16 / 32 / 64, ``S`` = 1.25 and 1.5 x ``E / N`` rounded up, at
least 2; hottest expert 2x / 4x / 8x the mean in turn; one seed per shape), replica counts
fixed by ``placement.replica_counts``: max / mean device load of the differencing packer (the
only one before), EPLB-style greedy alone, greedy refined by the same rebalancing passes, and
the kept packing (``placement.pack``), then how many shapes each start wins. Under a second.
"""

import argparse
import time

import numpy as np

from moejax.placement import (
    H100_IB,
    Placement,
    Workload,
    greedy_pack,
    pack,
    plan,
    replica_counts,
    step_cost,
)
from moejax.placement.traces import zipf_exponent_for, zipf_probs


def _loads(e: int, n: int, wl: Workload, seeds: int) -> list[np.ndarray]:
    out = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        probs = zipf_probs(e, zipf_exponent_for(e, 4.0))[rng.permutation(e)]
        out.append(rng.multinomial(n * wl.rows_per_step, probs).astype(np.float64))
    return out


def _time(start: Placement, counts: np.ndarray, wl: Workload, repeats: int):
    plan(start, counts, hardware=H100_IB, workload=wl)  # warm-up
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        new = plan(start, counts, hardware=H100_IB, workload=wl)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    ratio = (
        step_cost(new, counts, H100_IB, wl).total_s / step_cost(start, counts, H100_IB, wl).total_s
    )
    return times, cpu, ratio, new


def _greedy_shapes() -> list[tuple[int, int, int, float]]:
    """(E, N, S, hottest / mean) of ``--compare-greedy``."""
    shapes = []
    for e in (64, 128, 256):
        for n in (8, 16, 32, 64):
            for f in (1.25, 1.5):
                s = max(2, -(-int(f * e) // n))
                shapes.append((e, n, s, (2.0, 4.0, 8.0)[len(shapes) % 3]))
    return shapes


def compare_greedy() -> int:
    """Prints the ``--compare-greedy`` table (module docstring) and the win counts."""
    print(
        "| E | N | S | hot/mean | differencing (before) | greedy (EPLB) | greedy + passes | kept |"
    )
    print("|---|---|---|---|---|---|---|---|")
    wins = {"differencing": 0, "greedy + passes": 0, "tie": 0, "EPLB greedy beats before": 0}
    for i, (e, n, s, hot) in enumerate(_greedy_shapes()):
        rng = np.random.default_rng(i)
        probs = zipf_probs(e, zipf_exponent_for(e, hot))[rng.permutation(e)]
        counts = rng.multinomial(n * 4096, probs).astype(np.float64)
        r = replica_counts(counts, n, s)
        experts = np.repeat(np.arange(e), r)
        weights = counts[experts] / r[experts]
        mean = counts.sum() / n

        def ratio(table, r=r, counts=counts, mean=mean):
            return float((counts[table] / r[table]).sum(axis=1).max() / mean)

        before = ratio(pack(weights, experts, n, method="differencing"))
        eplb = ratio(greedy_pack(weights, experts, n))
        refined = ratio(pack(weights, experts, n, method="greedy"))
        kept = ratio(pack(weights, experts, n))
        rel = 1e-12
        if refined < before * (1 - rel):
            wins["greedy + passes"] += 1
        elif before < refined * (1 - rel):
            wins["differencing"] += 1
        else:
            wins["tie"] += 1
        wins["EPLB greedy beats before"] += eplb < before * (1 - rel)
        print(
            f"| {e} | {n} | {s} | {hot:g} | {before:.4f} | {eplb:.4f} | {refined:.4f} | "
            f"{kept:.4f} |"
        )
    print("wins: " + ", ".join(f"{k} {v}" for k, v in wins.items()))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--slots", type=int, nargs="+", default=[6, 8])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, default=1, help="expert groups (1: none)")
    parser.add_argument("--topk-groups", type=int, default=1, help="groups kept per token")
    parser.add_argument("--compare-greedy", action="store_true", help="packers alone, 24 shapes")
    args = parser.parse_args(argv)
    if args.compare_greedy:
        return compare_greedy()
    wl = Workload(num_groups=args.groups, topk_groups=args.topk_groups)
    cases = _loads(args.experts, args.devices, wl, args.seeds)
    for s in args.slots:
        base = Placement.identity(args.experts, args.devices, s)
        fresh, again, r_fresh, r_again = [], [], [], []
        cpu_fresh, cpu_again = [], []
        for i, counts in enumerate(cases):
            times, cpu, ratio, planned = _time(base, counts, wl, args.repeats)
            fresh += times
            cpu_fresh += cpu
            r_fresh.append(ratio)
            drift = 0.7 * counts + 0.3 * cases[(i + 1) % len(cases)]
            times, cpu, ratio, _ = _time(planned, drift, wl, args.repeats)
            again += times
            cpu_again += cpu
            r_again.append(ratio)
        for name, times, cpu, ratios in (
            ("from identity", fresh, cpu_fresh, r_fresh),
            ("after drift", again, cpu_again, r_again),
        ):
            ms = 1e3 * np.array(times)
            print(
                f"E={args.experts} N={args.devices} S={s} groups={args.groups} {name:>13}: "
                f"median {np.median(ms):5.1f} ms (min {ms.min():5.1f}, max {ms.max():5.1f}; "
                f"CPU {1e3 * np.median(cpu):5.1f}); "
                f"step vs start {' '.join(f'{r:.4f}' for r in ratios)}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
