"""Replays a placed training run's routing trace through its placement controller.

A run trained with `--placement` leaves `routing_trace.npy` (`[steps, MoE layers, experts]`
expert counts) and `placement_controller.json` (the controller as built: hardware figures, layer
shape, knobs, initial tables). This feeds the trace to that controller the way the training loop
did (`moejax.placement.replay`) and prints, per phase of the run, the mean imbalance fall per
re-placement as the controller forecast it (calibrated), in sample (on the steps it planned on),
as measured (10 steps before against 10 steps after), and as caused by the re-placement alone
(old against new table on the same steps after); then the mean device imbalance of the layouts
that ran against the static ones. With the run's own knobs the replay makes the run's decisions
(it says whether they match the recorded `placement_events.jsonl`); `--set` tries other knobs on
the same routing.

Run (seconds; numpy only after the imports; `python -m moejax.cli.replay_placement` is the same
command):
  python experiments/train_lm.py --placement --out runs/tiny_placed
  python experiments/replay_placement.py runs/tiny_placed
  python experiments/replay_placement.py runs/tiny_placed --set react_steps=1 --set ema_decay=0.9
"""

from __future__ import annotations

import collections
import json
import os
import sys

from moejax.cli._parser import OneLineParser, positive_int
from moejax.placement import PlacementController, load_trace
from moejax.placement.controller import SPEC_FILE
from moejax.placement.replay import config_overrides, replay
from moejax.training.placement_runtime import mean_fall, measured_effect, read_events
from pallas_kernels.targets import use_cpu_unless_accelerator


def _phases(bounds: list[int], last: int) -> list[tuple[int, int]]:
    edges = [0, *sorted(b for b in bounds if 0 < b < last), last]
    return [(lo + 1, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]


def main(argv: list[str] | None = None) -> int:
    use_cpu_unless_accelerator()  # no GPU/TPU here: no plugin tracebacks (pallas_kernels.targets)
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory of train_lm.py --placement")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a ControllerConfig field (JSON value), e.g. react_steps=1; repeatable",
    )
    parser.add_argument(
        "--phases",
        type=positive_int,
        nargs="*",
        default=[60, 300, 600],
        help="step boundaries of the phases reported (default: 60 300 600)",
    )
    parser.add_argument(
        "--window", type=positive_int, default=10, help="steps before/after an event"
    )
    args = parser.parse_args(argv)

    if not os.path.isdir(args.run_dir):
        what = "not a directory" if os.path.exists(args.run_dir) else "no such directory"
        parser.error(f"{args.run_dir}: {what} (a run directory of train_lm.py --placement)")
    spec_path = os.path.join(args.run_dir, SPEC_FILE)
    trace_path = os.path.join(args.run_dir, "routing_trace.npy")
    for path in (spec_path, trace_path):
        if not os.path.exists(path):
            parser.error(f"{path} not found: is {args.run_dir} a run of train_lm.py --placement?")
    try:
        with open(spec_path) as f:
            spec = json.load(f)
    except (OSError, ValueError) as err:  # unreadable, or not JSON
        parser.error(f"{spec_path}: cannot be read ({err})")
    try:
        controller = PlacementController.from_spec(spec, **config_overrides(args.set))
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    try:
        trace = load_trace(trace_path)
    except (OSError, ValueError) as err:
        parser.error(f"{trace_path}: {err}")
    result = replay(controller, trace)

    print(
        f"{args.run_dir}: {trace.shape[0]} steps, {trace.shape[1]} MoE layers, "
        f"{trace.shape[2]} experts; controller {controller.config}"
    )
    if not args.set:
        recorded = read_events(args.run_dir)
        key = lambda e: (e["applied_after_step"], e["layer"], e["new"])  # noqa: E731
        same = [key(e) for e in recorded] == [key(e) for e in result.events]
        print(
            f"recorded re-placements: {len(recorded)}; replayed: {len(result.events)}; "
            f"same decisions: {'yes' if same else 'no'}"
        )
    rows = measured_effect(result.records, result.events, window=args.window)
    print(
        f"\n{'steps':>12} {'events':>7} {'forecast':>9} {'in-sample':>10} {'measured':>9} "
        f"{'old->new':>9}   (mean imbalance fall per re-placement)"
    )
    for lo, hi in [(1, trace.shape[0]), *_phases(args.phases, trace.shape[0])]:
        falls = mean_fall([r for r in rows if lo <= r["applied_after_step"] <= hi])
        if falls:
            print(
                f"{f'{lo}-{hi}':>12} {falls['fall_events']:>7} {falls['predicted_fall']:>9.3f} "
                f"{falls['in_sample_fall']:>10.3f} {falls['measured_fall']:>9.3f} "
                f"{falls['counterfactual_fall']:>9.3f}"
            )
    print(
        f"\nmean device imbalance: placed {result.placed_imbalance.mean():.3f}, "
        f"static {result.static_imbalance.mean():.3f}; re-placements {len(result.events)}, "
        f"host decision time {controller.decision_wall_s:.2f} s"
    )
    checks = collections.Counter(d.outcome for d in controller.log)
    print(
        f"checks: {len(controller.log)}: "
        + ", ".join(f"{k} {v}" for k, v in checks.most_common())
        + " (moejax.placement.controller.OUTCOMES)"
    )
    moved = {e["layer"] for e in result.events}
    for layer in range(trace.shape[1]):
        last = [d for d in controller.log if d.layer == layer]
        if layer not in moved and last:
            d = last[-1]
            print(f"MoE {layer} never re-placed; last check, step {d.step}: {d.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
