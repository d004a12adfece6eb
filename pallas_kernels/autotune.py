"""Tile autotuning for the Pallas-Triton gmm kernels, cached per problem bucket.

UNTESTED ON HARDWARE: `autotune_gmm` only runs on a GPU and has not been run on one yet. Only
the cache-key and cache logic, and that every candidate fits H100 shared memory, are exercised
by the CPU tests.

The winners go into `pallas_kernels.tuned`'s cache, where `ops.gmm(config=None)` on the Triton
backend looks them up.
"""

from __future__ import annotations

import itertools
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels import ops
from pallas_kernels.config import Config, fits
from pallas_kernels.tuned import cache_key, cached_config, store_config


def candidates(kernel: str = "gmm", dtype=jnp.bfloat16) -> tuple[Config, ...]:
    """The search space: a small grid, keeping only configs that fit H100 shared memory."""
    grid = itertools.product((64, 128), (32, 64, 128), (128, 256), (4, 8), (3, 4))
    return tuple(
        c
        for tm, tk, tn, w, s in grid
        if fits(kernel, "pallas_triton", c := Config(tm, tk, tn, num_warps=w, num_stages=s), dtype)
    )


def _median_seconds(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def autotune_gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    configs: tuple[Config, ...] | None = None,
    reps: int = 5,
) -> Config:
    """Times every candidate Config for the Triton gmm on these inputs; caches and returns the
    fastest. GPU only (raises RuntimeError elsewhere). Candidates that fail to compile are skipped.

    Args:
      lhs: [M, K]; rhs: [G, K, N] ([G, N, K] with transpose_rhs); group_sizes: [G] int32 (a
        representative routing).
      transpose_rhs: tune the transposed kernel ("gmm_t", the lhs gradient) instead.
      configs: Configs to try; None: `candidates(kernel, lhs.dtype)`.
      reps: timed repetitions per candidate (median).

    Returns:
      The fastest Config, also stored under `cache_key(M, K, N, G, lhs.dtype, kernel=...)`.
    """
    if jax.default_backend() != "gpu":
        raise RuntimeError(f"autotune_gmm needs a GPU, backend is {jax.default_backend()!r}")
    kernel = "gmm_t" if transpose_rhs else "gmm"
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    key = cache_key(lhs.shape[0], lhs.shape[1], n, rhs.shape[0], lhs.dtype, kernel=kernel)
    if (hit := cached_config(key)) is not None:
        return hit
    timings = {}
    for config in configs or candidates(kernel, lhs.dtype):

        def fn(x, w, s, c=config):
            return ops.gmm(x, w, s, transpose_rhs=transpose_rhs, backend="pallas_triton", config=c)

        fn = jax.jit(fn)
        try:
            timings[config] = _median_seconds(lambda f=fn: f(lhs, rhs, group_sizes), reps)
        except Exception:  # noqa: BLE001 - a candidate that fails to compile is skipped
            continue
    if not timings:
        raise RuntimeError(f"no candidate compiled for {key}")
    best = min(timings, key=timings.get)
    store_config(key, best)
    return best
