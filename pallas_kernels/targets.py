"""Compile targets without the hardware: deviceless H100 and TPU meshes for AOT compiles.

A CPU-only machine compiles for real accelerators through jax's deviceless topologies
(`jax.experimental.topologies`): lower with `jax.ShapeDtypeStruct`s sharded on such a mesh and
`.compile()` runs the real XLA:GPU or XLA:TPU pipeline, Pallas kernels included (Triton -> PTX ->
ptxas for sm_90a; Mosaic for TPU). Nothing runs; the compiled program, its schedule and its
memory analysis are real.

What it needs (`python -m pallas_kernels.targets --install` installs it, pinned to the installed
jax; `install_command()` is the same as text):
  * GPU: the CUDA plugin (`jax-cuda13-plugin`, `jax-cuda13-pjrt`, no NVIDIA libraries needed),
    ptxas and libdevice (`nvidia-cuda-nvcc`, `nvidia-nvvm`), cuDNN (`nvidia-cudnn-cu13`: jax
    lowers its flash attention only where it finds cuDNN), and nvdisasm
    (`nvidia-cuda-nvdisasm`: Mosaic GPU prints a kernel's SASS with `MOSAIC_GPU_DUMP_SASS=1`,
    `has_nvdisasm()`), all installed with `--no-deps`;
  * TPU: `libtpu` at the version jax's `[tpu]` extra pins.
Run with `JAX_PLATFORMS=cpu` so jax initialises no GPU or TPU backend (the deviceless topologies
load the plugin themselves); `use_cpu_unless_accelerator()` does that for a program that has not
chosen its platforms, on a machine with no GPU or TPU. `missing(platform)` says what is absent
(tests skip on it).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import re

import jax

# A trimmed H100 SXM GpuTargetConfigProto (XLA's xla/backends/gpu/target_config/specs/
# h100_sxm.txtpb): the device limits and bandwidths the compiler and its scheduler read.
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

# Deviceless TPU slices of 8 devices by generation: name -> (topology name, devices).
TPU_TOPOLOGIES = {
    "v5e": ("v5e:2x4", 8),
    "v5p": ("v5p:2x2x2", 8),
    "v6e": ("v6e:2x4", 8),
    "v4": ("v4:2x2x1", 8),
}
# libtpu without a TPU: a worker host name stops its init error, and several processes (pytest
# workers) may load it at once.
LIBTPU_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
CUDA_WHEELS = ("jax-cuda13-plugin", "jax-cuda13-pjrt")
NVIDIA_WHEELS = (
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cudnn-cu13==9.28.1.4",
    "nvidia-cuda-nvdisasm==13.5.37",
)


def libtpu_requirement() -> str:
    """`libtpu==<version>` as the installed jax's `[tpu]` extra pins it."""
    for req in importlib.metadata.requires("jax") or ():
        if req.startswith("libtpu") and 'extra == "tpu"' in req:
            version = re.search(r"==\s*([\w.*]+)", req)
            if version:
                return f"libtpu=={version.group(1)}"
    raise RuntimeError("the installed jax declares no libtpu pin in its [tpu] extra")


def install_requirements() -> list[str]:
    """The wheels that make both deviceless targets available for the installed jax (to be
    installed with `--no-deps`: none of their NVIDIA or TPU runtime dependencies is needed)."""
    version = jax.__version__
    return [*(f"{w}=={version}" for w in CUDA_WHEELS), *NVIDIA_WHEELS, libtpu_requirement()]


def install_command() -> str:
    """`install_requirements` as a pip command line."""
    return "pip install --no-deps " + " ".join(f"'{r}'" for r in install_requirements())


# Where an accelerator shows itself before any backend starts (the files jax's own platform
# discovery looks at, `jax._src.hardware_utils`): NVIDIA's device nodes (WSL2's /dev/dxg), AMD's
# kernel driver, and TPU chips on the PCI bus (Google's vendor id) or as /dev/accel* / /dev/vfio.
_GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
_GOOGLE_PCI_VENDOR = "0x1ae0"


