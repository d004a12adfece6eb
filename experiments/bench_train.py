"""Benchmark LM training throughput: tokens/s and achieved FLOP/s over the machine's matmul FLOP/s.

For each preset (default `tiny` and `small`), on the default 2 x 4 data x expert mesh of 8
simulated CPU devices (or the accelerators present): compile the sharded train step, run 2
warm-up steps, then time `--steps` steps one by one (`jax.block_until_ready` after each) and take
the median. In the same process it times a large fp32 matmul (`--matmul` cubed, on one device,
medians after warm-up) as the machine's achievable matmul FLOP/s. Model FLOPs per step are
`moejax.training.flops_per_token` (6 x active params + attention, PaLM's convention) x tokens, so
the ratio is a model-FLOPs utilisation against measured, not datasheet, peak.

Run: python experiments/bench_train.py [--presets tiny small] [--steps 5] [--batch-size N]
(~5 min on 2 CPU cores, most of it `small`'s steps). On a shared CPU absolute numbers are noisy:
read the ratio, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np

from moejax import data, parallel
from moejax.models import param_counts, presets
from moejax.training import (
    flops_per_token,
    global_batch,
    init_train_state,
    make_train_step,
)
from moejax.training import presets as train_presets


def matmul_flops_per_s(n: int, repeats: int) -> float:
    """Median FLOP/s of an `n x n @ n x n` fp32 matmul on one device."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    for _ in range(2):
        jax.block_until_ready(f(a, a))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, a))
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def bench_preset(name: str, mesh, steps: int, batch_size: int | None, bf16: bool) -> dict:
    model_cfg = presets.get(name)
    if bf16:
        model_cfg = model_cfg.replace(dtype="bfloat16")
    train_cfg = train_presets.get(name)
    if batch_size:
        train_cfg = train_cfg.replace(batch_size=batch_size)
    seq_len = train_cfg.seq_len or model_cfg.max_seq_len
    corpus = data.default_corpus()
    it = data.BatchIterator(corpus.tokens, train_cfg.batch_size, seq_len, seed=0)
    state = init_train_state(model_cfg, train_cfg, mesh)
    step = make_train_step(model_cfg, train_cfg, mesh)
    t0 = time.perf_counter()
    for _ in range(2):  # compile + one warm step
        state, metrics = step(state, global_batch(it.next(), mesh))
        jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        batch = global_batch(it.next(), mesh)
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    tokens = train_cfg.batch_size * seq_len
    flops = flops_per_token(model_cfg, seq_len) * tokens
    return {
        "preset": name + (" bf16" if bf16 else ""),
        "active": param_counts(model_cfg).active,
        "tokens": tokens,
        "step_s": dt,
        "tokens_per_s": tokens / dt,
        "flops_per_s": flops / dt,
        "compile_s": compile_s,
        "loss": float(metrics.loss),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--steps", type=int, default=5, help="timed steps per preset")
    p.add_argument("--batch-size", type=int, help="override the presets' global batch")
    p.add_argument("--bf16", action="store_true", help="bf16 compute")
    p.add_argument("--matmul", type=int, default=2048, help="n of the n^3 reference matmul")
    p.add_argument("--mesh", default="2,4")
    args = p.parse_args()
    shape = tuple(int(x) for x in args.mesh.split(","))
    mesh = parallel.make_mesh(shape)
    peak = matmul_flops_per_s(args.matmul, repeats=7)
    rows = [bench_preset(n, mesh, args.steps, args.batch_size, args.bf16) for n in args.presets]
    peak_after = matmul_flops_per_s(args.matmul, repeats=7)  # the machine may be shared: bracket
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(
        f"\n{jax.device_count()} {jax.default_backend()} devices, mesh {dict(mesh.shape)}; "
        f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}; "
        f"jax {jax.__version__}; commit {commit or '?'}"
    )
    print(
        f"matmul {args.matmul}^3 fp32 on one device: {peak / 1e9:.1f} GFLOP/s before, "
        f"{peak_after / 1e9:.1f} after the training runs\n"
    )
    ref = max(peak, peak_after)
    print(
        "| preset | active params | tokens/step | step (median) | tokens/s | achieved FLOP/s "
        "| / matmul FLOP/s | compile + 1 step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['preset']} | {r['active'] / 1e6:.2f} M | {r['tokens']} | {r['step_s']:.3f} s "
            f"| {r['tokens_per_s']:,.0f} | {r['flops_per_s'] / 1e9:.2f} G "
            f"| {r['flops_per_s'] / ref:.1%} | {r['compile_s']:.1f} s |"
        )


if __name__ == "__main__":
    from pallas_kernels.targets import use_cpu_unless_accelerator

    use_cpu_unless_accelerator()  # no GPU/TPU here: no plugin tracebacks
    main()
