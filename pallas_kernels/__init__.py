"""Grouped matmul kernels for Mixture-of-Experts: Pallas Mosaic GPU (Hopper), Pallas Triton
(other GPUs), Pallas TPU and a jnp reference.

Depends on jax only. Shape letters: M rows, K contraction, N output columns, G groups.
`grouped_matmul` is the differentiable op layers call; `gather_grouped_matmul` fuses the MoE
row gather and routing weight into it (fused on Pallas-Triton, composed elsewhere).

`backend="auto"` (the default) and `"pallas"` are decided by the platform the program is
compiled for, not the host (see `ops`); `default_config` holds each kernel's tiles per target,
dtype and shape, and `fits` says whether a Config fits a target's shared memory or VMEM.

The Mosaic GPU kernels need every group on their row tile: `GROUP_ALIGNMENT` (128) is the group
size multiple at which they run without moving rows (pass `group_alignment=` to promise it), and
`group_alignment()` what the current compile target wants (128 on Hopper, else 1), which is
what `moejax` pads each expert to.

FP8 (DeepSeek-V3's recipe): `pallas_kernels.fp8` quantizes to e4m3/e5m2 with fp32 block scales,
`pallas_kernels.fp8_ops.fp8_grouped_matmul` is the differentiable fp8 grouped matmul (the fp8
Mosaic GPU kernels of `pallas_kernels.fp8_mosaic_gpu` on Hopper, emulated elsewhere).
"""

import warnings as _warnings

from pallas_kernels.autotune import autotune_gmm as autotune_gmm
from pallas_kernels.config import BACKENDS as BACKENDS
from pallas_kernels.config import DEFAULT_CONFIG as DEFAULT_CONFIG
from pallas_kernels.config import GROUP_ALIGNMENT as GROUP_ALIGNMENT
from pallas_kernels.config import KERNELS as KERNELS
from pallas_kernels.config import Config as Config
from pallas_kernels.config import default_config as default_config
from pallas_kernels.config import fits as fits
from pallas_kernels.fused import gather_grouped_matmul as gather_grouped_matmul
from pallas_kernels.ops import gmm as gmm
from pallas_kernels.ops import group_alignment as group_alignment
from pallas_kernels.ops import grouped_matmul as grouped_matmul
from pallas_kernels.ops import tgmm as tgmm
from pallas_kernels.reference import reference_gmm as reference_gmm
from pallas_kernels.reference import reference_tgmm as reference_tgmm

__all__ = [
    "BACKENDS",
    "DEFAULT_CONFIG",
    "GROUP_ALIGNMENT",
    "KERNELS",
    "Config",
    "autotune_gmm",
    "default_config",
    "fits",
    "gather_grouped_matmul",
    "gmm",
    "group_alignment",
    "grouped_matmul",
    "reference_gmm",
    "reference_tgmm",
    "tgmm",
]

# `python -m pallas_kernels.targets --install` (what the docs ask for) imports this package, whose
# kernels import `targets`, and then runs `targets` as __main__: runpy warns that this "may result
# in unpredictable behaviour". It does not here (`_main` reads no module state), so that one
# warning is silenced.
_warnings.filterwarnings(
    "ignore", message="'pallas_kernels.targets' found in sys.modules", category=RuntimeWarning
)
