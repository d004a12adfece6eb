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
time, exposed time in total and by collective kind, and one `Window` per collective.

Per instruction (`parse`):

- FLOPs are counted for matrix products only: `dot` (`2 * result elements * contracted size`)
  and `convolution` (XLA:TPU writes matmuls as convolutions), inside fusions at any depth
  (XLA:GPU's Triton GEMM fusions hold a `dot`), cuBLAS custom calls (`__cublas$gemm`,
  `__cublas$lt$matmul`: from the dot dimension numbers in their backend config), Mosaic TPU
  kernels (the `cost_estimate` their backend config carries) and this package's Triton kernels
  from their shapes (`gmm`, `gmm_t`, `gather_gmm`, `tgmm`: every row multiplied, padding
  included; jax's flash attention `mha_forward` / `mha_backward`: the full `S x S` scores, no
  causal skipping, so up to 2x high for causal attention). Other custom calls cost their bytes.
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

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

COLLECTIVES = (
    "all-to-all",
    "ragged-all-to-all",
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "collective-permute",
)

# Op kinds.
COMPUTE, START, DONE, SYNC, FREE, LOOP, BRANCH = (
    "compute",
    "start",
    "done",
    "sync",
    "free",
    "loop",
    "branch",
)

_FREE_OPCODES = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "opt-barrier",
        "partition-id",
        "replica-id",
        "after-all",
        "add-dependency",
        "domain",
        "copy-start",
        "copy-done",
        "async-update",
        "get-dimension-size",
        "send",
        "send-done",
        "recv",
        "recv-done",
    }
)


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


# ---------------------------------------------------------------------------------------------
# Typed instructions
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Op:
    """One scheduled instruction, costed.

    Attributes:
      name: the instruction's name (without `%`).
      opcode: HLO opcode (`fusion`, `custom-call`, `all-to-all-start`, `while`, ...).
      kind: `COMPUTE` (a kernel), `START` / `DONE` (an async collective's halves), `SYNC` (a
        synchronous collective), `FREE` (no device work), `LOOP` (`body` run `trip_count`
        times) or `BRANCH` (one of `branches`).
      flops: matrix-product FLOPs of a kernel.
      dtype: the `Hardware.flops_per_s` key those FLOPs run at.
      bytes: HBM bytes a kernel reads and writes.
      collective: for START and SYNC, one of `COLLECTIVES`.
      comm_bytes: the collective's buffer (its module docstring says which buffer per kind).
      groups: device ids of each replica group (collective-permute: each (source, target)).
      start: for DONE, the name of its START.
      trip_count: for LOOP, XLA's known trip count, or None when the loop is data-dependent.
      body: for LOOP, the ops of one iteration (condition included).
      branches: for BRANCH, the ops of each branch.
    """

    name: str
    opcode: str
    kind: str
    flops: float = 0.0
    dtype: str = "bf16"
    bytes: float = 0.0
    collective: str = ""
    comm_bytes: float = 0.0
    groups: tuple[tuple[int, ...], ...] = ()
    start: str = ""
    trip_count: int | None = None
    body: tuple[Op, ...] = ()
    branches: tuple[tuple[Op, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    line: str


_INSTR = re.compile(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"(?:ENTRY\s+)?%([\w.\-]+)")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,<=\s]*)\]")
_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}


def _close(text: str, i: int) -> int:
    """Index of the `)` matching the `(` at `text[i]`."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unbalanced parentheses in {text[:120]!r}")


def _instruction(line: str) -> _Instr | None:
    """An instruction line of HLO text as its parts, or None for other lines."""
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _close(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-$]+)\(", rest)
    if not op:
        return None
    end = _close(rest, op.end() - 1)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[op.end() : end]))
    return _Instr(m.group(1), shape, op.group(1), operands, rest[end + 1 :], line)


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """`(dtype, dims)` of every array in a (possibly tuple) shape string."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        sizes = tuple(int(d.replace("<=", "")) for d in dims.split(",") if d.strip())
        out.append((dtype, sizes))
    return out


def _dtype_bits(dtype: str) -> int:
    if dtype.startswith("f8"):
        return 8
    return _BITS.get(dtype, 32)


def _nbytes(shape: str) -> float:
    """Bytes of every array in `shape`."""
    return sum(math.prod(dims) * _dtype_bits(dt) / 8 for dt, dims in _arrays(shape))


