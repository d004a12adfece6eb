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
     python experiments/plan_scale.py --hf-config path/to/GLM-4.7-Flash --target h100x8
                                                  (any model moejax loads, from its
                                                   config.json alone, compiled at its
                                                   published depth: ~1-2 min a layout)
     ... --state-only                             (no compile: the state per device only,
                                                   seconds; no compilers needed)
Per preset and target it prints each layout's row, then the training state one device stores
(parameters + Adam moments, from the partition specs, no compile) per layer of each kind and,
for a reduced-depth preset (`presets.FULL_DEPTH`), at the published depth. A `--hf-config`
model is compiled whole (scanned layers: one body per kind of block, so its depth costs little
compile time) and trains with `moejax.training.presets.real_size()` at `--seq-len` (default
4096), bf16 compute over fp32 master weights. Ends with one line
per preset and target: the best layout found and `fits` / `does not fit`.
The logic lives in `moejax.aot.fit`; the table is in BENCHMARKS.md ("Real scale").
"""

from __future__ import annotations

import datetime
import os
import pathlib
import sys

# Deviceless: compiled for H100 and TPU from the CPU backend, whatever JAX_PLATFORMS says.
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax

from moejax.aot import fit
from moejax.cli import OneLineParser, positive_int
from moejax.interop.hf import CheckpointError, lm_config_from_hf, read_config
from moejax.models import presets
from moejax.training import presets as train_presets
from pallas_kernels import targets

HF_SEQ_LEN = 4096  # a Hugging Face config's max_position_embeddings is not a training length


def _models(args) -> list[tuple[str, object, object, tuple | None]]:
    """`(name, LMConfig to compile, TrainConfig, published FFN kinds or None)` per model."""
    out = []
    for name in args.preset or ([] if args.hf_config else presets.REAL_SIZE):
        out.append((name, presets.get(name), train_presets.get(name), presets.FULL_DEPTH.get(name)))
    for path in args.hf_config or ():
        try:
            cfg, family = lm_config_from_hf(read_config(path))
        except CheckpointError as err:
            raise SystemExit(f"error: --hf-config {path}: {err}") from None
        name = f"{family}:{pathlib.Path(path).name.removesuffix('.json')}"
        train_cfg = train_presets.real_size(seq_len=HF_SEQ_LEN)
        out.append((name, cfg.replace(dtype="bfloat16"), train_cfg, cfg.mlp_kinds))
    return out


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", nargs="+", choices=sorted(presets.PRESETS),
                        help="model presets (default: the real-size ones, or none with "
                        "--hf-config)")  # fmt: skip
    parser.add_argument(
        "--hf-config",
        nargs="+",
        metavar="PATH",
        help="Hugging Face config.json files or checkpoint directories",
    )
    parser.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the "
                        f"preset's; {HF_SEQ_LEN} for --hf-config)")  # fmt: skip
    parser.add_argument("--state-only", action="store_true",
                        help="no compile: the training state per device only")  # fmt: skip
    parser.add_argument("--target", nargs="+", default=["h100x64", "v5p-64"],
                        choices=sorted(fit.TARGETS))  # fmt: skip
    parser.add_argument("--batch", type=positive_int, help="global batch (default: the preset's)")
    parser.add_argument(
        "--fsdp-expert",
        action="store_true",
        help="only FSDP x expert layouts (no tensor-parallel model axis)",
    )
    parser.add_argument("--microbatches", type=positive_int, nargs="+",
                        help="only layouts with these micro-batch counts")  # fmt: skip
    parser.add_argument("--bf16-moments", action="store_true",
                        help="Adam's moments in bf16 (TrainConfig.moment_dtype)")  # fmt: skip
    args = parser.parse_args()
    models = _models(args)  # config errors before any compiler is looked for
    for platform in {fit.TARGETS[t].platform for t in args.target}:
        if not args.state_only and (why := targets.missing(platform)) is not None:
            raise SystemExit(
                f"error: cannot compile for {platform}: {why}; or --state-only (no compile, no "
                "compilers)"
            )
    print(f"# plan_scale {datetime.date.today()} jax {jax.__version__}\n", flush=True)
    rows, summary = [], []
    for name, model_cfg, train_cfg, full in models:
        if args.batch is not None:
            train_cfg = train_cfg.replace(batch_size=args.batch)
        if args.seq_len is not None:
            train_cfg = train_cfg.replace(seq_len=args.seq_len)
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
            for layout in [] if args.state_only else layouts:
                try:
                    row = fit.plan_row(name, model_cfg, train_cfg, target, layout)
                except Exception as err:  # noqa: BLE001 - a layout that does not compile is a row
                    print(f"{name} {target.name} {layout}: does not compile: {str(err)[:200]}")
                    continue
                print(fit.markdown([row]).splitlines()[-1], flush=True)
                group.append(row)
            state = fit.state_line(
                name, model_cfg, target, layouts[0], full, train_cfg.moment_dtype
            )
            if not args.state_only:  # (the summary below prints it either way)
                print(state, flush=True)
            rows += group
            summary += [fit.summary_line(group)] if group else []
            summary.append(state)
    if rows:
        print("\n" + fit.markdown(rows))
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
