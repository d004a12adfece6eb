"""A compiled, scheduled HLO text parsed into costed instructions (`Op`), in schedule order."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np

from moejax.aot import hlo
from moejax.aot.hlo import Instr

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
        self.lines, self.entry, self.devices = hlo.computations(text)
        self._instrs: dict[str, list[Instr]] = {}
        self._shapes: dict[str, dict[str, str]] = {}
        self._flops: dict[str, tuple[float, str, bool]] = {}
        self._ops: dict[str, tuple[Op, ...]] = {}

    def instrs(self, comp: str) -> list[Instr]:
        if comp not in self._instrs:
            self._instrs[comp] = hlo.parsed(self.lines.get(comp, ()))
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

    def op(self, ins: Instr, shapes: dict[str, str]) -> Op:
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

    def _kernel(self, ins: Instr, shapes: dict[str, str]) -> Op:
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


def _product_flops(ins: Instr, shapes: dict[str, str]) -> tuple[float, str]:
    """`(FLOPs, rate key)` of a `dot`, `convolution`, cuBLAS or cuDNN attention custom call;
    (0, "bf16") else."""
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
    elif ins.opcode == "custom-call" and "__cudnn$fmha" in ins.attrs:
        return _cudnn_attention_flops(ins, shapes)
    elif ins.opcode == "custom-call" and "__cublas$" in ins.attrs:
        dims = _backend_json(ins.attrs).get("gemm_backend_config", {})
        dims = dims.get("dot_dimension_numbers", {})
        contracted = [int(d) for d in dims.get("lhs_contracting_dimensions", [])]
    else:
        return 0.0, "bf16"
    k = math.prod(lhs_dims[d] for d in contracted if d < len(lhs_dims))
    return 2.0 * out * k, _rate_key(lhs_dtype, _highest(ins.attrs))


def _cudnn_attention_flops(ins: Instr, shapes: dict[str, str]) -> tuple[float, str]:
    """cuDNN's flash attention (`__cudnn$fmhaSoftmax`, `...Backward`): `Q K^T` and `P V` (five
    products backward) over the scores `[B, H, S, T]` its backend config names, `Dh` deep (q's
    last axis); the causal half where its mask is causal (cuDNN skips the masked tiles)."""
    config = _backend_json(ins.attrs).get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in config.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    operands = _operand_arrays(ins, shapes)
    if len(scores) != 4 or not operands or len(operands[0][1]) != 4:
        return 0.0, "bf16"
    products = 5 if "fmhaSoftmaxBackward" in ins.attrs else 2
    causal = 0.5 if config.get("mask_type") == "CAUSAL" else 1.0
    flops = 2.0 * products * math.prod(scores) * operands[0][1][-1] * causal
    return flops, _rate_key(operands[0][0], False)


def _operand_arrays(ins: Instr, shapes: dict[str, str]) -> list[tuple[str, tuple[int, ...]]]:
    m = re.search(r"operand_layout_constraints=\{(.*?)\}\s*,\s*\w+=", ins.attrs)
    if m:
        return _arrays(m[1])
    return [a for o in ins.operands for a in _arrays(shapes.get(o, ""))]


def _main_dtype(ins: Instr, shapes: dict[str, str]) -> str:
    floats = [
        (math.prod(d), t) for t, d in _operand_arrays(ins, shapes) if t.startswith(("f", "bf"))
    ]
    return max(floats)[1] if floats else "bf16"


def _pallas_flops(ins: Instr, shapes: dict[str, str]) -> tuple[float, str]:
    """FLOPs of this package's Triton kernels and jax's flash attention, from their shapes.

    `gmm` / `gmm_t` / `gather_gmm`: lhs `[M, K]` times one group's weight per row -> `[M, N]`;
    `tgmm`: `[M, K]^T [M, N]` per group -> `[G, K, N]`; the fp8 kernels likewise (`fp8_gmm`:
    lhs `[M, K]`; `fp8_tgmm`: lhs `x^T [K, M]`, at the fp8 rate); `mha_forward`: `Q K^T` and
    `P V` over `q, k, v [B, S, H, D]`; `mha_backward`: five products of that size.
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
    if name in ("gmm", "gmm_t", "gather_gmm", "fp8_gmm") and len(lhs) == 2:
        return 2.0 * math.prod(out) * lhs[-1], dtype
    if name == "tgmm" and len(lhs) == 2 and len(out) == 3:
        return 2.0 * lhs[0] * out[1] * out[2], dtype
    if name == "fp8_tgmm" and len(lhs) == 2 and len(out) == 3:
        return 2.0 * lhs[1] * out[1] * out[2], dtype
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