def _rate_key(dtype: str, highest: bool) -> str:
    """The `Hardware.flops_per_s` key products of `dtype` operands run at."""
    if dtype.startswith("f8"):
        return "f8"
    if dtype in ("s8", "u8", "s4", "u4"):
        return "int8"
    if dtype == "f32":
        return "f32_highest" if highest else "f32"
    return dtype


def _split_module(text: str) -> tuple[dict[str, list[str]], str, int]:
    """`({computation: instruction lines}, entry name, devices)` of compiled HLO text."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace() and line.rstrip().endswith("{"):
            m = _HEADER.match(line)
            if m:
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    devices = 1
    for key in ("num_partitions", "replica_count"):
        m = re.search(rf"\b{key}=(\d+)", text)
        devices *= int(m.group(1)) if m else 1
    return comps, entry, devices


def _groups(attrs: str, devices: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups (or collective-permute pairs) of a collective's attributes."""
    m = re.search(r"source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:
        return tuple(tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,\s]+)\}", m[1]))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:  # iota form: [groups, size] <= reshape(iota, dims), transposed by perm
        shape = tuple(map(int, m[1].split(",")))
        dims = tuple(map(int, m[2].split(",")))
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m[3]:
            ids = ids.transpose(tuple(map(int, m[3].split(","))))
        return tuple(tuple(int(i) for i in g) for g in ids.reshape(shape[0], -1))
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m and (found := re.findall(r"\{([\d,\s]+)\}", m[1])):
        return tuple(tuple(map(int, g.split(","))) for g in found)
    return (tuple(range(devices)),)


def _called(attrs: str, key: str) -> list[str]:
    """Computations named by attribute `key` (`calls=%a` or `key={%a, %b}`)."""
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", attrs)
    return re.findall(r"%([\w.\-]+)", m[1]) if m else []


def _backend_json(attrs: str) -> dict:
    """The JSON backend config of an instruction ({} when absent or not JSON)."""
    i = attrs.find("backend_config={")
    if i < 0:
        return {}
    start = i + len("backend_config=")
    depth, in_string, escape = 0, False, False
    for j in range(start, len(attrs)):
        ch = attrs[j]
        if in_string:
            escape = ch == "\\" and not escape
            if ch == '"' and not escape:
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                try:
                    return json.loads(attrs[start : j + 1])
                except ValueError:
                    return {}
    return {}


