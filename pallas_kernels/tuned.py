"""Tile configs found by autotuning (`pallas_kernels.autotune`), cached per problem bucket.

The cache maps (row bucket, K, N, G, dtype, device kind, kernel) -> Config. Rows are bucketed to
the next power of two because M (tokens x top-k after routing) varies from step to step while
the best tiles change only with its magnitude. `ops.gmm(config=None)` on the Triton backend
looks the key up for "gmm" and "gmm_t" and falls back to `config.default_config`. tgmm keeps
its own default tiles. The cache is per process and in memory. Kept apart from the tuner, which
runs the kernels, so that the kernels' entry points can read it without importing the tuner.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.config import Config, next_power_of_2

CacheKey = tuple[int, int, int, int, str, str, str]


_CACHE: dict[CacheKey, Config] = {}


def row_bucket(m: int) -> int:
    """Next power of two >= m, at least 64."""
    return max(64, next_power_of_2(m))


def cache_key(
    m: int, k: int, n: int, g: int, dtype, device_kind: str | None = None, *, kernel: str = "gmm"
) -> CacheKey:
    """Cache key of a gmm problem; device_kind defaults to the first device's kind."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    return (row_bucket(m), k, n, g, jnp.dtype(dtype).name, device_kind, kernel)


def cached_config(key: CacheKey) -> Config | None:
    return _CACHE.get(key)


def store_config(key: CacheKey, config: Config) -> None:
    _CACHE[key] = config


def clear_cache() -> None:
    _CACHE.clear()
