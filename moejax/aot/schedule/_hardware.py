"""The device models a schedule is replayed on: peak rates, links, launch and latency."""

from __future__ import annotations

import dataclasses

from moejax import hardware

# ---------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Peak rates of one device and its links, and the latencies the replay charges (the
    schedule model's view of a `moejax.hardware.Device`, `Hardware.of`).

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
        hardware.check_figures(self)

    def peak(self, dtype: str) -> float:
        """FLOP/s for products of `dtype` (a key of `flops_per_s`; else the slowest rate)."""
        rates = dict(self.flops_per_s)
        return rates.get(dtype, min(rates.values()))

    @classmethod
    def of(cls, device: hardware.Device, *, launch_s: float, collective_latency_s: float):
        """The schedule model's view of a `moejax.hardware.Device`: its rates and links, plus
        the launch and collective latencies, which no datasheet gives."""
        return cls(
            device.name,
            flops_per_s=device.flops_per_s,
            hbm_bytes_per_s=device.hbm_bytes_per_s,
            link_bytes_per_s=device.link_bytes_per_s,
            node_size=device.node_size,
            network_bytes_per_s=device.network_bytes_per_s,
            launch_s=launch_s,
            collective_latency_s=collective_latency_s,
        )


# Datasheet figures and their sources: `moejax.hardware`. Latencies are assumptions, not
# measurements. GPU launch: XLA:GPU replays kernels from CUDA graphs, a few us each; collective
# latency: NCCL's small-message time on one NVLink node is ~10 us. TPU: half of each.
_GPU = dict(launch_s=2e-6, collective_latency_s=10e-6)
_TPU = dict(launch_s=1e-6, collective_latency_s=5e-6)
H100_SXM = Hardware.of(hardware.H100_SXM, **_GPU)
H200_SXM = Hardware.of(hardware.H200_SXM, **_GPU)
TPU_V5E = Hardware.of(hardware.TPU_V5E, **_TPU)
TPU_V5P = Hardware.of(hardware.TPU_V5P, **_TPU)
TPU_V6E = Hardware.of(hardware.TPU_V6E, **_TPU)

HARDWARE = {
    "h100": H100_SXM,
    "h200": H200_SXM,
    "v5e": TPU_V5E,
    "v5p": TPU_V5P,
    "v6e": TPU_V6E,
}