class _Module:
    """Compiled HLO text, parsed computation by computation on demand (memoised)."""

    def __init__(self, text: str):
        self.lines, self.entry, self.devices = _split_module(text)
        self._instrs: dict[str, list[_Instr]] = {}
        self._shapes: dict[str, dict[str, str]] = {}
        self._flops: dict[str, tuple[float, str, bool]] = {}
        self._ops: dict[str, tuple[Op, ...]] = {}

    def instrs(self, comp: str) -> list[_Instr]:
        if comp not in self._instrs:
            parsed = (_instruction(line) for line in self.lines.get(comp, ()))
            self._instrs[comp] = [i for i in parsed if i is not None]
        return self._instrs[comp]

    def shapes(self, comp: str) -> dict[str, str]:
        if comp not in self._shapes:
            self._shapes[comp] = {i.name: i.shape for i in self.instrs(comp)}
        return self._shapes[comp]

    # -- FLOPs ---------------------------------------------------------------------------------

    def comp_flops(self, comp: str) -> tuple[float, str, bool]:
        """`(FLOPs, rate key, holds a collective)` of every product in `comp`, nested too."""
        if comp in self._flops:
            return self._flops[comp]
        self._flops[comp] = (0.0, "bf16", False)  # guards against recursion
        shapes = self.shapes(comp)
        total, key, best, collective = 0.0, "bf16", -1.0, False
        for ins in self.instrs(comp):
            base = ins.opcode.removesuffix("-start")
            if base in COLLECTIVES:
                collective = True
            flops, rate = _product_flops(ins, shapes)
            for sub in (*_called(ins.attrs, "calls"), *_called(ins.attrs, "to_apply")):
                if base in ("all-reduce", "reduce-scatter") or ins.opcode in ("reduce", "sort"):
                    continue  # reducers and comparators: scalar computations
                sub_flops, sub_rate, sub_coll = self.comp_flops(sub)
                collective |= sub_coll
                if sub_flops > flops:
                    rate = sub_rate
                flops += sub_flops
            total += flops
            if flops > best:
                best, key = flops, rate
        self._flops[comp] = (total, key, collective)
        return self._flops[comp]

    # -- ops -----------------------------------------------------------------------------------

    def ops(self, comp: str) -> tuple[Op, ...]:
        """The costed ops of computation `comp` in schedule order (`call`s inlined)."""
        if comp in self._ops:
            return self._ops[comp]
        shapes = self.shapes(comp)
        out: list[Op] = []
        updates: dict[str, str] = {}  # async-update -> the op it continues
        for ins in self.instrs(comp):
            if ins.opcode == "call":
                for sub in _called(ins.attrs, "to_apply"):
                    out.extend(self.ops(sub))
                continue
            if ins.opcode == "async-update" and ins.operands:
                updates[ins.name] = ins.operands[0]
            op = self.op(ins, shapes)
            if op.kind == DONE:
                start = op.start
                while start in updates:
                    start = updates[start]
                op = dataclasses.replace(op, start=start)
            out.append(op)
        self._ops[comp] = tuple(out)
        return self._ops[comp]

    def op(self, ins: _Instr, shapes: dict[str, str]) -> Op:
        opcode = ins.opcode
        if opcode in _FREE_OPCODES:
            return Op(ins.name, opcode, FREE)
        if opcode == "while":
            body = (
                [*self.ops(_called(ins.attrs, "condition")[0])] if "condition=" in ins.attrs else []
            )
            body = [*self.ops(_called(ins.attrs, "body")[0]), *body]
            trip = _backend_json(ins.attrs).get("known_trip_count", {}).get("n")
            return Op(
                ins.name, opcode, LOOP, body=tuple(body), trip_count=int(trip) if trip else None
            )
        if opcode == "conditional":
            names = _called(ins.attrs, "branch_computations") or [
                *_called(ins.attrs, "true_computation"),
                *_called(ins.attrs, "false_computation"),
            ]
            return Op(ins.name, opcode, BRANCH, branches=tuple(self.ops(n) for n in names))
        if opcode.endswith("-done"):
            return Op(ins.name, opcode, DONE, start=ins.operands[0] if ins.operands else "")
        base = opcode.removesuffix("-start")
        if base in COLLECTIVES:
            return self._collective(ins, base, ins, shapes, asynchronous=opcode != base)
        if opcode == "async-start":
            for sub in _called(ins.attrs, "calls"):
                for inner in self.instrs(sub):
                    if inner.opcode.removesuffix("-start") in COLLECTIVES:
                        return self._collective(
                            ins, inner.opcode.removesuffix("-start"), inner, self.shapes(sub)
                        )
        return self._kernel(ins, shapes)

    def _collective(self, ins, kind, coll, shapes, asynchronous=True) -> Op:
        """A collective `coll` (the start itself or the one an async-start wraps)."""
        operands = [_nbytes(shapes.get(o, "")) for o in coll.operands]
        result = _nbytes(coll.shape)
        if coll.opcode.endswith("-start"):  # result = (operands..., output[, context])
            result = max(result - sum(operands), 0.0)
        if kind == "ragged-all-to-all":
            buffer = operands[0] if operands else result
        elif kind == "all-gather":
            buffer = result
        else:
            buffer = sum(operands) or result
        config = _backend_json(ins.attrs).get("collective_backend_config", {})
        sync = not asynchronous or bool(config.get("is_sync"))
        return Op(
            ins.name,
            ins.opcode,
            SYNC if sync else START,
            collective=kind,
            comm_bytes=buffer,
            groups=_groups(coll.attrs, self.devices),
        )

    def _kernel(self, ins: _Instr, shapes: dict[str, str]) -> Op:
        """A kernel: its products' FLOPs and the bytes of its operands and result."""
        operand_bytes = sum(_nbytes(shapes.get(o, "")) for o in dict.fromkeys(ins.operands))
        nbytes = operand_bytes + _nbytes(ins.shape)
        flops, rate = _product_flops(ins, shapes)
        if ins.opcode == "custom-call":
            m = re.search(r'"cost_estimate"\s*:\s*(\{[^}]*\})', ins.attrs)
            cost = json.loads(m[1]) if m else None
            if cost:  # a Mosaic kernel's own estimate
                flops = float(cost.get("flops", 0))
                nbytes = float(cost.get("bytes_accessed", nbytes)) or nbytes
                rate = _rate_key(_main_dtype(ins, shapes), False)
            elif not flops:
                flops, rate = _pallas_flops(ins, shapes)
        elif ins.opcode in ("fusion", "async-start"):
            for sub in _called(ins.attrs, "calls"):
                sub_flops, sub_rate, collective = self.comp_flops(sub)
                if collective:  # e.g. a TPU collective fusion: it blocks like a sync one
                    for inner in self.instrs(sub):
                        base = inner.opcode.removesuffix("-start")
                        if base in COLLECTIVES:
                            op = self._collective(ins, base, inner, self.shapes(sub), False)
                            return dataclasses.replace(op, kind=SYNC)
                flops, rate = flops + sub_flops, sub_rate
        return Op(ins.name, ins.opcode, COMPUTE, flops=flops, dtype=rate, bytes=nbytes)


