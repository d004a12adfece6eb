"""Seeing the XLA:GPU schedule of a sharded MoE call without a GPU (deviceless AOT compile).

Needs the CUDA plugin wheels (no NVIDIA libraries; `pallas_kernels.targets.install_command()`),
importable before jax initialises its backends; run with `JAX_PLATFORMS=cpu` (docs/design.md,
"Compiling for hardware you do not have"). `overlap(hlo_text)` pairs every async collective's
`*-start` with its `*-done` and counts the compute ops (fusions, GEMM custom-calls) the scheduler
put between them.
"""

from __future__ import annotations

import re

from pallas_kernels import targets

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s")


def gpu_mesh(shape, axis_names, topology: str = "1x1x8"):
    """A deviceless CUDA mesh (AOT compile only) of `shape` over `topology`."""
    return targets.gpu_mesh(shape, axis_names, topology=topology)


def _windows(hlo_text: str, collective: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """`(start name, [(name, line) of each instruction between the start and its done])` for
    each `<collective>` of the ENTRY computation, in schedule order.

    A synchronous `<collective>(` is a window with nothing inside: from jax 0.11, XLA:GPU turns
    an async pair with nothing scheduled between its start and done back into one synchronous
    op, so counting only `-start`s would count fewer exchanges on newer jax for the same
    program.
    """
    entry = hlo_text[hlo_text.index("ENTRY") :]
    sync = re.compile(rf"\s{re.escape(collective)}\(")
    open_: dict[str, list[tuple[str, str]]] = {}
    out = []
    for line in entry.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name = m.group(1)
        if sync.search(line.split("=", 1)[1]):
            for inside in open_.values():
                inside.append((name, line))
            out.append((name, []))
        elif name.startswith(f"{collective}-start"):
            open_[name] = []
        elif name.startswith(f"{collective}-done"):
            started = re.search(rf"%({collective}-start[\w.\-]*)", line)
            if started and started.group(1) in open_:
                key = started.group(1)
                out.append((key, open_.pop(key)))
        else:
            for inside in open_.values():
                inside.append((name, line))
    return out


def windows(
    hlo_text: str, collective: str = "all-to-all"
) -> list[tuple[str, list[tuple[str, str]]]]:
    """`(start name, [(name, line) of every instruction between the start and its done])` for
    each `<collective>` of the ENTRY computation, in schedule order (a synchronous one is an
    empty window: see `_windows`). Any scheduled HLO text will do: XLA:GPU's, or libtpu's with
    async all-to-all."""
    return _windows(hlo_text, collective)


def overlap(hlo_text: str, collective: str = "all-to-all") -> list[tuple[str, int]]:
    """GEMMs scheduled inside each `<collective>` window of the ENTRY computation (0 for a
    synchronous one).

    Returns `(start name, GEMM instructions between the start and its done)` in schedule order.
    GEMMs are instructions whose name contains `gemm` (XLA:GPU names its cuBLAS and Triton GEMM
    fusions so), which is how the compiled text tells them apart from other fusions.
    """
    return [
        (start, sum("gemm" in name for name, _ in inside))
        for start, inside in _windows(hlo_text, collective)
    ]


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def window_kernels(
    hlo_text: str, collective: str = "all-to-all"
) -> list[tuple[str, list[tuple[str, str]]]]:
    """The GEMMs and Pallas kernels inside each async `<collective>` window of the ENTRY
    computation, by their `op_name` (the jax scope that made them: `.../micro1/attention/...`,
    `transpose(jvp(...))/...` for the backward, `.../tgmm/pallas_call` for an expert weight
    gradient).

    Returns `(start name, [(op_name, result shape) of each GEMM or kernel between the start and
    its done])` in schedule order; `overlap` counts the XLA GEMMs only.
    """
    out = []
    for start, inside in _windows(hlo_text, collective):
        kernels = []
        for name, line in inside:
            if "gemm" in name or " custom-call(" in line:
                tag = _OP_NAME.search(line)
                shape = line[_INSTR.match(line).end() :].split(" ", 1)[0]
                kernels.append((tag.group(1) if tag else name, shape))
        out.append((start, kernels))
    return out


def entry_instructions(hlo_text: str) -> list[tuple[str, str, str]]:
    """`(name, op_name or "", line)` of each instruction of the ENTRY computation, in schedule
    order."""
    out = []
    for line in hlo_text[hlo_text.index("ENTRY") :].splitlines():
        m = _INSTR.match(line)
        if m:
            tag = _OP_NAME.search(line)
            out.append((m.group(1), tag.group(1) if tag else "", line))
    return out


# The attention projections' einsums (`moejax._wgrad.ATTENTION_SPECS`), as op_names carry them.
_PROJECTIONS = ("bsd,dhk->bshk", "bshk,hkd->bsd")


def weight_gradient_kernels(
    hlo_text: str, rows: int, collective: str = "all-to-all"
) -> list[tuple[str, str, bool]]:
    """The weight-gradient GEMMs and kernels of the ENTRY computation, and whether each sits
    inside an async `<collective>` window.

    Weight gradients are the experts' `tgmm` kernels and the attention projections' transposed
    einsums whose result is not shaped like the `rows` token rows of one call (those are input
    gradients; XLA:GPU computes a projection's weight gradient as a GEMM batched over
    sequences, reduced afterwards).

    Returns:
      `(kind, op_name, inside)` in schedule order; `kind` is `"experts"` or `"attention"`.
    """
    inside = {name for _, ops in _windows(hlo_text, collective) for name, _ in ops}
    out = []
    for name, op, line in entry_instructions(hlo_text):
        if "transpose(" not in op:
            continue
        shape = line[_INSTR.match(line).end() :].split(" ", 1)[0]
        if " custom-call(" in line and "tgmm" in op:
            out.append(("experts", op, name in inside))
        elif "gemm" in name and any(p in op for p in _PROJECTIONS) and f"[{rows}," not in shape:
            out.append(("attention", op, name in inside))
    return out
