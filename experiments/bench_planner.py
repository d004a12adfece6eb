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
"""

import argparse
import time

import numpy as np

from moejax.placement import H100_IB, Placement, Workload, plan, step_cost
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--slots", type=int, nargs="+", default=[6, 8])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, default=1, help="expert groups (1: none)")
    parser.add_argument("--topk-groups", type=int, default=1, help="groups kept per token")
    args = parser.parse_args(argv)
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