def _highest(text: str) -> bool:
    return bool(
        re.search(r"operand_precision=\{highest|\"HIGHEST\"|dot_f32_f32_f32|F32_F32_F32", text)
    )


def _product_flops(ins: _Instr, shapes: dict[str, str]) -> tuple[float, str]:
    """`(FLOPs, rate key)` of a `dot`, `convolution` or cuBLAS custom call; (0, "bf16") else."""
    result = _arrays(ins.shape)
    if not result or not ins.operands:
        return 0.0, "bf16"
    lhs = _arrays(shapes.get(ins.operands[0], ""))
    if not lhs:
        return 0.0, "bf16"
    lhs_dtype, lhs_dims = lhs[0]
    out = math.prod(result[0][1])
    if ins.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        contracted = [int(d) for d in m[1].split(",") if d] if m else []
    elif ins.opcode == "convolution" and len(ins.operands) > 1:
        rhs = _arrays(shapes.get(ins.operands[1], ""))
        m = re.search(r"dim_labels=\w*_(\w+)->", ins.attrs)
        if not rhs or not m or "o" not in m[1]:
            return 0.0, "bf16"
        kernel = rhs[0][1]
        per_output = math.prod(kernel) / max(kernel[m[1].index("o")], 1)
        return 2.0 * out * per_output, _rate_key(lhs_dtype, _highest(ins.attrs))
    elif ins.opcode == "custom-call" and "__cublas$" in ins.attrs:
        dims = _backend_json(ins.attrs).get("gemm_backend_config", {})
        dims = dims.get("dot_dimension_numbers", {})
        contracted = [int(d) for d in dims.get("lhs_contracting_dimensions", [])]
    else:
        return 0.0, "bf16"
    k = math.prod(lhs_dims[d] for d in contracted if d < len(lhs_dims))
    return 2.0 * out * k, _rate_key(lhs_dtype, _highest(ins.attrs))


def _operand_arrays(ins: _Instr, shapes: dict[str, str]) -> list[tuple[str, tuple[int, ...]]]:
    m = re.search(r"operand_layout_constraints=\{(.*?)\}\s*,\s*\w+=", ins.attrs)
    if m:
        return _arrays(m[1])
    return [a for o in ins.operands for a in _arrays(shapes.get(o, ""))]


def _main_dtype(ins: _Instr, shapes: dict[str, str]) -> str:
    floats = [
        (math.prod(d), t) for t, d in _operand_arrays(ins, shapes) if t.startswith(("f", "bf"))
    ]
    return max(floats)[1] if floats else "bf16"


def _pallas_flops(ins: _Instr, shapes: dict[str, str]) -> tuple[float, str]:
    """FLOPs of this package's Triton kernels and jax's flash attention, from their shapes.

    `gmm` / `gmm_t` / `gather_gmm`: lhs `[M, K]` times one group's weight per row -> `[M, N]`;
    `tgmm`: `[M, K]^T [M, N]` per group -> `[G, K, N]`; `mha_forward`: `Q K^T` and `P V` over
    `q, k, v [B, S, H, D]`; `mha_backward`: five products of that size.
    """
    from pallas_kernels import introspect

    calls = introspect.compiled_kernel_calls(ins.line)
    if not calls:
        return 0.0, "bf16"
    name = calls[0].name
    floats = [(t, d) for t, d in _operand_arrays(ins, shapes) if t.startswith(("f", "bf"))]
    result = _arrays(ins.shape)
    if not floats or not result:
        return 0.0, "bf16"
    dtype = _rate_key(floats[0][0], False)  # Pallas kernels multiply at DEFAULT precision
    out = result[0][1]
    lhs = floats[0][1]
    if name in ("gmm", "gmm_t", "gather_gmm") and len(lhs) == 2:
        return 2.0 * math.prod(out) * lhs[-1], dtype
    if name == "tgmm" and len(lhs) == 2 and len(out) == 3:
        return 2.0 * lhs[0] * out[1] * out[2], dtype
    if name in ("mha_forward", "mha_backward") and len(floats) >= 2 and len(lhs) == 4:
        products = 2 if name == "mha_forward" else 5
        return 2.0 * products * math.prod(lhs) * floats[1][1][1], dtype
    return 0.0, dtype


