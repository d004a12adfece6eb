"""The device models a schedule is replayed on: peak rates, links, launch and latency."""

from __future__ import annotations

import dataclasses

# ---------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Peak rates of one device and its links (what `moejax.training.plan.Target`, a slice to
    compile for, does not say).

    Attributes:
      name: label used in tables.
      flops_per_s: `(dtype key, FLOP/s)` pairs, dense: `"bf16"`, `"f16"`, `"f32"` (f32 operands
        at DEFAULT precision), `"f32_highest"` (at HIGHEST), `"f8"`, `"int8"`. A key not listed
        runs at the slowest rate listed.
      hbm_bytes_per_s: device memory bandwidth.
      link_bytes_per_s: collective bytes/s per device per direction inside a node.
      node_size: devices sharing that link (0: every device, one flat network).
      network_bytes_per_s: bytes/s per device per direction between nodes (ignored when
        `node_size` is 0).
      launch_s: fixed cost of each kernel.
      collective_latency_s: fixed cost of each collective.
    """

    name: str
    flops_per_s: tuple[tuple[str, float], ...]
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    node_size: int = 0
    network_bytes_per_s: float = 0.0
    launch_s: float = 0.0
    collective_latency_s: float = 0.0

    def __post_init__(self):
        if not self.flops_per_s or any(not rate > 0 for _, rate in self.flops_per_s):
            raise ValueError(f"flops_per_s must be non-empty and > 0, got {self.flops_per_s!r}")
        for field in ("hbm_bytes_per_s", "link_bytes_per_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)!r}")
        if self.node_size < 0:
            raise ValueError(f"node_size must be >= 0, got {self.node_size!r}")
        if self.node_size and not self.network_bytes_per_s > 0:
            raise ValueError(
                f"network_bytes_per_s must be > 0 when node_size > 0, "
                f"got {self.network_bytes_per_s!r}"
            )

    def peak(self, dtype: str) -> float:
        """FLOP/s for products of `dtype` (a key of `flops_per_s`; else the slowest rate)."""
        rates = dict(self.flops_per_s)
        return rates.get(dtype, min(rates.values()))


# NVIDIA H100 SXM5 (H100 datasheet, dense): BF16/FP16 989 TFLOP/s, TF32 494.7, FP32 66.9,
# FP8/INT8 1979; HBM3 3.35 TB/s. NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction in an
# 8-GPU node; between nodes one 400 Gb/s NDR InfiniBand port per GPU = 50 GB/s (the figures of
# `moejax.placement.H100_IB`). Launch: XLA:GPU replays kernels from CUDA graphs, a few us each;
# collective latency: NCCL's small-message time on one NVLink node is ~10 us.
H100_SXM = Hardware(
    "h100-sxm",
    flops_per_s=(
        ("bf16", 989e12),
        ("f16", 989e12),
        ("f32", 494.7e12),
        ("f32_highest", 66.9e12),
        ("f8", 1979e12),
        ("int8", 1979e12),
    ),
    hbm_bytes_per_s=3.35e12,
    link_bytes_per_s=450e9,
    node_size=8,
    network_bytes_per_s=50e9,
    launch_s=2e-6,
    collective_latency_s=10e-6,
)

# Cloud TPU v5e (cloud.google.com/tpu/docs/v5e): 197 TFLOP/s BF16, 394 INT8 per chip; HBM2
# 819 GB/s; inter-chip interconnect 1,600 Gbps per chip, read as 200 GB/s per direction the way
# `moejax.placement.TPU_V5P_ICI` reads v5p's 4,800 Gbps as 600 GB/s. f32 at DEFAULT precision is
# one bf16 pass; HIGHEST six. One flat network (the torus is not modelled).
TPU_V5E = Hardware(
    "tpu-v5e",
    flops_per_s=(("bf16", 197e12), ("f32", 197e12), ("f32_highest", 197e12 / 6), ("int8", 394e12)),
    hbm_bytes_per_s=819e9,
    link_bytes_per_s=200e9,
    launch_s=1e-6,
    collective_latency_s=5e-6,
)

# Cloud TPU v5p (cloud.google.com/tpu/docs/v5p): 459 TFLOP/s BF16, 918 INT8 per chip; HBM2e
# 2,765 GB/s; interconnect 600 GB/s per direction (as `moejax.placement.TPU_V5P_ICI`).
TPU_V5P = Hardware(
    "tpu-v5p",
    flops_per_s=(("bf16", 459e12), ("f32", 459e12), ("f32_highest", 459e12 / 6), ("int8", 918e12)),
    hbm_bytes_per_s=2765e9,
    link_bytes_per_s=600e9,
    launch_s=1e-6,
    collective_latency_s=5e-6,
)

HARDWARE = {"h100": H100_SXM, "v5e": TPU_V5E, "v5p": TPU_V5P}
