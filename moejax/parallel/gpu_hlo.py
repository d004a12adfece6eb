"""Seeing the XLA:GPU schedule of a sharded MoE call without a GPU (deviceless AOT compile).

Needs the CUDA plugin wheels (no NVIDIA libraries), e.g.
`pip install --no-deps jax-cuda13-plugin==<jax version> jax-cuda13-pjrt==<jax version>`, importable
before jax initialises its backends; run with `JAX_PLATFORMS=cpu` (FACTS.md, "Seeing the GPU
schedule"). `overlap(hlo_text)` pairs every async collective's `*-start` with its `*-done` and
counts the compute ops (fusions, GEMM custom-calls) the scheduler put between them.
"""

from __future__ import annotations

import re

# A trimmed H100 SXM GpuTargetConfigProto (xla/backends/gpu/target_config/specs/h100_sxm.txtpb):
# the device limits and bandwidths that the scheduler's cost model reads.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 1 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s")


def gpu_mesh(shape, axis_names, topology: str = "1x1x8"):
    """A deviceless CUDA mesh (AOT compile only) of `shape` over `topology`."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda", target_config=H100_TARGET_CONFIG, topology=topology
    )
    return topologies.make_mesh(topo, tuple(shape), tuple(axis_names))


def overlap(hlo_text: str, collective: str = "all-to-all") -> list[tuple[str, int]]:
    """GEMMs scheduled inside each async `<collective>` window of the ENTRY computation.

    Returns `(start name, GEMM instructions between the start and its done)` in schedule order.
    GEMMs are instructions whose name contains `gemm` (XLA:GPU names its cuBLAS and Triton GEMM
    fusions so), which is how the compiled text tells them apart from other fusions.
    """
    entry = hlo_text[hlo_text.index("ENTRY") :]
    open_: dict[str, int] = {}
    out = []
    for line in entry.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name = m.group(1)
        if name.startswith(f"{collective}-start"):
            open_[name] = 0
        elif name.startswith(f"{collective}-done"):
            started = re.search(rf"%({collective}-start[\w.\-]*)", line)
            if started and started.group(1) in open_:
                key = started.group(1)
                out.append((key, open_.pop(key)))
        elif "gemm" in name:
            for k in open_:
                open_[k] += 1
    return out
