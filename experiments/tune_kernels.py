"""Tile sweep of the Pallas-Triton grouped-matmul kernels on a real GPU (gmm, gmm_t, tgmm).

For each named shape and kernel it times the default tiles (`pallas_kernels.config.
default_config`) and every candidate of `pallas_kernels.autotune.candidates` (median of
`--repeats` after warm-up, `jax.block_until_ready`), prints the best beside the default with
useful TFLOP/s and, for the best tiles, the error against `jax.lax.ragged_dot` (forward) or the
reference tgmm. `dense` is one `[rows, K] @ [K, N]` matmul of the same useful FLOPs, timed in
the same process.

Run (GPU only): python experiments/tune_kernels.py [--shapes mixtral_8x7b fine_grained]
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.autotune import candidates
from pallas_kernels.config import default_config
from pallas_kernels.shapes import SHAPES

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_kernels import GPU_SMALL, median_seconds  # noqa: E402  (the kernel benchmark's)


def tiles(c) -> str:
    return f"{c.tm}x{c.tk}x{c.tn} w{c.num_warps} s{c.num_stages}"


def parse_config(text: str) -> pk.Config:
    """`64x64x256:8:4` -> Config(64, 64, 256, num_warps=8, num_stages=4)."""
    sizes, warps, stages = text.split(":")
    tm, tk, tn = (int(v) for v in sizes.split("x"))
    return pk.Config(tm, tk, tn, num_warps=int(warps), num_stages=int(stages))


def problem(kernel: str, spec, dtype):
    """(fn(config), args, reference output, useful FLOPs) of one kernel on one shape."""
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(spec.group_sizes())
    x = jnp.asarray(rng.standard_normal((spec.m, spec.k)), dtype)
    flops = 2.0 * int(sizes.sum()) * spec.k * spec.n
    if kernel == "tgmm":  # weight gradient: x^T dy per group, [G, K, N]
        dy = jnp.asarray(rng.standard_normal((spec.m, spec.n)) / spec.k**0.5, dtype)

        def fn(c):
            return jax.jit(lambda a, b, s: pk.tgmm(a, b, s, backend="pallas_triton", config=c))

        want = pk.tgmm(x, dy, sizes, backend="reference")
        return fn, (x, dy, sizes), want, flops
    w = jnp.asarray(rng.standard_normal((spec.g, spec.k, spec.n)) / spec.k**0.5, dtype)
    t = kernel == "gmm_t"
    if t:  # the input gradient dy @ w_g^T: dy [M, N], w [G, K, N] read transposed, out [M, K]
        x = jnp.asarray(rng.standard_normal((spec.m, spec.n)), dtype)
        want = jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), sizes)
    else:
        want = jax.lax.ragged_dot(x, w, sizes)

    def fn(c):
        return jax.jit(
            lambda a, b, s: pk.gmm(a, b, s, transpose_rhs=t, backend="pallas_triton", config=c)
        )

    return fn, (x, w, sizes), want, flops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["balanced", "mixtral_8x7b", "fine_grained"])
    p.add_argument("--kernels", nargs="+", default=["gmm", "gmm_t", "tgmm"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--configs",
        nargs="+",
        help="time only these tiles (and the default), e.g. 64x64x256:8:4 (tm x tk x tn:warps:"
        "stages), printing every one; default: the whole candidate grid, best only",
    )
    args = p.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("tune_kernels.py needs a GPU")
    dtype = jnp.bfloat16
    kind = jax.devices()[0].device_kind
    print(f"# tune_kernels {datetime.date.today()} jax {jax.__version__} {kind}, bf16")
    print("| shape | kernel | default tiles | default ms | default TFLOP/s | best tiles "
          "| best ms | best TFLOP/s | dense TFLOP/s | best rel. err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        spec = SHAPES[name]
        if spec.m < 4096:
            spec = spec.scaled(**GPU_SMALL)
        rows = int(np.sum(spec.group_sizes()))
        for kernel in args.kernels:
            fn, operands, want, flops = problem(kernel, spec, dtype)
            if kernel == "tgmm":
                k, n = spec.k, spec.n
                dense_args = (jnp.ones((k, rows), dtype), jnp.ones((rows, n), dtype))
            else:
                k, n = (spec.n, spec.k) if kernel == "gmm_t" else (spec.k, spec.n)
                dense_args = (jnp.ones((rows, k), dtype), jnp.ones((k, n), dtype))
            dense = median_seconds(jax.jit(jnp.matmul), *dense_args, repeats=args.repeats)
            default = default_config(kernel, "pallas_triton", dtype, spec.m, k, n, spec.g)
            timings = {}
            grid = [parse_config(c) for c in args.configs] if args.configs else None
            for c in (default, *(grid or candidates(kernel, dtype))):
                if c in timings:
                    continue
                try:
                    timings[c] = median_seconds(fn(c), *operands, repeats=args.repeats)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                    print(f"  skip {c}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            best = min(timings, key=timings.get)
            if grid:
                for c, t in timings.items():
                    print(f"  {name} {kernel} {tiles(c)}: {t * 1e3:.3f} ms, "
                          f"{flops / t / 1e12:.0f} TFLOP/s")  # fmt: skip
            got = fn(best)(*operands).astype(jnp.float32)
            ref = want.astype(jnp.float32)
            err = float(jnp.abs(got - ref).max() / (jnp.abs(ref).max() + 1e-30))

            print(
                f"| {name} {spec.m}x{spec.k}x{spec.n} G={spec.g} | {kernel} | {tiles(default)} "
                f"| {timings[default] * 1e3:.3f} | {flops / timings[default] / 1e12:.0f} "
                f"| {tiles(best)} | {timings[best] * 1e3:.3f} | {flops / timings[best] / 1e12:.0f} "
                f"| {flops / dense / 1e12:.0f} | {err:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    from pallas_kernels.targets import use_cpu_unless_accelerator

    use_cpu_unless_accelerator()  # no GPU/TPU here: no plugin tracebacks
    main()