def accelerator_visible() -> bool:
    """Whether this machine shows a GPU or a TPU (device files, the PCI bus); reads files only,
    starts no jax backend."""
    import glob

    if any(os.path.exists(path) for path in _GPU_DEVICE_FILES):
        return True
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if pathlib.Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def use_cpu_unless_accelerator() -> bool:
    """Sets jax's platforms to "cpu" when nobody chose them (no `JAX_PLATFORMS` in the
    environment, no `jax_platforms` set) and `accelerator_visible()` is False; True if it did.
    Call it before the first computation (the commands and experiment scripts do).

    Why: with the deviceless compilers installed (`--install`) and no platform chosen, jax starts
    every backend it finds: the CUDA plugin fails its cuFFT check and libtpu finds no TPU, and
    each prints a traceback or a page of errors before the run goes on, on the CPU, as it would
    have anyway. Deviceless compiles lose nothing: `jax.experimental.topologies` loads the
    plugin it compiles for itself, under `JAX_PLATFORMS=cpu` too. On a machine with a GPU or a
    TPU nothing changes, so jax picks the accelerator as before.
    """
    if "JAX_PLATFORMS" in os.environ or jax.config.jax_platforms:
        return False
    if accelerator_visible():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


def _importable(name: str) -> bool:
    """Whether module `name` can be imported (False, not an error, when a parent is missing)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def has_nvdisasm() -> bool:
    """Whether nvdisasm sits beside ptxas, where Mosaic GPU looks for it to print SASS."""
    ptxas = _ptxas()
    return ptxas is not None and (ptxas.parent / "nvdisasm").exists()


def _ptxas() -> pathlib.Path | None:
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else ():
        for candidate in pathlib.Path(root).glob("cu*/bin/ptxas"):
            return candidate
    return None


INSTALL_HINT = "python -m pallas_kernels.targets --install"


def missing(platform: str) -> str | None:
    """None if a deviceless compile for `platform` ("cuda" or "tpu") can run here, else one
    line: what is missing and how to install it (`INSTALL_HINT`, and the pip command it runs)."""
    if platform == "cuda":
        if not _importable("jax_plugins.xla_cuda13"):
            absent = "no CUDA plugin (jax_plugins.xla_cuda13)"
        elif _ptxas() is None:
            absent = "no ptxas (nvidia-cuda-nvcc)"
        elif not _importable("nvidia.cudnn"):
            absent = "no cuDNN (nvidia-cudnn-cu13)"
        else:
            return None
    elif platform == "tpu":
        if _importable("libtpu"):
            return None
        absent = "no libtpu"
    else:
        raise ValueError(f"platform must be 'cuda' or 'tpu', got {platform!r}")
    return f"{absent}; install the deviceless compilers: {INSTALL_HINT} (= {install_command()})"


def gpu_mesh(shape, axis_names, topology: str | None = None):
    """A deviceless mesh of H100s (AOT compile only); `topology` defaults to one host holding
    `prod(shape)` GPUs ("1x1xN")."""
    from jax.experimental import topologies

    count = 1
    for size in shape:
        count *= size
    topo = topologies.get_topology_desc(
        platform="cuda", target_config=H100_TARGET_CONFIG, topology=topology or f"1x1x{count}"
    )
    return topologies.make_mesh(topo, tuple(shape), tuple(axis_names))


def tpu_mesh(shape, axis_names, generation: str = "v5e", topology: str | None = None):
    """A deviceless mesh of TPU chips, using the first `prod(shape)` devices of the slice:
    `topology` ("v5p:4x4x4") if given, else the 8-chip slice of `generation` (a key of
    `TPU_TOPOLOGIES`)."""
    from jax.experimental import topologies

    name = topology or TPU_TOPOLOGIES[generation][0]
    count = 1
    for size in shape:
        count *= size
    for key, value in LIBTPU_ENV.items():  # read when libtpu first loads
        os.environ.setdefault(key, value)
    topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
    devices = list(topo.devices)
    if count > len(devices):
        raise ValueError(f"mesh {shape} needs {count} devices; {name} has {len(devices)}")
    import numpy as np

    return jax.sharding.Mesh(np.array(devices[:count]).reshape(tuple(shape)), tuple(axis_names))


def lowering(mesh):
    """The context to lower in for a deviceless `mesh`: its abstract mesh, whose device is the
    target chip, becomes the current one.

    From jax 0.11 the Pallas-Triton lowering asks the current abstract mesh which GPU it
    compiles for and, on a host without one, raises "No supported GPU devices found" (jax
    0.10.2 assumed sm_90 instead). Mosaic GPU kernels read the SM count from the same device.
    Lowering for CPU or TPU meshes is unchanged by it.
    """
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def abstract_gpu_mesh(shape=(1,), axis_names=("x",)):
    """An `AbstractMesh` of H100s, for a bare `.lower(lowering_platforms=("cuda",))` (no
    deviceless topology needed): lower under `jax.sharding.use_abstract_mesh(...)` of it."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    device = AbstractDevice(
        device_kind=_target_field("device_description_str"),
        num_cores=int(_target_field("core_count")),
        platform="gpu",
    )
    return AbstractMesh(
        tuple(shape),
        tuple(axis_names),
        axis_types=(AxisType.Auto,) * len(shape),
        abstract_device=device,
    )


