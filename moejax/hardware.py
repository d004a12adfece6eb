"""The accelerators moejax models, by their datasheet figures: one table, no jax.

Each `Device` holds what a vendor publishes for one chip: dense FLOP/s by operand dtype (keys
from `DTYPES`), HBM capacity and bandwidth, the collective link inside a node (or a TPU slice)
and the network between nodes. The devices are `H100_SXM`, `H200_SXM`, `TPU_V5E`, `TPU_V5P` and
`TPU_V6E`; `DEVICES` holds them by short key ("h100", "h200", "v5e", "v5p", "v6e"). The models
that need device figures build their own view from this table:

- `moejax.placement` (`HardwareModel`: bf16 FLOP/s and link bandwidths of the placement cost
  model: `H100_NVLINK`, `H100_IB`, `TPU_V5P_ICI`);
- `moejax.aot.schedule` (`Hardware`: rates by dtype, HBM and links, plus assumed launch and
  collective latencies, to replay a compiled schedule);
- `moejax.aot.fit` (`Target`: HBM bytes and bf16 FLOP/s of a slice to compile for).

Conventions: FLOP/s are dense (NVIDIA's datasheets print the 2:4-sparse figure, twice the dense
one); link bandwidths are bytes/s per device per direction (datasheets print NVLink and TPU ICI
as bidirectional totals, halved here); `"f32"` is f32 operands at DEFAULT precision (TF32 on
NVIDIA tensor cores, one bf16 pass on a TPU MXU), `"f32_highest"` at HIGHEST (CUDA-core FP32 on
NVIDIA, six bf16 passes on a TPU).
"""

from __future__ import annotations

import dataclasses

DTYPES = ("bf16", "f16", "f32", "f32_highest", "f8", "int8")


@dataclasses.dataclass(frozen=True)
class Device:
    """Datasheet figures of one accelerator.

    Attributes:
      name: label used in tables ("h100-sxm", "tpu-v5p", ...).
      platform: the jax lowering platform, "cuda" or "tpu".
      flops_per_s: `(dtype key, dense FLOP/s)` pairs, keys from `DTYPES`.
      hbm_bytes: device memory in bytes.
      hbm_bytes_per_s: device memory bandwidth.
      link_bytes_per_s: collective bandwidth per device per direction inside a node (NVLink),
        or across the whole slice (TPU ICI).
      node_size: devices sharing that link; 0: every device of a slice (TPU ICI).
      network_bytes_per_s: bytes/s per device per direction between nodes (0 when `node_size`
        is 0).
    """

    name: str
    platform: str
    flops_per_s: tuple[tuple[str, float], ...]
    hbm_bytes: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    node_size: int = 0
    network_bytes_per_s: float = 0.0

    def __post_init__(self):
        if self.platform not in ("cuda", "tpu"):
            raise ValueError(f"platform must be 'cuda' or 'tpu', got {self.platform!r}")
        check_figures(self)
        unknown = [key for key, _ in self.flops_per_s if key not in DTYPES]
        if unknown:
            raise ValueError(f"flops_per_s keys must be in {DTYPES}, got {unknown!r}")
        if not self.hbm_bytes > 0:
            raise ValueError(f"hbm_bytes must be > 0, got {self.hbm_bytes!r}")

    def peak(self, dtype: str = "bf16") -> float:
        """Dense FLOP/s for products of `dtype` (a key of `flops_per_s`; else the slowest)."""
        rates = dict(self.flops_per_s)
        return rates.get(dtype, min(rates.values()))


def check_figures(figures) -> None:
    """The checks a `Device` and every model's view of one (`moejax.aot.schedule.Hardware`)
    share: `figures.flops_per_s` non-empty and > 0, `hbm_bytes_per_s` and `link_bytes_per_s`
    > 0, `node_size` >= 0, and `network_bytes_per_s` > 0 where `node_size` > 0.

    Raises:
      ValueError: naming the first field that fails, and its value.
    """
    if not figures.flops_per_s or any(not rate > 0 for _, rate in figures.flops_per_s):
        raise ValueError(f"flops_per_s must be non-empty and > 0, got {figures.flops_per_s!r}")
    for field in ("hbm_bytes_per_s", "link_bytes_per_s"):
        if not getattr(figures, field) > 0:
            raise ValueError(f"{field} must be > 0, got {getattr(figures, field)!r}")
    if figures.node_size < 0:
        raise ValueError(f"node_size must be >= 0, got {figures.node_size!r}")
    if figures.node_size and not figures.network_bytes_per_s > 0:
        raise ValueError(
            f"network_bytes_per_s must be > 0 when node_size > 0, "
            f"got {figures.network_bytes_per_s!r}"
        )


