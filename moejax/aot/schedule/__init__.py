"""Estimate a compiled step's time on an accelerator from its schedule, without the accelerator.

A deviceless compile (`moejax.aot`) gives the real XLA:GPU or XLA:TPU schedule of a program: the
ENTRY computation's instructions in the order the device runs them, async collectives split into
a `*-start` and a `*-done`. This module reads that text and replays it on a model of the device:

- **compute stream**: every kernel in schedule order, each taking
  `max(FLOPs / peak FLOP/s of its dtype, HBM bytes / HBM bytes/s) + launch`;
- **communication stream**: every async collective in issue order; one starts at
  `max(its start's issue time, the stream's previous collective's end)` and takes
  `bytes on the link / link bytes/s + latency`;
- a `*-done` blocks the compute stream until its collective has finished; the time the compute
  stream waits there is **exposed** communication. A synchronous collective (a plain
  `all-to-all`, or a start whose backend config says `"is_sync":true`, as
  `xla_gpu_disable_async_collectives` compiles them) runs on the compute stream after the
  communication stream is free: all of it is exposed.

A collective's exposed time includes any time it queued behind earlier collectives on the
communication stream, so one kind's exposure can exceed its own link time when another kind
holds the stream. The step is the compute stream's busy time plus all exposed time.

`estimate(hlo_text, hardware)` returns a `ScheduleEstimate`: the step, compute and communication
time, exposed time in total and by collective kind, and one `Window` per collective. The device
models are views of `moejax.hardware`'s table (`H100_SXM`, `H200_SXM`, `TPU_V5E`, `TPU_V5P`,
`TPU_V6E`; `HARDWARE` by key "h100", "h200", "v5e", "v5p", "v6e"). `parse` gives one `Op` per
instruction; its kind is `COMPUTE`, `START`, `DONE`, `SYNC`, `FREE`, `LOOP` or `BRANCH`, and
`COLLECTIVES` lists the collective opcodes modelled.

Per instruction (`parse`):

- FLOPs are counted for matrix products only: `dot` (`2 * result elements * contracted size`)
  and `convolution` (XLA:TPU writes matmuls as convolutions), inside fusions at any depth
  (XLA:GPU's Triton GEMM fusions hold a `dot`), cuBLAS custom calls (`__cublas$gemm`,
  `__cublas$lt$matmul`: from the dot dimension numbers in their backend config), Mosaic TPU
  kernels (the `cost_estimate` their backend config carries) and this package's Triton kernels
  from their shapes (`gmm`, `gmm_t`, `gather_gmm`, `tgmm`: every row multiplied, padding
  included; jax's flash attention `mha_forward` / `mha_backward`: the full `S x S` scores, no
  causal skipping, so up to 2x high for causal attention), and cuDNN's flash attention
  (`__cudnn$fmhaSoftmax` and its backward: the scores' shape from its backend config, the
  causal half where its mask is causal). Other custom calls cost their bytes.
- Bytes are the operands plus the result of each top-level kernel (what a fusion reads and
  writes in HBM); in-place updates count their whole buffer.
- FLOP rates are chosen by the product's operand dtype: `f32` at `DEFAULT` precision runs at the
  TF32 (GPU) or one-pass bf16 (TPU) rate, `f32` at `HIGHEST` at the `f32_highest` rate.
- `while` loops: the body (and condition) replayed `known_trip_count` times (XLA writes it into
  the loop's backend config when it can prove it); a data-dependent loop runs
  `default_trip_count` times (1 unless given) and the estimate's `notes` say so. Once an
  iteration starts and ends with no collective in flight, the next ones take the same time and
  are not replayed one by one, so long loops cost no more to estimate than short ones.
- `conditional`: the branch that ends latest; `call`: inlined; `async-start` wrapping a
  collective (`calls=` a computation holding it): that collective's start.
- Free: parameters, constants, tuples, `get-tuple-element`, `bitcast`, `opt-barrier`, TPU's
  async `copy-start`/`copy-done` (prefetches on DMA engines), `send`/`recv` (not modelled).
- A `*-done` pairs with the start it names (through `async-update`s). One that names none (a
  collective pipelined across loop iterations through the loop's state) is not waited for: that
  collective counts as hidden.

Bytes a collective puts on each device's link, for a buffer of `b` bytes over `N` devices (`N`
from its replica groups): all-to-all `(N-1)/N b`; all-gather `(N-1)/N` of the gathered result;
reduce-scatter `(N-1)/N` of the full input; all-reduce `2 (N-1)/N b` (ring); collective-permute
`b` to one peer; ragged all-to-all `(N-1)/N` of its input buffer (an upper bound: what it really
sends depends on the data). A group inside one node of `Hardware.node_size` devices moves at
`link_bytes_per_s`; an all-to-all spanning nodes splits its peers between that link and
`network_bytes_per_s` (the slower part sets the time); ring collectives and permutes that cross
a node boundary run at `network_bytes_per_s`.

What it does not model: contention between the streams (a collective and a kernel share HBM and
SMs on a GPU), several communication streams, kernels below peak rates (so compute is a lower
bound and exposure an upper bound when compute hides communication), occupancy and wave
quantization, caches, host work (a GPU `while` loop reads its predicate back each iteration),
the TPU's async copies, and torus topology (TPU links as one flat network per slice). The launch
and latency figures of the presets are assumptions, not measurements; small models are
dominated by them. It ranks schedules: the same program with and without overlap, or two
strategies on one target; it does not predict wall time to better than a small factor.

Measured kernel times replace the model where they exist: `simulate(..., measured={name: s})`
(by instruction name). No GPU or TPU timings were available when this was written. Parsing
and replaying the tiny LM's train step (~12,000 instructions) takes ~0.3 s, against ~17 s to
compile it.

>>> text = '''
... ENTRY %main {
...   %x = f32[1048576]{0} parameter(0)
...   %a2a = ((f32[1048576]{0}), f32[1048576]{0}) all-to-all-start(%x), replica_groups={{0,1}}
...   %y = f32[1048576]{0} fusion(%x), kind=kLoop, calls=%f
...   ROOT %z = f32[1048576]{0} all-to-all-done(%a2a)
... }'''
>>> est = estimate(text, H100_SXM)  # 4 MiB all-to-all over 2 GPUs vs an 8 MiB elementwise kernel
>>> print(f"step {est.step_s * 1e6:.2f} us, exposed {est.exposed('all-to-all') * 1e6:.2f} us")
step 14.66 us, exposed 10.16 us
"""

