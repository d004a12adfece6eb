"""Does a real-size model fit? Compile its full train step for 64 H100s and TPU v5p slices on
this CPU machine (deviceless) and report, per layout, per-device memory against HBM, compile
time, FLOPs per step and a roofline bound on step time and MFU.

Run: python -m pallas_kernels.targets --install   (once; the compilers)
     python experiments/plan_scale.py             (every real-size preset on h100x64 and
                                                   v5p-64: ~20-40 min on 2 cores)
     python experiments/plan_scale.py --preset mixtral_8x7b --target h100x64
     python experiments/plan_scale.py --target h100x8 --batch 128   (one node)
     python experiments/plan_scale.py --preset deepseek_v3_4l   (DeepSeek-V3's widths, 4
                                                   layers: does one layer-unit fit?)
Ends with one line per preset and target: the best layout found and `fits` / `does not fit`.
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
        for target_name in args.target:
            target = fit.TARGETS[target_name]
            group = []
            for layout in fit.default_layouts(model_cfg, target):
                try:
                    row = fit.plan_row(name, model_cfg, train_cfg, target, layout)
                except Exception as err:  # noqa: BLE001 - a layout that does not compile is a row
                    print(f"{name} {target.name} {layout}: does not compile: {str(err)[:200]}")
                    continue
                print(fit.markdown([row]).splitlines()[-1], flush=True)
                group.append(row)
            rows += group
            if group:
                summary.append(fit.summary_line(group))
    print("\n" + fit.markdown(rows))
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