# NVIDIA H100 SXM5 (H100 Tensor Core GPU datasheet; sparse figures halved): BF16/FP16 989.4
# TFLOP/s (printed as 1,979 with sparsity), TF32 494.7 (989), FP32 66.9, FP8/INT8 1,979
# (3,958). HBM3: 3.35 TB/s; 80 GB printed, 84,942,979,072 bytes as the device reports it
# (XLA's h100_sxm target config, `device_memory_size`). NVLink 4: 900 GB/s bidirectional =
# 450 GB/s per direction, 8 GPUs per HGX node; between nodes one 400 Gb/s NDR InfiniBand
# ConnectX-7 port per GPU (DGX H100 User Guide, "Network Modules") = 50 GB/s per direction.
_HOPPER_BF16 = 989e12  # FP16 the same
_HOPPER_FLOPS = (
    ("bf16", _HOPPER_BF16),
    ("f16", _HOPPER_BF16),
    ("f32", 494.7e12),
    ("f32_highest", 66.9e12),
    ("f8", 1979e12),
    ("int8", 1979e12),
)
H100_SXM = Device(
    "h100-sxm",
    "cuda",
    flops_per_s=_HOPPER_FLOPS,
    hbm_bytes=84_942_979_072,
    hbm_bytes_per_s=3.35e12,
    link_bytes_per_s=450e9,
    node_size=8,
    network_bytes_per_s=50e9,
)

# NVIDIA H200 SXM (H200 Tensor Core GPU datasheet): the H100's GH100 compute (BF16 1,979
# TFLOP/s with sparsity, so 989 dense; FP8 3,958 / 1,979), HBM3e 141 GB at 4.8 TB/s, the same
# NVLink 4 (900 GB/s bidirectional) in 8-GPU HGX nodes and ConnectX-7 400 Gb/s per GPU.
H200_SXM = Device(
    "h200-sxm",
    "cuda",
    flops_per_s=_HOPPER_FLOPS,
    hbm_bytes=141e9,
    hbm_bytes_per_s=4.8e12,
    link_bytes_per_s=450e9,
    node_size=8,
    network_bytes_per_s=50e9,
)

# Cloud TPU v5e (cloud.google.com/tpu/docs/v5e): 197 TFLOP/s BF16, 394 TOP/s INT8 per chip;
# HBM2 16 GB at 819 GB/s; ICI 400 GB/s bidirectional per chip (1,600 Gbps) = 200 GB/s per
# direction over the slice (2D torus, not modelled: one flat network).
TPU_V5E = Device(
    "tpu-v5e",
    "tpu",
    flops_per_s=(("bf16", 197e12), ("f32", 197e12), ("f32_highest", 197e12 / 6), ("int8", 394e12)),
    hbm_bytes=16e9,
    hbm_bytes_per_s=819e9,
    link_bytes_per_s=200e9,
)

# Cloud TPU v5p (cloud.google.com/tpu/docs/v5p): 459 TFLOP/s BF16, 918 TOP/s INT8 per chip;
# HBM2e 95 GB at 2,765 GB/s; ICI 1,200 GB/s bidirectional per chip (4,800 Gbps) = 600 GB/s
# per direction (3D torus, not modelled: one flat network).
TPU_V5P = Device(
    "tpu-v5p",
    "tpu",
    flops_per_s=(("bf16", 459e12), ("f32", 459e12), ("f32_highest", 459e12 / 6), ("int8", 918e12)),
    hbm_bytes=95e9,
    hbm_bytes_per_s=2765e9,
    link_bytes_per_s=600e9,
)

# Cloud TPU v6e, Trillium (cloud.google.com/tpu/docs/v6e): 918 TFLOP/s BF16, 1,836 TOP/s INT8
# per chip; HBM 32 GB at 1,638 GB/s; ICI 800 GB/s bidirectional per chip = 400 GB/s per
# direction (2D torus, not modelled).
TPU_V6E = Device(
    "tpu-v6e",
    "tpu",
    flops_per_s=(("bf16", 918e12), ("f32", 918e12), ("f32_highest", 918e12 / 6), ("int8", 1836e12)),
    hbm_bytes=32e9,
    hbm_bytes_per_s=1638e9,
    link_bytes_per_s=400e9,
)

DEVICES: dict[str, Device] = {
    "h100": H100_SXM,
    "h200": H200_SXM,
    "v5e": TPU_V5E,
    "v5p": TPU_V5P,
    "v6e": TPU_V6E,
}

__all__ = ["DEVICES", "DTYPES", "H100_SXM", "H200_SXM", "TPU_V5E", "TPU_V5P", "TPU_V6E", "Device"]
