"""Tiling `Config`, backend names (`BACKENDS`) and the small shape policy shared by every kernel.

Shape letters (ARCHITECTURE.md): `M` rows of lhs, `K` contraction, `N` output columns, `G` groups.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

Backend = Literal["auto", "reference", "pallas_triton", "pallas_tpu"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "pallas_triton", "pallas_tpu")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of one grouped-matmul kernel (gmm or tgmm).

    Attributes:
      tm: rows of lhs per tile. Also the granularity at which group boundaries are handled: a
        tile that straddles a boundary is computed once per group it touches (masked revisit).
      tk: contraction columns per step of the inner loop.
      tn: output columns per tile.
      num_warps: Triton only: warps per program.
      num_stages: Triton only: software-pipelining depth.

    Tiles are clamped to the problem (see `effective_tiles`), so a large default is safe on small
    inputs. Triton needs power-of-two tiles. Compiled Mosaic (TPU) needs tk and tn >= 128 and
    tm >= 8 (16 for bf16) unless the tile covers the whole (padded) dimension; interpret mode
    accepts any power of two, which the CPU tests use.
    """

    tm: int = 128
    tk: int = 128
    tn: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("tm", "tk", "tn", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        for name in ("tm", "tk", "tn"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"Config.{name} must be a power of two, got {value}")


DEFAULT_CONFIG = Config()


def next_power_of_2(x: int) -> int:
    """Smallest power of two >= x (and >= 1)."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def effective_tiles(config: Config, m: int, k: int, n: int) -> tuple[int, int, int]:
    """Clamps (tm, tk, tn) to the problem so a tile never exceeds the next power of two of its dim.

    Why: interpret mode and small tests use large tiles on small shapes; a 128-row tile over 12
    rows would otherwise pad 10x. Clamped tiles stay powers of two (Triton's requirement).
    """
    return (
        min(config.tm, next_power_of_2(m)),
        min(config.tk, next_power_of_2(k)),
        min(config.tn, next_power_of_2(n)),
    )


def resolve_backend(backend: str) -> str:
    """Maps `backend` to a concrete one. Fallback order for "auto": Pallas-TPU on TPU,
    Pallas-Triton on GPU, the pure-jnp reference everywhere else (CPU)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    platform = jax.default_backend()
    if platform == "tpu":
        return "pallas_tpu"
    if platform in ("gpu", "cuda", "rocm"):
        return "pallas_triton"
    return "reference"