from moejax.aot.schedule._hardware import H100_SXM as H100_SXM
from moejax.aot.schedule._hardware import H200_SXM as H200_SXM
from moejax.aot.schedule._hardware import HARDWARE as HARDWARE
from moejax.aot.schedule._hardware import TPU_V5E as TPU_V5E
from moejax.aot.schedule._hardware import TPU_V5P as TPU_V5P
from moejax.aot.schedule._hardware import TPU_V6E as TPU_V6E
from moejax.aot.schedule._hardware import Hardware as Hardware
from moejax.aot.schedule._ops import BRANCH as BRANCH
from moejax.aot.schedule._ops import COLLECTIVES as COLLECTIVES
from moejax.aot.schedule._ops import COMPUTE as COMPUTE
from moejax.aot.schedule._ops import DONE as DONE
from moejax.aot.schedule._ops import FREE as FREE
from moejax.aot.schedule._ops import LOOP as LOOP
from moejax.aot.schedule._ops import START as START
from moejax.aot.schedule._ops import SYNC as SYNC
from moejax.aot.schedule._ops import Op as Op
from moejax.aot.schedule._ops import parse as parse
from moejax.aot.schedule._replay import ScheduleEstimate as ScheduleEstimate
from moejax.aot.schedule._replay import Window as Window
from moejax.aot.schedule._replay import collective_seconds as collective_seconds
from moejax.aot.schedule._replay import estimate as estimate
from moejax.aot.schedule._replay import op_seconds as op_seconds
from moejax.aot.schedule._replay import simulate as simulate

__all__ = [
    "BRANCH",
    "COLLECTIVES",
    "COMPUTE",
    "DONE",
    "FREE",
    "H100_SXM",
    "H200_SXM",
    "HARDWARE",
    "LOOP",
    "START",
    "SYNC",
    "TPU_V5E",
    "TPU_V5P",
    "TPU_V6E",
    "Hardware",
    "Op",
    "ScheduleEstimate",
    "Window",
    "collective_seconds",
    "estimate",
    "op_seconds",
    "parse",
    "simulate",
]