def lowering_platform(platform: str, shape=(1,), axis_names=("x",)):
    """The context for a bare `.lower(lowering_platforms=(platform,))` on a CPU host: an
    abstract H100 mesh of `shape` for "cuda" (see `lowering`; a `shard_map` inside must use
    the same axes), nothing for other platforms."""
    import contextlib

    if platform != "cuda":
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(abstract_gpu_mesh(shape, axis_names))


# Hopper data-center GPUs (sm_90): what the Mosaic GPU kernels compile for.
_HOPPER_KIND = re.compile(r"\bG?H(100|200|800|20)\b")


def gpu_kind() -> str | None:
    """The device kind of the GPU being compiled for, or None if no GPU is known: the current
    abstract mesh's device (a deviceless or sharded compile), else the default device (what an
    unsharded `jit` compiles for). Never `jax.devices()`: during a deviceless compile that is
    the CPU."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None:
        return device.device_kind if device.platform in ("gpu", "cuda") else None
    from jax.extend import backend

    default = backend.get_default_device()
    return default.device_kind if default.platform in ("gpu", "cuda") else None


def is_hopper(kind: str | None) -> bool:
    """Whether a device kind (`gpu_kind()`) is a Hopper GPU (H100, H200, H800, H20, GH200)."""
    return kind is not None and _HOPPER_KIND.search(kind) is not None


def _target_field(name: str) -> str:
    """One scalar field of `H100_TARGET_CONFIG` (quotes stripped)."""
    match = re.search(rf"^\s*{name}: (.+)$", H100_TARGET_CONFIG, re.MULTILINE)
    if match is None:
        raise KeyError(name)
    return match.group(1).strip().strip('"')


def mesh_for(platform: str, shape, axis_names, **kw):
    """`gpu_mesh` for "cuda", `tpu_mesh` for "tpu"."""
    return (gpu_mesh if platform == "cuda" else tpu_mesh)(shape, axis_names, **kw)


def shapes_on(tree, mesh, specs=None):
    """`jax.ShapeDtypeStruct`s of `tree`'s leaves (arrays or shape structs) placed on `mesh`
    with `specs` (a matching tree of PartitionSpecs; None: replicated)."""
    from jax.sharding import NamedSharding, PartitionSpec

    if specs is None:
        specs = jax.tree.map(lambda _: PartitionSpec(), tree)
    return jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
        tree,
        specs,
    )


def _main(argv=None) -> int:
    import argparse
    import subprocess
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m pallas_kernels.targets",
        description="Deviceless H100/TPU compile targets: what is missing, and installing it.",
    )
    parser.add_argument("--install", action="store_true", help="pip install what is missing")
    args = parser.parse_args(argv)
    absent = {p: why for p in ("cuda", "tpu") if (why := missing(p))}
    for platform in ("cuda", "tpu"):
        print(f"{platform}: {absent.get(platform, 'ready')}")
    if args.install and absent:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *install_requirements()]
        print(" ".join(cmd), flush=True)
        return subprocess.call(cmd)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
