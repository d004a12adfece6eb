"""Benchmark the grouped matmul (pallas_kernels.gmm) on the named shapes.

For each shape it reports the median time after warm-up, useful TFLOP/s (2 * rows in groups * K
* N) and ratios to a dense matmul of the same FLOPs and to `jax.lax.ragged_dot`, all timed in
the same process. On a GPU it times the Pallas-Triton kernel, and, where available, jax's
`ragged_dot_mgpu` (Hopper only) and `torch._grouped_mm` (torch with CUDA installed); that
path ran on one H100 on 2026-11-24 (BENCHMARKS.md, "One H100, measured"). Without a GPU it
runs a CPU part at reduced shapes: the reference backend (what `backend="auto"` picks on
CPU), `jax.lax.ragged_dot` and the dense matmul are timed; the Pallas kernels run in interpret
mode for correctness only (no timing).

Run: python experiments/bench_kernels.py [--repeats 5]   (CPU: ~1 min on 2 cores)
Absolute times on a shared CPU are noisy (other jobs run beside it): read the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time

# pallas_kernels is a top-level package of the repo; make it importable when run as a script.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.shapes import SHAPES, ShapeSpec

# CPU: the routing patterns and the two model shapes at sizes a 2-core CPU runs in seconds.
CPU_SHAPES = {
    "balanced": dict(m=2048, k=512, n=512),
    "all_in_one": dict(m=2048, k=512, n=512),
    "one_per_group": dict(m=2048, k=512, n=512),
    "with_empty": dict(m=2048, k=512, n=512),
    "zipf_small": dict(m=2048, k=512, n=512),
    "mixtral_8x7b": dict(m=2048, k=512, n=1024),
    "fine_grained": dict(m=2048, k=256, n=128),
}
GPU_SHAPES = ("balanced", "all_in_one", "zipf_small", "mixtral_8x7b", "fine_grained")
GPU_SMALL = dict(m=16384, k=2048, n=2048)  # the pattern shapes at a GPU-sized scale


def median_seconds(fn, *args, repeats: int, warmup: int = 2) -> float:
    """Median wall time of fn(*args) after `warmup` calls (compilation included in the first)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_inputs(spec: ShapeSpec, dtype):
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((spec.m, spec.k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((spec.g, spec.k, spec.n)) / spec.k**0.5, dtype)
    return lhs, rhs, jnp.asarray(spec.group_sizes())


def dense_fn(spec: ShapeSpec, dtype):
    """A dense matmul with the same useful FLOPs: [rows in groups, K] @ [K, N]."""
    rows = spec.used or spec.m
    x = jnp.ones((rows, spec.k), dtype)
    w = jnp.ones((spec.k, spec.n), dtype)
    return jax.jit(lambda a, b: a @ b), (x, w)


def time_impls(spec: ShapeSpec, impls: dict, dtype, repeats: int) -> dict[str, float]:
    lhs, rhs, sizes = make_inputs(spec, dtype)
    times = {name: median_seconds(f, lhs, rhs, sizes, repeats=repeats) for name, f in impls.items()}
    fn, args = dense_fn(spec, dtype)
    times["dense"] = median_seconds(fn, *args, repeats=repeats)
    return times


def rows_for(spec: ShapeSpec, times: dict[str, float]) -> list[str]:
    out = []
    for name, seconds in times.items():
        tflops = spec.flops() / seconds / 1e12
        vs_dense = times["dense"] / seconds
        vs_ragged = times["ragged_dot"] / seconds if "ragged_dot" in times else float("nan")
        out.append(
            f"| {spec.name} | {spec.m}x{spec.k}x{spec.n}, G={spec.g} | {name} | "
            f"{seconds * 1e3:.2f} | {tflops:.4f} | {vs_dense:.2f} | {vs_ragged:.2f} |"
        )
    return out


HEADER = [
    "| shape | M x K x N, G | impl | median ms | TFLOP/s | dense time / impl time "
    "| ragged_dot time / impl time |",
    "|---|---|---|---|---|---|---|",
]


def interpret_check(spec: ShapeSpec) -> str:
    """Max relative error of both Pallas kernels (interpret mode) vs the reference, fwd only."""
    small = spec.scaled(m=256, k=128, n=128)
    lhs, rhs, sizes = make_inputs(small, jnp.float32)
    want = pk.reference_gmm(lhs, rhs, sizes)
    errs, config = [], pk.Config(128, 128, 128)
    for backend in ("pallas_triton", "pallas_tpu"):
        got = pk.gmm(lhs, rhs, sizes, backend=backend, interpret=True, config=config)
        errs.append(float(jnp.abs(got - want).max() / (jnp.abs(want).max() + 1e-30)))
    return f"{spec.name} (at 256x128x128): triton {errs[0]:.1e}, tpu {errs[1]:.1e}"


def run_cpu(repeats: int) -> None:
    impls = {
        "reference": jax.jit(lambda x, w, s: pk.gmm(x, w, s, backend="reference")),
        "ragged_dot": jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s)),
    }
    lines, checks = list(HEADER), []
    for name, size in CPU_SHAPES.items():
        spec = SHAPES[name].scaled(**size)
        lines += rows_for(spec, time_impls(spec, impls, jnp.float32, repeats))
        checks.append(interpret_check(spec))
    print("\n".join(lines))
    print("\nInterpret-mode Pallas vs reference, max |err| / max |ref| (fp32):")
    print("\n".join(f"- {c}" for c in checks))
    print("\nGPU figures: pending (no GPU in this run).")


