"""Does a real-size model fit? Compile its full train step for 64 H100s and TPU v5p slices on
this CPU machine (deviceless) and report, per layout, per-device memory against HBM, compile
time, FLOPs per step and a roofline bound on step time and MFU.

Run: python -m pallas_kernels.targets --install   (once; the compilers)
     python experiments/plan_scale.py             (every real-size preset on h100x64 and
                                                   v5p-64: ~20-40 min on 2 cores)
     python experiments/plan_scale.py --preset mixtral_8x7b --target h100x64
     python experiments/plan_scale.py --target h100x8 --batch 128   (one node)
     python experiments/plan_scale.py --preset deepseek_v3_4l --fsdp-expert --microbatches 4
                                                  (DeepSeek-V3's widths, 4 layers: one dense
                                                   layer then MoE; does one layer-unit fit?)
     ... --bf16-moments                           (Adam's moments in bf16: 8 bytes of state
                                                   per fp32 parameter instead of 12)
Per preset and target it prints each layout's row, then the training state one device stores
(parameters + Adam moments, from the partition specs, no compile) per layer of each kind and,
for a reduced-depth preset (`presets.FULL_DEPTH`), at the published depth. Ends with one line
per preset and target: the best layout found and `fits` / `does not fit`.
The logic lives in `moejax.aot.fit`; the table is in BENCHMARKS.md ("Real scale").
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys

# Deviceless: compiled for H100 and TPU from the CPU backend, whatever JAX_PLATFORMS says.
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax

from moejax.aot import fit
from moejax.models import presets
from moejax.training import presets as train_presets
from pallas_kernels import targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", nargs="+", default=list(presets.REAL_SIZE),
                        choices=sorted(presets.PRESETS))  # fmt: skip
    parser.add_argument("--target", nargs="+", default=["h100x64", "v5p-64"],
                        choices=sorted(fit.TARGETS))  # fmt: skip
    parser.add_argument("--batch", type=int, help="global batch (default: the preset's)")
    parser.add_argument(
        "--fsdp-expert",
        action="store_true",
        help="only FSDP x expert layouts (no tensor-parallel model axis)",
    )
    parser.add_argument("--microbatches", type=int, nargs="+",
                        help="only layouts with these micro-batch counts")  # fmt: skip
    parser.add_argument("--bf16-moments", action="store_true",
                        help="Adam's moments in bf16 (TrainConfig.moment_dtype)")  # fmt: skip
    args = parser.parse_args()
    for platform in {fit.TARGETS[t].platform for t in args.target}:
        if (why := targets.missing(platform)) is not None:
            raise SystemExit(f"cannot compile for {platform}: {why}")
    print(f"# plan_scale {datetime.date.today()} jax {jax.__version__}\n", flush=True)
    rows, summary = [], []
    for name in args.preset:
        model_cfg, train_cfg = presets.get(name), train_presets.get(name)
        if args.batch:
            train_cfg = train_cfg.replace(batch_size=args.batch)
        if args.bf16_moments:
            train_cfg = train_cfg.replace(moment_dtype="bfloat16")
        for target_name in args.target:
            target = fit.TARGETS[target_name]
            group = []
            layouts = fit.default_layouts(model_cfg, target)
            if args.fsdp_expert:
                layouts = [lay for lay in layouts if "model" not in dict(lay.axes)]
            if args.microbatches:
                layouts = [lay for lay in layouts if lay.microbatches in args.microbatches]
            if not layouts:
                raise SystemExit(f"{name} {target.name}: no layout left by the filters")
            for layout in layouts:
                try:
                    row = fit.plan_row(name, model_cfg, train_cfg, target, layout)
                except Exception as err:  # noqa: BLE001 - a layout that does not compile is a row
                    print(f"{name} {target.name} {layout}: does not compile: {str(err)[:200]}")
                    continue
                print(fit.markdown([row]).splitlines()[-1], flush=True)
                group.append(row)
            full = presets.FULL_DEPTH.get(name)
            state = fit.state_line(
                name, model_cfg, target, layouts[0], full, train_cfg.moment_dtype
            )
            print(state, flush=True)
            rows += group
            summary += [fit.summary_line(group)] if group else []
            summary.append(state)
    print("\n" + fit.markdown(rows))
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
