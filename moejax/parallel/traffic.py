"""Traffic of one sharded MoE call: dispatch-buffer bytes and communication per device.

Elements moved off-device per device per forward call (the backward moves the same again), with
`N` expert-axis devices, `T` local tokens, `K` top-k, `D` d_model, `E` experts, `F/M` the stored
F slice, `P` expert projections (3 gated, 2 otherwise), `C` capacity slots per (device, expert),
`B` the dropless bucket and `R` its rounds. An all-to-all of an `N`-block buffer keeps 1/N local.

| mode / dispatcher    | forward elements per device                                 |
|----------------------|-------------------------------------------------------------|
| expert / capacity    | 2 (N-1)/N E C D            (send + return, fixed buffers)   |
| expert / dropless    | 2 (N-1) B D R              (R rounds of N B-row buffers)    |
| expert / allgather   | 2 (N-1) T D                (all-gather + reduce-scatter)    |
| data                 | (N-1)/N E P D F/M          (all-gather weights; grads RS)   |
| tensor               | (N-1)/N (E/N) P D F/M + 2 (N-1) T D  (re-slice weights, AG+RS) |

Routing metadata (ids, counts: `4` bytes per row or per expert) is small and counted separately
where it matters. Dispatch buffer (the send buffer one device allocates per exchange):
capacity `E C D`, bounded dropless `N B D` (per round), worst-case dropless `N T K D`.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """Per-device sizes of one call."""

    tokens: int  # T, local tokens
    top_k: int  # K
    d_model: int  # D
    d_ff: int  # F (whole expert)
    num_experts: int  # E
    n: int  # N, expert-axis devices
    m: int = 1  # M, model-axis devices
    projections: int = 3  # P
    bytes_per_element: int = 4


def capacity_slots(s: LayerShape, capacity_factor: float) -> int:
    """`C = ceil(cf * T * K / E)` (one capacity group per device)."""
    return max(1, math.ceil(capacity_factor * s.tokens * s.top_k / s.num_experts))


def buffer_bytes(s: LayerShape, kind: str, *, capacity_factor=1.0, bucket=None) -> int:
    """Send-buffer bytes of one exchange: `"capacity"`, `"dropless"` (bucket B) or `"worst"`."""
    row = s.d_model * s.bytes_per_element
    if kind == "capacity":
        return s.num_experts * capacity_slots(s, capacity_factor) * row
    if kind == "dropless":
        return s.n * bucket * row
    if kind == "worst":
        return s.n * s.tokens * s.top_k * row
    raise ValueError(f"kind={kind!r}: must be 'capacity', 'dropless' or 'worst'")


def comm_bytes(s: LayerShape, mode: str, dispatcher: str = "dropless", **kw) -> int:
    """Forward bytes moved off-device per device (table in the module docstring).

    Keyword args: `capacity_factor` (capacity), `bucket` and `rounds` (dropless).
    """
    n, t, d, e = s.n, s.tokens, s.d_model, s.num_experts
    weights = s.projections * d * s.d_ff // s.m  # one expert's stored slice
    if mode == "data":
        elems = (n - 1) / n * e * weights
    elif mode == "tensor":
        elems = (n - 1) / n * (e / n) * weights + 2 * (n - 1) * t * d
    elif dispatcher == "capacity":
        elems = 2 * (n - 1) / n * e * capacity_slots(s, kw.get("capacity_factor", 1.0)) * d
    elif dispatcher == "dropless":
        elems = 2 * (n - 1) * kw["bucket"] * d * kw.get("rounds", 1)
    elif dispatcher == "allgather":
        elems = 2 * (n - 1) * t * d
    else:
        raise ValueError(f"mode={mode!r}, dispatcher={dispatcher!r}: unknown")
    return int(elems * s.bytes_per_element)