def gpu_impls(device_kind: str) -> dict:
    """Pallas-Triton, ragged_dot, ragged_dot_mgpu (Hopper)."""
    impls = {
        "pallas_triton": jax.jit(lambda x, w, s: pk.gmm(x, w, s, backend="pallas_triton")),
        "ragged_dot": jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s)),
    }
    if any(tag in device_kind for tag in ("H100", "H200", "H800", "GH200")):
        import importlib

        mgpu = importlib.import_module("jax.experimental.pallas.ops.gpu.ragged_dot_mgpu")
        kw = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
        impls["ragged_dot_mgpu"] = jax.jit(
            lambda x, w, s: mgpu.ragged_dot(x, w, group_sizes=s, **kw)
        )
    return impls


def torch_grouped_mm_seconds(spec: ShapeSpec, repeats: int) -> float | None:
    """torch._grouped_mm (bf16, CUDA) on the same shape, or None."""
    try:
        import torch
    except ImportError:
        return None
    if not (torch.cuda.is_available() and hasattr(torch, "_grouped_mm")):
        return None
    a = torch.randn(spec.m, spec.k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(spec.g, spec.k, spec.n, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor(np.cumsum(spec.group_sizes()), device="cuda", dtype=torch.int32)
    for _ in range(2):
        torch._grouped_mm(a, b, offs=offs)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch._grouped_mm(a, b, offs=offs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_gpu(repeats: int) -> None:
    kind = jax.devices()[0].device_kind
    lines = list(HEADER)
    for name in GPU_SHAPES:
        spec = SHAPES[name]
        if spec.m < 4096:
            spec = spec.scaled(**GPU_SMALL)
        times = time_impls(spec, gpu_impls(kind), jnp.bfloat16, repeats)
        if (t := torch_grouped_mm_seconds(spec, repeats)) is not None:
            times["torch._grouped_mm"] = t
        lines += rows_for(spec, times)
    print(f"device: {kind}, bf16")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    backend = jax.default_backend()
    print(f"# bench_kernels {datetime.date.today()} jax {jax.__version__} backend={backend}")
    if backend == "gpu":
        run_gpu(args.repeats)
    else:
        kind = jax.devices()[0].device_kind
        print(f"No GPU detected ({kind}): CPU part at reduced shapes, fp32.")
        run_cpu(args.repeats)


if __name__ == "__main__":
    from pallas_kernels.targets import use_cpu_unless_accelerator

    use_cpu_unless_accelerator()  # no GPU/TPU here: no plugin tracebacks
    main()
