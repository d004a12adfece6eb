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
    each async `<collective>` window of the ENTRY computation, in schedule order."""
    entry = hlo_text[hlo_text.index("ENTRY") :]
    open_: dict[str, list[tuple[str, str]]] = {}
    out = []
    for line in entry.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name = m.group(1)
        if name.startswith(f"{collective}-start"):
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


def overlap(hlo_text: str, collective: str = "all-to-all") -> list[tuple[str, int]]:
    """GEMMs scheduled inside each async `<collective>` window of the ENTRY computation.

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
