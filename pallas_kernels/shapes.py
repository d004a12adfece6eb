"""Named grouped-matmul problems shared by the tests and `experiments/bench_kernels.py`.

A `ShapeSpec` is an MoE expert matmul: M = T*top_k routed rows, K = d_model, N = d_ff, G experts,
plus a routing pattern that fixes group_sizes. `scaled()` shrinks one for CPU runs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

Routing = Literal["balanced", "all_in_one", "one_per_group", "with_empty", "zipf"]


@dataclasses.dataclass(frozen=True)
class ShapeSpec:
    """One named problem.

    Attributes:
      name: registry name.
      m: rows of lhs (tokens x top_k, plus any padding rows).
      k: contraction size (d_model).
      n: output columns (d_ff of one expert).
      g: groups (experts).
      routing: how the rows are split among groups.
      used: rows that belong to some group (sum(group_sizes)); None means all m.
    """

    name: str
    m: int
    k: int
    n: int
    g: int
    routing: Routing = "balanced"
    used: int | None = None

    def group_sizes(self, seed: int = 0) -> np.ndarray:
        """[G] int32 group sizes for this routing; sum == `used` (default m)."""
        return make_group_sizes(self.routing, self.used or self.m, self.g, seed=seed)

    def flops(self) -> int:
        """Useful FLOPs of one gmm: 2 * rows in groups * K * N."""
        return 2 * (self.used or self.m) * self.k * self.n

    def scaled(self, m: int, k: int, n: int, g: int | None = None) -> ShapeSpec:
        """The same routing pattern at another size (used rows scale with m)."""
        used = None if self.used is None else max(0, self.used * m // self.m)
        return dataclasses.replace(self, m=m, k=k, n=n, g=g or self.g, used=used)


def make_group_sizes(routing: Routing, rows: int, g: int, *, seed: int = 0) -> np.ndarray:
    """[G] int32 sizes summing to `rows`.

    balanced: as equal as possible; all_in_one: every row in the middle group; one_per_group:
    one row per group, the remainder in the last; with_empty: every other group empty, the
    rest balanced; zipf: sizes proportional to 1/rank (s=1.2), shuffled by `seed`.
    """
    if routing == "balanced":
        sizes = np.full(g, rows // g)
        sizes[: rows % g] += 1
    elif routing == "all_in_one":
        sizes = np.zeros(g, np.int64)
        sizes[g // 2] = rows
    elif routing == "one_per_group":
        sizes = np.ones(g, np.int64) if rows >= g else (np.arange(g) < rows).astype(np.int64)
        sizes[-1] += rows - sizes.sum()
    elif routing == "with_empty":
        live = np.arange(g) % 2 == 1 if g > 1 else np.ones(1, bool)
        sizes = np.zeros(g, np.int64)
        sizes[live] = make_group_sizes("balanced", rows, int(live.sum()))
    elif routing == "zipf":
        weights = 1.0 / np.arange(1, g + 1) ** 1.2
        sizes = np.floor(rows * weights / weights.sum()).astype(np.int64)
        sizes[0] += rows - sizes.sum()
        sizes = np.random.default_rng(seed).permutation(sizes)
    else:
        raise ValueError(f"unknown routing {routing!r}")
    assert sizes.sum() == rows and (sizes >= 0).all()
    return sizes.astype(np.int32)


SHAPES: dict[str, ShapeSpec] = {
    s.name: s
    for s in (
        # Small patterns for tests: M is not a multiple of a 64/128 tile, and all share
        # (M, K, N, G) so one compiled kernel serves every routing (group_sizes is traced).
        ShapeSpec("balanced", m=200, k=96, n=128, g=8),
        ShapeSpec("all_in_one", m=200, k=96, n=128, g=8, routing="all_in_one"),
        ShapeSpec("one_per_group", m=200, k=96, n=128, g=8, routing="one_per_group"),
        ShapeSpec("with_empty", m=200, k=96, n=128, g=8, routing="with_empty"),
        ShapeSpec("partial_rows", m=200, k=96, n=128, g=8, used=150),
        ShapeSpec("zipf_small", m=200, k=96, n=128, g=8, routing="zipf"),
        # Model-sized problems (first expert matmul; benchmarks scale them down on CPU), at
        # T=8192 tokens per device: the shapes whose tiles `config.default_config` is tuned for.
        # Mixtral 8x7B: E=8, D=4096, F=14336, top-2.
        ShapeSpec("mixtral_8x7b", m=8192 * 2, k=4096, n=14336, g=8),
        # Fine-grained (DeepSeek/Qwen-MoE-like): E=128, D=2048, F=768, top-8.
        ShapeSpec("fine_grained", m=8192 * 8, k=2048, n=768, g=128),
        ShapeSpec("fine_grained_zipf", m=8192 * 8, k=2048, n=768, g=128, routing="zipf"),
        # DeepSeek-V3: E=256, D=7168, F=2048, top-8, at T=16384 tokens.
        ShapeSpec("deepseek_v3", m=16384 * 8, k=7168, n=2048, g=256),
    )
}
