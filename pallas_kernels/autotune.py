"""Tile autotuning for the Pallas-Triton gmm, cached per problem bucket.

UNTESTED ON HARDWARE: `autotune_gmm` only runs on a GPU and has not been run on one yet. Only
the cache-key and cache logic are exercised by the CPU tests.

The cache maps (row bucket, K, N, G, dtype, device kind) -> Config. Rows are bucketed to the
next power of two because M (tokens x top-k after routing) varies from step to step while the
best tiles change only with its magnitude. `ops.gmm(config=None)` on the Triton backend looks
the key up and falls back to `DEFAULT_CONFIG`. The cache is per process and in memory.
"""

from __future__ import annotations

import itertools
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.config import Config, next_power_of_2

CacheKey = tuple[int, int, int, int, str, str]

# A small grid: 3 x 2 x 2 x 2 = 24 candidates.
CANDIDATES: tuple[Config, ...] = tuple(
    Config(tm=tm, tk=tk, tn=tn, num_warps=w)
    for tm, tk, tn, w in itertools.product((64, 128, 256), (32, 64), (64, 128), (4, 8))
)

_CACHE: dict[CacheKey, Config] = {}


def row_bucket(m: int) -> int:
    """Next power of two >= m, at least 64."""
    return max(64, next_power_of_2(m))


def cache_key(m: int, k: int, n: int, g: int, dtype, device_kind: str | None = None) -> CacheKey:
    """Cache key of a gmm problem; device_kind defaults to the first device's kind."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    return (row_bucket(m), k, n, g, jnp.dtype(dtype).name, device_kind)


def cached_config(key: CacheKey) -> Config | None:
    return _CACHE.get(key)


def store_config(key: CacheKey, config: Config) -> None:
    _CACHE[key] = config


def clear_cache() -> None:
    _CACHE.clear()


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
    candidates: tuple[Config, ...] = CANDIDATES,
    reps: int = 5,
) -> Config:
    """Times every candidate Config for the Triton gmm on these inputs; caches and returns the
    fastest. GPU only (raises RuntimeError elsewhere). Candidates that fail to compile are skipped.

    Args:
      lhs: [M, K]; rhs: [G, K, N]; group_sizes: [G] int32 (a representative routing).
      candidates: Configs to try.
      reps: timed repetitions per candidate (median).

    Returns:
      The fastest Config, also stored under `cache_key(M, K, N, G, lhs.dtype)`.
    """
    if jax.default_backend() != "gpu":
        raise RuntimeError(f"autotune_gmm needs a GPU, backend is {jax.default_backend()!r}")
    from pallas_kernels import ops  # ops imports this module

    key = cache_key(lhs.shape[0], lhs.shape[1], rhs.shape[2], rhs.shape[0], lhs.dtype)
    if (hit := cached_config(key)) is not None:
        return hit
    timings = {}
    for config in candidates:
        fn = jax.jit(lambda x, w, s, c=config: ops.gmm(x, w, s, backend="pallas_triton", config=c))
        try:
            timings[config] = _median_seconds(lambda f=fn: f(lhs, rhs, group_sizes), reps)
        except Exception:  # noqa: BLE001 - a tile that does not fit shared memory is skipped
            continue
    if not timings:
        raise RuntimeError(f"no candidate compiled for {key}")
    best = min(timings, key=timings.get)
    store_config(key, best)
    return best
