"""What the scheduler put inside each async collective's window, read from compiled HLO text.

A deviceless compile (`moejax.aot.compile_program` on an H100 mesh, or TPU with libtpu's async
all-to-all) gives the real schedule: each async collective is a `*-start` and a `*-done`, and the
instructions between them run while it is in flight. `overlap(hlo_text)` counts the GEMMs in each
window, `window_kernels` names the GEMMs and Pallas kernels there, and `weight_gradient_kernels`
says which weight gradients landed inside one (docs/design.md, "Overlap").
"""

from __future__ import annotations

from moejax.aot import hlo


def windows(hlo_text: str, collective: str = "all-to-all") -> list[tuple[str, list[hlo.Instr]]]:
    """`(start name, [each instruction between the start and its done])` for each `<collective>`
    of the ENTRY computation, in schedule order. Any scheduled HLO text will do: XLA:GPU's, or
    libtpu's with async all-to-all.

    A synchronous `<collective>(` is a window with nothing inside: from jax 0.11, XLA:GPU turns
    an async pair with nothing scheduled between its start and done back into one synchronous
    op, so counting only `-start`s would count fewer exchanges on newer jax for the same
    program.
    """
    open_: dict[str, list[hlo.Instr]] = {}
    out = []
    for ins in hlo.entry(hlo_text):
        if ins.opcode == collective:
            for inside in open_.values():
                inside.append(ins)
            out.append((ins.name, []))
        elif ins.name.startswith(f"{collective}-start"):
            open_[ins.name] = []
        elif ins.name.startswith(f"{collective}-done"):
            started = [o for o in ins.operands if o.startswith(f"{collective}-start")]
            if started and started[0] in open_:
                out.append((started[0], open_.pop(started[0])))
        else:
            for inside in open_.values():
                inside.append(ins)
    return out


def overlap(hlo_text: str, collective: str = "all-to-all") -> list[tuple[str, int]]:
    """GEMMs scheduled inside each `<collective>` window of the ENTRY computation (0 for a
    synchronous one).

    Returns `(start name, GEMM instructions between the start and its done)` in schedule order.
    GEMMs are instructions whose name contains `gemm` (XLA:GPU names its cuBLAS and Triton GEMM
    fusions so), which is how the compiled text tells them apart from other fusions.
    """
    return [
        (start, sum("gemm" in ins.name for ins in inside))
        for start, inside in windows(hlo_text, collective)
    ]


def _kernel(ins: hlo.Instr) -> bool:
    """An XLA GEMM or a custom call (cuBLAS, a Pallas kernel)."""
    return "gemm" in ins.name or ins.opcode == "custom-call"


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
    return [
        (start, [(hlo.op_name(i.line) or i.name, i.shape) for i in inside if _kernel(i)])
        for start, inside in windows(hlo_text, collective)
    ]


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
    inside = {ins.name for _, window in windows(hlo_text, collective) for ins in window}
    out = []
    for ins in hlo.entry(hlo_text):
        op = hlo.op_name(ins.line)
        if "transpose(" not in op:
            continue
        if ins.opcode == "custom-call" and "tgmm" in op:
            out.append(("experts", op, ins.name in inside))
        elif (
            "gemm" in ins.name
            and any(p in op for p in _PROJECTIONS)
            and f"[{rows}," not in ins.shape  # else an input gradient
        ):
            out.append(("attention", op, ins.name in inside))
    return out
