"""Compile moejax for H100 and TPU on this machine (no accelerator) and report what the
compilers say: per kernel registers, spills, grid and shared memory (H100) or scoped VMEM
(TPU), and for the sharded layer and the LM train step the kernels in the program, compile time
and memory per device.

Run: python -m pallas_kernels.targets --install   (once: CUDA plugin, ptxas, libtpu; ~1.3 GB)
     python experiments/compile_report.py > compile_report.md

`--sections h100` (or v5e, v5p, layer, train) makes those tables alone.

Markdown on stdout; progress on stderr, one line per compile job (18: three kernel reports,
each a subprocess compiling every kernel case, 12 sharded layers, 3 train steps) with its time
and the time so far. Its time is the sum of XLA compiles, all on the CPU: it grows with the
cores taken by other work and with the jax version; see the README for measured times.

The tables go to BENCHMARKS.md ("Deviceless accelerator compiles"). Nothing here runs a kernel:
speed needs the hardware (experiments/bench_kernels.py on a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import subprocess
import sys
import time

# Deviceless: compiled for H100 and TPU from the CPU backend, whatever JAX_PLATFORMS says (with
# a GPU plugin installed and no GPU, jax would fail to start it and the compiles would fail).
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

import moejax
from moejax import aot, parallel
from moejax.models import presets
from moejax.parallel import Strategy
from moejax.training import presets as train_presets
from pallas_kernels import resources, targets

LAYER = moejax.MoEConfig(d_model=1024, d_ff=2048, num_experts=8, top_k=2, param_dtype="bfloat16")
CAPACITY = LAYER.replace(drop_policy="capacity")
# The layer's strategy space, and the capacity dispatcher (the default of a capacity layer).
CASES = [
    *((LAYER, s) for s in parallel.strategy_space(LAYER)),
    (CAPACITY, Strategy("expert", "capacity")),
]
TARGETS = (("cuda", {}, "8 x H100"), ("tpu", {"generation": "v5e"}, "TPU v5e 2x4"))


def _kernels(counts: dict) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


class Progress:
    """One stderr line per finished job: `[k/total] what: s (elapsed m:ss)`."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def __call__(self, what: str, fn):
        t0 = time.perf_counter()
        print(f"[{self.done + 1}/{self.total}] {what} ...", file=sys.stderr, flush=True)
        out = fn()
        self.done += 1
        now = time.perf_counter()
        elapsed = f"{int(now - self.start) // 60}:{int(now - self.start) % 60:02d}"
        print(
            f"[{self.done}/{self.total}] {what}: {now - t0:.0f} s (elapsed {elapsed})",
            file=sys.stderr,
            flush=True,
        )
        return out


TRAIN_TARGETS = (*TARGETS, ("tpu", {"generation": "v5p"}, "TPU v5p 2x2x2"))


def layer_rows(progress: Progress) -> list[str]:
    head = "| target | strategy | kernels in the program | compile s | bytes per device |"
    rows = [head, "|---|---|---|---|---|"]
    for platform, kw, label in TARGETS:
        mesh = aot.mesh(platform, (2, 4), ("data", "expert"), **kw)
        for cfg, strategy in CASES:
            fn, args = aot.layer_program(cfg, mesh, strategy, tokens=16384, dtype=jnp.bfloat16)
            what = f"sharded layer, {label}, {strategy.mode}/{strategy.dispatcher}"
            what += f", chunks {strategy.chunks}" + ", staggered" * strategy.stagger
            out = progress(what, lambda fn=fn, args=args: aot.compile_program(fn, args))
            rows.append(
                f"| {label} | {strategy.mode}/{strategy.dispatcher}, chunks {strategy.chunks}"
                f"{' staggered' * strategy.stagger} | "
                f"{_kernels(out.kernels)} | {out.seconds:.1f} | {out.peak_bytes / 2**20:.0f} MiB |"
            )
    return rows


def train_step_rows(progress: Progress) -> list[str]:
    rows = [
        "| target | kernels in the program | compile s | per-device bytes |",
        "|---|---|---|---|",
    ]
    model_cfg, train_cfg = presets.get("tiny"), train_presets.get("tiny")
    for platform, kw, label in TRAIN_TARGETS:
        mesh = aot.mesh(platform, (2, 4), ("data", "expert"), **kw)
        program = aot.train_step_program(model_cfg, train_cfg, mesh)
        out = progress(f"tiny LM train step, {label}", lambda p=program: aot.compile_program(*p))
        rows.append(
            f"| {label} | {_kernels(out.kernels)} | {out.seconds:.1f} | "
            f"{out.peak_bytes / 2**20:.0f} MiB |"
        )
    return rows


SECTIONS = ("h100", "v5e", "v5p", "layer", "train")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
        help="tables to make (default: all): h100, v5e, v5p (kernels), layer, train",
    )  # fmt: skip
    sections = parser.parse_args().sections
    platforms = {"cuda"} if "h100" in sections else set()
    if {"v5e", "v5p"} & set(sections):
        platforms.add("tpu")
    if {"layer", "train"} & set(sections):
        platforms |= {"cuda", "tpu"}
    for platform in sorted(platforms):
        if (why := targets.missing(platform)) is not None:
            raise SystemExit(f"error: cannot compile for {platform}: {why}")
    if "tpu" in platforms:
        # libtpu prints a warning to stderr when it first loads: before the Markdown starts.
        aot.mesh("tpu", (2, 4), ("data", "expert"), generation="v5e")
    jobs = sum(s in sections for s in ("h100", "v5e", "v5p"))
    jobs += len(TARGETS) * len(CASES) * ("layer" in sections)
    progress = Progress(jobs + len(TRAIN_TARGETS) * ("train" in sections))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"# compile_report {datetime.date.today()} jax {jax.__version__} commit {commit}\n")
    if "h100" in sections:
        print("## Kernels, forward + VJP, H100 (ptxas -v, XLA thunk sequence)\n")
        cases = len(resources.default_cases("cuda"))
        report = progress(f"kernels ({cases} cases), H100", lambda: resources.report("cuda"))
        print(resources.markdown(report), flush=True)
    for generation in ("v5e", "v5p"):
        if generation not in sections:
            continue
        print(f"\n## Kernels, forward + VJP, TPU {generation} (Mosaic scoped VMEM)\n")
        cases = len(resources.default_cases("tpu"))
        report = progress(
            f"kernels ({cases} cases), TPU {generation}",
            lambda g=generation: resources.report("tpu", generation=g),
        )
        print(resources.markdown(report), flush=True)
    if "layer" in sections:
        print("\n## Sharded layer fwd+bwd, D=1024 F=2048 E=8 top-2 bf16, 16384 tokens, 2x4 mesh\n")
        print("\n".join(layer_rows(progress)), flush=True)
    if "train" in sections:
        print("\n## Tiny LM train step, 2x4 data x expert mesh\n")
        print("\n".join(train_step_rows(progress)))


if __name__ == "__main__":
    main()
