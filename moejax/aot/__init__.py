"""Compiling for GPU and TPU meshes without the hardware (deviceless ahead-of-time).

Everything moejax reads from a compile for hardware this machine does not have lives here:

- `mesh`, `compile_program`, `layer_program`, `train_step_program` (`moejax.aot.programs`): a
  deviceless H100 or TPU mesh, the layer or the train step lowered on it and compiled by the
  real XLA:GPU / XLA:TPU pipeline; `Compiled` holds the scheduled HLO text, memory per device
  and the Pallas kernels in it (`grouped_matmuls` keeps those of `KERNEL_NAMES`);
- `moejax.aot.hlo`: the one reader of compiled HLO text;
- `moejax.aot.windows`: what the scheduler put inside each async collective's window;
- `moejax.aot.schedule`: the schedule replayed on a model of the device (exposed
  communication, a modelled step time);
- `moejax.aot.fit`: will a model's train step fit a slice (memory, FLOPs, roofline);
- `moejax.aot.ranking`: the training strategy for a target, ranked by the schedule model;
- `moejax.aot.trace`: what a step measured on real hardware, per instruction of its compiled
  program (a jax profiler trace), beside the schedule model.

The compilers come from `python -m pallas_kernels.targets --install` (CUDA plugin, ptxas,
libtpu, pinned to the installed jax); run with `JAX_PLATFORMS=cpu`. Device figures (FLOP/s,
HBM, links) come from `moejax.hardware`.

>>> from moejax import aot  # doctest: +SKIP
>>> mesh = aot.mesh("cuda", (2, 4), ("data", "expert"))  # doctest: +SKIP
>>> fn, args = aot.layer_program(cfg, mesh, strategy, tokens=8192)  # doctest: +SKIP
>>> out = aot.compile_program(fn, args)  # doctest: +SKIP
>>> out.kernels  # doctest: +SKIP
{'gmm/triton': 3, 'gmm_t/triton': 3, 'tgmm/triton': 3}
"""

from moejax.aot import hlo as hlo
from moejax.aot import schedule as schedule
from moejax.aot import trace as trace
from moejax.aot import windows as windows
from moejax.aot.programs import KERNEL_NAMES as KERNEL_NAMES
from moejax.aot.programs import Compiled as Compiled
from moejax.aot.programs import compile_program as compile_program
from moejax.aot.programs import grouped_matmuls as grouped_matmuls
from moejax.aot.programs import kernel_counts as kernel_counts
from moejax.aot.programs import layer_program as layer_program
from moejax.aot.programs import mesh as mesh
from moejax.aot.programs import platform_of as platform_of
from moejax.aot.programs import train_step_program as train_step_program

__all__ = [
    "KERNEL_NAMES",
    "Compiled",
    "compile_program",
    "grouped_matmuls",
    "hlo",
    "kernel_counts",
    "layer_program",
    "mesh",
    "platform_of",
    "schedule",
    "trace",
    "train_step_program",
    "windows",
]
