"""Where a train step's time goes on a real GPU, by kernel class, bf16 vs fp8 expert matmuls:
the step timed, then traced with jax's profiler, each kernel's device time summed per XLA
instruction and classed as `step_breakdown.py` classes them, beside that script's schedule
model replaying the same compiled program. The measured counterpart of `step_breakdown.py`.

Configurations, in this order, each skipped when `--time-limit` would be passed:
  mixtral_2l: Mixtral-8x7B's widths cut to 2 layers, 4 x 4096 tokens (step_breakdown's
    `--model mixtral_8x7b --layers 2 --batch 4 --seq 4096`), where the experts are about half
    the step.
  olmoe_2l: gpu_check's ~1B OLMoE-shaped step, 8 x 2048 tokens.

Per configuration and expert precision: the step's median wall time (ms), the device time of
its kernels per class and in all (kernels on one stream: what they do not fill is launch and
host gaps), and the costliest instructions, measured beside modelled. Writes to `--out`:
results.json, results.md, log.txt, and per step the trace (`<config>_<precision>.trace.json.gz`,
for Perfetto) while the eight returned files allow.

Run on a lent GPU from the repository root (jax with CUDA; ~5 min on an H200):

    python3 experiments/step_profile.py --out $OUT/step_profile

`--fp8-pipelines per_tile,stream` adds an fp8 step per named pipeline of the fp8 kernels
(`fp8_mosaic_gpu.PIPELINES`; the precision column is then `fp8_<pipeline>`), to compare them in
one run; by default fp8 runs each kernel's default pipeline.

`--dry-run`: a tiny model on whatever is there (the CPU's XLA ops stand in for kernels), e.g.
`JAX_PLATFORMS=cpu python experiments/step_profile.py --dry-run --out /tmp/sp`.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import contextlib
import json
import pathlib
import shutil
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from gpu_check_lib import median_seconds, versions  # noqa: E402
from step_breakdown import (  # noqa: E402
    CLASSES,
    classify,
    instruction_lines,
    model_config,
    modelled_ops,
)

from moejax.aot import hlo, schedule, trace  # noqa: E402
from pallas_kernels import fp8_mosaic_gpu  # noqa: E402

CONFIGS = {  # name -> (model, layers, batch, seq)
    "mixtral_2l": ("mixtral_8x7b", 2, 4, 4096),
    "olmoe_2l": ("olmoe_2l", None, 8, 2048),
}
DRY = ("tiny", None, 2, 64)
MAX_TRACES = 4  # of the 8 files a lent machine returns: results.json, .md, log.txt, traces


def profile_step(cfg, batch: int, seq: int, steps: int, hardware, log, trace_dir) -> dict:
    """One configuration and precision: wall time, measured and modelled kernel time."""
    from moejax.training import TrainConfig, init_train_state, make_train_step

    train_cfg = TrainConfig(steps=100, batch_size=batch, seq_len=seq, warmup_steps=1)
    data = jnp.asarray(
        np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1)), jnp.int32
    )
    state = {"s": init_train_state(cfg, train_cfg)}
    start = time.perf_counter()
    compiled = make_train_step(cfg, train_cfg).lower(state["s"], data).compile()
    text = compiled.as_text()
    module = text.split(None, 2)[1].rstrip(",")  # "HloModule <name>, ..."
    row = dict(compile_s=time.perf_counter() - start, module=module)

    def one():
        state["s"], metrics = compiled(state["s"], data)
        return metrics.loss

    row["first_loss"] = float(one())
    row["step_ms"] = median_seconds(one, target_s=0.5, batches=3) * 1e3
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(steps):
            loss = one()
        jax.block_until_ready(loss)
    path = trace.trace_file(trace_dir)
    measured, row["measured_on"] = trace.kernel_seconds(path, module)
    model = {name: seconds for name, (seconds, _) in modelled_ops(text, hardware).items()}
    lines = instruction_lines(text)
    classes = {c: {"measured_ms": 0.0, "modelled_ms": 0.0} for c in (*CLASSES, "unmatched")}
    ops = []
    for name in set(measured) | set(model):
        kind = classify(lines[name]) if name in lines else "unmatched"
        ms = measured.get(name, 0.0) / steps * 1e3
        classes[kind]["measured_ms"] += ms
        classes[kind]["modelled_ms"] += model.get(name, 0.0) * 1e3
        scope = hlo.op_name(lines.get(name, ""))
        ops.append(
            dict(
                op=name,
                kind=kind,
                measured_ms=ms,
                modelled_ms=model.get(name, 0.0) * 1e3,
                scope=scope[-100:],
            )
        )
    row["classes"] = classes
    row["kernel_ms"] = sum(c["measured_ms"] for c in classes.values())
    row["modelled_step_ms"] = schedule.estimate(text, hardware, default_trip_count=0).step_s * 1e3
    row["top_ops"] = sorted(ops, key=lambda o: -o["measured_ms"])[:25]
    row["trace"] = str(path)
    state.clear()
    log(
        f"    step {row['step_ms']:.1f} ms (kernels {row['kernel_ms']:.1f}, modelled "
        f"{row['modelled_step_ms']:.1f}); compile {row['compile_s']:.0f} s; "
        f"first loss {row['first_loss']:.5f}"
    )
    return row


def markdown(results: dict) -> str:
    lines = [
        f"# step_profile {results['date']}",
        "",
        f"device: {results['device']}, jax {results['jax']}, commit {results['commit']}, "
        f"modelled on {results['hardware']}",
        "",
    ]
    for name, rows in results["configs"].items():
        ok = {p: r for p, r in rows.items() if "step_ms" in r}
        if not ok:
            lines += [f"## {name}: {rows}", ""]
            continue
        precisions = list(ok)
        head = " | ".join(f"{p} measured | {p} modelled" for p in precisions)
        lines += [
            f"## {name}",
            "",
            f"| ms per step | {head} |",
            "|---|" + "---|" * (2 * len(precisions)),
        ]
        for kind in (*CLASSES, "unmatched"):
            cells = " | ".join(
                f"{ok[p]['classes'][kind]['measured_ms']:.1f} | "
                f"{ok[p]['classes'][kind]['modelled_ms']:.1f}"
                for p in precisions
            )
            lines.append(f"| {kind} | {cells} |")
        cells = " | ".join(f"{ok[p]['kernel_ms']:.1f} | -" for p in precisions)
        lines.append(f"| all kernels | {cells} |")
        cells = " | ".join(
            f"{ok[p]['step_ms']:.1f} | {ok[p]['modelled_step_ms']:.1f}" for p in precisions
        )
        lines.append(f"| step (wall) | {cells} |")
        for p in precisions:
            if p.startswith("fp8") and "bf16" in ok:
                ratio = ok["bf16"]["step_ms"] / ok[p]["step_ms"]
                lines.append(f"\n{p} / bf16 step: {ratio:.3f}x")
        for p in precisions:
            lines += [
                "",
                f"{p}: costliest instructions (measured ms, modelled ms, class, scope)",
                "```",
            ]
            lines += [
                f"{o['measured_ms']:7.2f} {o['modelled_ms']:7.2f}  {o['kind']:22s} "
                f"{o['op']:28s} {o['scope']}"
                for o in ok[p]["top_ops"]
            ]
            lines.append("```")
        lines.append("")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def fp8_pipeline(pipeline: str | None):
    """The fp8 kernels on `pipeline` while tracing (None: their defaults)."""
    saved = dict(fp8_mosaic_gpu.DEFAULT_PIPELINE)
    if pipeline is not None:
        fp8_mosaic_gpu.DEFAULT_PIPELINE.update(dict.fromkeys(saved, pipeline))
    try:
        yield
    finally:
        fp8_mosaic_gpu.DEFAULT_PIPELINE.update(saved)


def precisions(fp8_pipelines: str | None) -> dict:
    """Column name -> (expert precision, fp8 pipeline or None)."""
    if not fp8_pipelines:
        return {"bf16": ("bf16", None), "fp8": ("fp8", None)}
    names = fp8_pipelines.split(",")
    for name in names:
        if name not in fp8_mosaic_gpu.PIPELINES:
            raise SystemExit(f"--fp8-pipelines: {name!r} is not one of {fp8_mosaic_gpu.PIPELINES}")
    return {"bf16": ("bf16", None), **{f"fp8_{n}": ("fp8", n) for n in names}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="of " + ", ".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=5, help="steps traced per configuration")
    parser.add_argument("--time-limit", type=float, default=420.0, help="seconds in all")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model, any machine")
    parser.add_argument(
        "--fp8-pipelines", default=None,
        help="comma-separated fp8 kernel pipelines to run, each its own column "
        f"(of {', '.join(fp8_mosaic_gpu.PIPELINES)}; default: the kernels' defaults)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    columns = precisions(args.fp8_pipelines)
    # No CUDA graphs: each kernel is then traced as launched, with its XLA instruction (what the
    # attribution needs); the wall times are of the step launched kernel by kernel. (Read when
    # the backend starts, below.)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
    deadline = time.perf_counter() + args.time_limit
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / "log.txt", "w")  # noqa: SIM115

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    device = jax.devices()[0]
    hw_name = "h200" if "H200" in device.device_kind else "h100"
    hardware = schedule.HARDWARE[hw_name]
    results = dict(
        device=device.device_kind,
        jax=jax.__version__,
        commit=versions()["commit"],
        date=time.strftime("%Y-%m-%dT%H:%M:%S"),
        hardware=hw_name,
        configs={},
    )
    log(f"# step_profile: {results['device']}, jax {results['jax']}, commit {results['commit']}")
    names = ["dry"] if args.dry_run else args.configs.split(",")
    traces = 0
    status = 0
    for name in names:
        model, layers, batch, seq = DRY if args.dry_run else CONFIGS[name]
        base = model_config(model, layers, seq)
        rows = results["configs"][name] = {}
        for precision, (expert_precision, pipeline) in columns.items():
            if time.perf_counter() > deadline - (0 if args.dry_run else 60):
                rows[precision] = {"skipped": "the time limit"}
                log(f"## {name} {precision}: skipped (the time limit)")
                continue
            log(f"## {name} {precision}: {batch} x {seq} tokens")
            cfg = base.replace(moe=base.moe.replace(expert_precision=expert_precision))
            with tempfile.TemporaryDirectory() as tmp, fp8_pipeline(pipeline):
                try:
                    rows[precision] = profile_step(
                        cfg,
                        batch,
                        seq,
                        1 if args.dry_run else args.steps,
                        hardware,
                        log,
                        pathlib.Path(tmp),
                    )
                    if traces < MAX_TRACES:
                        shutil.copy(
                            rows[precision]["trace"], args.out / f"{name}_{precision}.trace.json.gz"
                        )
                        traces += 1
                except Exception as err:  # noqa: BLE001  (the next one runs)
                    log(traceback.format_exc())
                    rows[precision] = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
                    status = 1
            jax.clear_caches()
            (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
            (args.out / "results.md").write_text(markdown(results))
    log(markdown(results))
    return status


if __name__ == "__main__":
    from pallas_kernels.targets import use_cpu_unless_accelerator

    use_cpu_unless_accelerator()  # no GPU/TPU here: no plugin tracebacks
    sys.exit(main())