def parse(hlo_text: str) -> tuple[Op, ...]:
    """The ENTRY computation of compiled, scheduled HLO text as costed ops, in schedule order.

    Args:
      hlo_text: `jax.jit(f).lower(...).compile().as_text()` (`moejax.aot.Compiled.text`).

    Returns:
      One `Op` per instruction (`call`s inlined; loops and conditionals hold their bodies).
    """
    module = _Module(hlo_text)
    return module.ops(module.entry)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def collective_seconds(
    kind: str, nbytes: float, groups: Sequence[Sequence[int]], hardware: Hardware
) -> float:
    """Seconds one collective takes on `hardware` (the module docstring gives the rules).

    Args:
      kind: one of `COLLECTIVES`.
      nbytes: its buffer (`Op.comm_bytes`).
      groups: device ids of each replica group; collective-permute: (source, target) pairs.
      hardware: the device.

    Returns:
      Link time plus `hardware.collective_latency_s`.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"kind must be one of {COLLECTIVES}, got {kind!r}")
    node = hardware.node_size

    def same_node(a: int, b: int) -> bool:
        return not node or a // node == b // node

    if kind == "collective-permute":
        if not groups or all(len(p) < 2 or p[0] == p[1] for p in groups):
            return hardware.collective_latency_s
        local = all(same_node(p[0], p[-1]) for p in groups)
        rate = hardware.link_bytes_per_s if local else hardware.network_bytes_per_s
        return nbytes / rate + hardware.collective_latency_s
    n = max((len(g) for g in groups), default=1)
    if n <= 1:
        return hardware.collective_latency_s
    share = {"all-reduce": 2 * (n - 1) / n}.get(kind, (n - 1) / n)
    sent = share * nbytes
    if kind in ("all-to-all", "ragged-all-to-all"):
        # Each device sends to every peer: the in-node and cross-node parts go in parallel.
        worst = 0.0
        for group in groups:
            for d in group:
                peers_here = sum(same_node(d, e) for e in group) - 1
                here = peers_here / (len(group) - 1) if len(group) > 1 else 1.0
                worst = max(
                    worst,
                    sent * here / hardware.link_bytes_per_s,
                    sent * (1 - here) / hardware.network_bytes_per_s if here < 1 else 0.0,
                )
        return worst + hardware.collective_latency_s
    local = all(same_node(g[0], d) for g in groups for d in g)
    rate = hardware.link_bytes_per_s if local else hardware.network_bytes_per_s
    return sent / rate + hardware.collective_latency_s


def op_seconds(op: Op, hardware: Hardware) -> float:
    """Seconds of a COMPUTE op (roofline plus launch) or a collective's START / SYNC on
    `hardware`; 0 for the others."""
    if op.kind == COMPUTE:
        roofline = max(op.flops / hardware.peak(op.dtype), op.bytes / hardware.hbm_bytes_per_s)
        return roofline + hardware.launch_s
    if op.kind in (START, SYNC):
        return collective_seconds(op.collective, op.comm_bytes, op.groups, hardware)
    return 0.0


@dataclasses.dataclass(frozen=True)
class Window:
    """One collective as the model ran it (times per execution).

    Attributes:
      name: its start instruction (or the synchronous collective).
      collective: one of `COLLECTIVES`.
      bytes: its buffer (`Op.comm_bytes`).
      seconds: its time on the link.
      issue_s: when the compute stream issued it.
      done_s: when the compute stream reached its done (for a synchronous one: `issue_s`).
      exposed_s: how long the compute stream then waited for it.
      count: executions this record stands for (loop iterations).
      synchronous: whether it ran as a synchronous collective.
    """

    name: str
    collective: str
    bytes: float
    seconds: float
    issue_s: float
    done_s: float
    exposed_s: float
    count: int = 1
    synchronous: bool = False


@dataclasses.dataclass(frozen=True)
class ScheduleEstimate:
    """A schedule replayed on a `Hardware` model.

    Attributes:
      hardware: the model's name.
      step_s: estimated step time (both streams drained).
      compute_s: kernel time (the compute stream's busy time).
      comm_s: collective time, each counted in full.
      exposed_s: time the compute stream waited for collectives (the step minus compute).
      comm_by_kind: `comm_s` split by collective kind.
      exposed_by_kind: `exposed_s` split by the kind of the collective waited for.
      windows: every collective, in issue order.
      notes: assumptions made (unknown loop trip counts).
    """

    hardware: str
    step_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    comm_by_kind: dict[str, float]
    exposed_by_kind: dict[str, float]
    windows: tuple[Window, ...]
    notes: tuple[str, ...] = ()

    def exposed(self, kind: str) -> float:
        """Exposed seconds of one collective kind."""
        return self.exposed_by_kind.get(kind, 0.0)

    def comm(self, kind: str) -> float:
        """Seconds on the link of one collective kind."""
        return self.comm_by_kind.get(kind, 0.0)

    def summary(self) -> str:
        """One line: step, compute, communication and exposure, in ms."""
        kinds = ", ".join(
            f"{k} {self.exposed(k) * 1e3:.3f}/{self.comm(k) * 1e3:.3f}"
            for k in COLLECTIVES
            if self.comm(k)
        )
        return (
            f"{self.hardware}: step {self.step_s * 1e3:.3f} ms = compute "
            f"{self.compute_s * 1e3:.3f} + exposed {self.exposed_s * 1e3:.3f} "
            f"(comm {self.comm_s * 1e3:.3f}; exposed/total by kind: {kinds or 'none'})"
        )

    def table(self) -> str:
        """Markdown: one row per collective kind (ms), then the step."""
        rows = ["| collective | count | comm ms | exposed ms |", "|---|---:|---:|---:|"]
        for kind in COLLECTIVES:
            if self.comm(kind):
                count = sum(w.count for w in self.windows if w.collective == kind)
                rows.append(
                    f"| {kind} | {count} | {self.comm(kind) * 1e3:.3f} "
                    f"| {self.exposed(kind) * 1e3:.3f} |"
                )
        rows.append(
            f"| step {self.step_s * 1e3:.3f} ms | | compute {self.compute_s * 1e3:.3f} "
            f"| {self.exposed_s * 1e3:.3f} |"
        )
        return "\n".join(rows)


@dataclasses.dataclass
class _State:
    """The replay's clocks and running totals (mutable; copied for loops and branches)."""

    now: float = 0.0  # compute stream clock
    comm_free: float = 0.0  # when the communication stream is next free
    compute_s: float = 0.0
    comm: dict = dataclasses.field(default_factory=dict)
    exposed: dict = dataclasses.field(default_factory=dict)
    windows: list = dataclasses.field(default_factory=list)
    in_flight: dict = dataclasses.field(default_factory=dict)  # start name -> (Op, t0, t1, s)

    def copy(self) -> _State:
        return dataclasses.replace(
            self,
            comm=dict(self.comm),
            exposed=dict(self.exposed),
            windows=list(self.windows),
            in_flight=dict(self.in_flight),
        )


def _add(totals: dict, key: str, value: float) -> None:
    totals[key] = totals.get(key, 0.0) + value


def _window(op: Op, seconds, issue_s, done_s, exposed_s, synchronous=False) -> Window:
    return Window(
        op.name, op.collective, op.comm_bytes, seconds, issue_s, done_s, exposed_s, 1, synchronous
    )


class _Replay:
    def __init__(self, hardware, default_trip_count, measured):
        self.hw = hardware
        self.default_trip_count = default_trip_count
        self.measured = measured
        self.notes: list[str] = []

    def seconds(self, op: Op) -> float:
        if op.name in self.measured:
            return float(self.measured[op.name])
        return op_seconds(op, self.hw)

    def run(self, ops: Sequence[Op], st: _State) -> _State:
        for op in ops:
            if op.kind == COMPUTE:
                seconds = self.seconds(op)
                st.now += seconds
                st.compute_s += seconds
            elif op.kind == START:
                seconds = self.seconds(op)
                begin = max(st.now, st.comm_free)
                st.comm_free = begin + seconds
                st.in_flight[op.name] = (op, st.now, st.comm_free, seconds)
                _add(st.comm, op.collective, seconds)
            elif op.kind == DONE and op.start in st.in_flight:
                start, issued, finish, seconds = st.in_flight.pop(op.start)
                wait = max(0.0, finish - st.now)
                st.windows.append(_window(start, seconds, issued, st.now, wait))
                _add(st.exposed, start.collective, wait)
                st.now += wait
            elif op.kind == SYNC:
                seconds = self.seconds(op)
                finish = max(st.now, st.comm_free) + seconds
                wait = finish - st.now
                st.windows.append(_window(op, seconds, st.now, st.now, wait, synchronous=True))
                _add(st.comm, op.collective, seconds)
                _add(st.exposed, op.collective, wait)
                st.now = st.comm_free = finish
            elif op.kind == LOOP:
                st = self.loop(op, st)
            elif op.kind == BRANCH and op.branches:
                ends = [self.run(branch, st.copy()) for branch in op.branches]
                st = max(ends, key=lambda s: s.now)
        return st

    def loop(self, op: Op, st: _State) -> _State:
        trips = op.trip_count
        if trips is None:
            trips = self.default_trip_count
            self.notes.append(f"{op.name}: trip count unknown, ran {trips}")
        done = 0
        while done < trips:
            clean = not st.in_flight
            before = st.copy()
            st = self.run(op.body, st)
            done += 1
            rest = trips - done
            if clean and not st.in_flight and rest:
                # Same state at both ends: every remaining iteration repeats this one, shifted.
                shift = st.now - before.now
                st.now += rest * shift
                st.comm_free += rest * shift
                st.compute_s += rest * (st.compute_s - before.compute_s)
                for totals, old in ((st.comm, before.comm), (st.exposed, before.exposed)):
                    for key in totals:
                        totals[key] += rest * (totals[key] - old.get(key, 0.0))
                new = len(before.windows)
                st.windows[new:] = [
                    dataclasses.replace(w, count=w.count * (rest + 1)) for w in st.windows[new:]
                ]
                break
        return st


def simulate(
    ops: Sequence[Op],
    hardware: Hardware,
    *,
    default_trip_count: int = 1,
    measured: Mapping[str, float] | None = None,
) -> ScheduleEstimate:
    """Replay scheduled ops on a compute and a communication stream.

    Args:
      ops: `parse`'s output (or hand-made `Op`s).
      hardware: the device model.
      default_trip_count: iterations of a loop whose trip count XLA could not prove.
      measured: seconds by instruction name, replacing the model's for those ops.

    Returns:
      The `ScheduleEstimate`.
    """
    if default_trip_count < 0:
        raise ValueError(f"default_trip_count must be >= 0, got {default_trip_count!r}")
    replay = _Replay(hardware, default_trip_count, dict(measured or {}))
    st = replay.run(ops, _State())
    for start, issued, finish, seconds in st.in_flight.values():  # never waited for
        st.windows.append(_window(start, seconds, issued, finish, 0.0))
    step = max(st.now, st.comm_free)
    exposed = sum(st.exposed.values())
    st.windows.sort(key=lambda w: w.issue_s)
    return ScheduleEstimate(
        hardware=hardware.name,
        step_s=step,
        compute_s=st.compute_s,
        comm_s=sum(st.comm.values()),
        exposed_s=exposed,
        comm_by_kind=dict(st.comm),
        exposed_by_kind=dict(st.exposed),
        windows=tuple(st.windows),
        notes=tuple(dict.fromkeys(replay.notes)),
    )


def estimate(program, hardware: Hardware = H100_SXM, **kwargs) -> ScheduleEstimate:
    """`simulate(parse(text), hardware)` of a compiled program.

    Args:
      program: compiled HLO text, or anything with a `.text` holding it (`aot.Compiled`).
      hardware: the device model (`H100_SXM`, `TPU_V5E`, `TPU_V5P`, or your own).
      **kwargs: `default_trip_count`, `measured`, as for `simulate`.

    Returns:
      The `ScheduleEstimate`.
    """
    text = program if isinstance(program, str) else program.text
    return simulate(parse(text), hardware, **kwargs)


__all__ = [
    "BRANCH",
    "COLLECTIVES",
    "COMPUTE",
    "DONE",
    "FREE",
    "H100_SXM",
    "HARDWARE",
    "LOOP",
    "START",
    "SYNC",
    "TPU_V5E",
    "TPU_V5P",
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
