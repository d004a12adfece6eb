"""Dispatcher (a): capacity all-to-all (GShard). Fixed buffers of `C` rows per (device, expert).

Every device lays its kept assignments into a `[E, C, D]` send buffer (expert `e`'s first `C`
kept assignments, in sorted order), one all-to-all sends block `[G, C, D]` to each expert-axis
device, the receiver runs its `G` experts, a second all-to-all brings the outputs back, and the
sender combines them with the routing weights.

The capacity itself is decided by the router phase (`apply_capacity`, per sequence), exactly as on
one device, so the dropped assignments (reported in `aux.dropped_mask`) are the single-device ones.
`C` is a static bound on what capacity routing can keep per (device, expert):
`min(T_local, local_sequences * capacity(S))`, so the buffer never overflows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from moejax import _wgrad
from moejax._config import MoEConfig
from moejax._permute import make_layout, permute
from moejax._types import GroupedLayout, Routing
from moejax.parallel import _collectives as col
from moejax.parallel._local import combine_varying, regrouped_ffn
from moejax.parallel._overlap import tie


def slot_bound(config: MoEConfig, chunk_tokens: int, seq_len: int, local_sequences: int) -> int:
    """`C` for a chunk of `chunk_tokens` consecutive tokens out of sequences of `seq_len` tokens.

    A chunk overlaps at most `ceil(chunk / S) + 1` sequences (fewer if it is aligned), each keeping
    at most `capacity(S)` assignments per expert, and each token sends at most one assignment to an
    expert (top-k picks distinct experts), so `C <= chunk_tokens`.
    """
    cap = config.capacity(seq_len)
    if config.router == "expert_choice":
        cap = min(cap, seq_len)
    seqs = min(local_sequences, math.ceil(chunk_tokens / seq_len) + 1)
    return max(1, min(chunk_tokens, seqs * cap))


def slot_layout(routing: Routing, num_experts: int, slots: int) -> GroupedLayout:
    """Layout with expert `e`'s k-th kept assignment on row `e * C + k` (R = E * C rows).

    Assignments past `C` (impossible for capacity routing with `C` from `slot_bound`) get the
    out-of-range row `E * C` and contribute zero.
    """
    t, k = routing.expert_index.shape
    a = t * k
    base = make_layout(routing, num_experts, 1)  # rows sorted by expert, R = A
    counts = base.group_sizes
    start = jnp.cumsum(counts) - counts
    e = jnp.clip(routing.expert_index, 0, num_experts - 1)
    row = base.row_of_assignment
    rank = row - start[e]
    r = num_experts * slots
    new_row = jnp.where((row < a) & (rank < slots), e * slots + rank, r).astype(jnp.int32)
    flat = new_row.reshape(a)
    assignment = jnp.arange(a, dtype=jnp.int32)
    token_of_row = jnp.full(r, t, jnp.int32).at[flat].set(assignment // k, mode="drop")
    assignment_of_row = jnp.full(r, a, jnp.int32).at[flat].set(assignment, mode="drop")
    return GroupedLayout(
        row_of_assignment=new_row,
        token_of_row=token_of_row,
        assignment_of_row=assignment_of_row,
        group_sizes=jnp.minimum(counts, slots),
        group_of_row=(jnp.arange(r, dtype=jnp.int32) // slots),
    )


def capacity_all_to_all(
    x: jax.Array,
    routing: Routing,
    experts: dict,
    config: MoEConfig,
    implementation: str,
    axes: col.MeshAxes,
    slots: int,
    side=None,
):
    """Expert outputs of the local tokens through fixed-size all-to-all buffers.

    Args:
      x: `[T, D]` local tokens.
      routing: their routing (capacity already applied), global expert ids.
      experts: this device's `G` experts (F possibly sliced over `model`).
      config: the layer config.
      implementation: as for `moejax.parallel._local.local_moe` ("auto" allowed).
      axes: the mesh axes.
      slots: `C`, rows per (device, expert), see `slot_bound`.
      side: delayed weight gradients (`moejax._wgrad.Delayed`) to compute inside the window of
        the return all-to-all's transpose, or None.

    Returns:
      `([T, D]` routed output (a partial sum over `model` when F is sliced), the side's slots
      or None).
    """
    stages = CapacityStages(experts, config, implementation, axes, slots)
    sent = stages.dispatch(x, routing)
    return stages.combine(stages.experts(sent), sent, side)


class CapacityStages:
    """The three stages of the capacity all-to-all, separable for staged pipelining."""

    def __init__(self, experts, config, implementation, axes, slots):
        self.experts_params, self.config, self.implementation = experts, config, implementation
        self.axes, self.slots = axes, slots

    def dispatch(self, x: jax.Array, routing: Routing) -> dict:
        """Send buffer -> all-to-all. Returns received rows `[N * G * C, D]`, their local expert
        ids, and the sender's layout and weights (for `combine`)."""
        e, n, c = self.config.num_experts, self.axes.n, self.slots
        g = e // n
        with jax.named_scope("dispatch"):
            layout = slot_layout(routing, e, c)
            # `tie`: the experts' weight gradients are computed inside the window of this
            # all-to-all's transpose (moejax.parallel._overlap).
            send, experts = tie(permute(x, layout), self.experts_params)
            recv = col.all_to_all(send, self.axes.expert)  # block s: from device s
            recv_counts = col.all_to_all(layout.group_sizes, self.axes.expert).reshape(n, g, 1)
            slot = jnp.arange(c, dtype=jnp.int32)
            g_ids = jnp.arange(g, dtype=jnp.int32)[None, :, None]
            local_expert = jnp.where(slot < recv_counts, g_ids, g).reshape(n * g * c)
        return {
            "recv": recv,
            "experts": experts,
            "local": local_expert,
            "layout": layout,
            "weight": routing.weight,
        }

    def experts(self, sent: dict) -> jax.Array:
        """The `G` local experts on the received rows."""
        with jax.named_scope("experts"):
            return regrouped_ffn(
                sent["recv"], sent["local"], sent["experts"], self.config, self.implementation
            )

    def combine(self, out: jax.Array, sent: dict, side=None):
        """Return all-to-all (`side`'s weight gradients inside its transpose's window,
        `moejax._wgrad.around`), then the weighted sum per token. Returns `(y, slots)`."""
        with jax.named_scope("combine"):
            exchange = functools.partial(col.all_to_all, axis=self.axes.expert)
            back, slots = _wgrad.around(exchange, out, side)
            return combine_varying(back, sent["weight"], sent["layout"]), slots
