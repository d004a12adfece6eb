"""Dispatcher (b): bounded dropless all-to-all. Never drops; never allocates the worst case.

Every device sorts its `A = T * K` kept assignments by expert (so by destination device) and sends
them in rounds: round `r` carries, to each of the `N` expert-axis devices, the destination's rows
`[r * B, (r + 1) * B)`, in a padded `[N * B, D]` all-to-all buffer (`B` = `bucket`, a static
number of rows per (source, destination) pair). The receiver runs its `G` experts on the `N * B`
rows of the round and a second all-to-all returns the outputs in the same slots. The number of
rounds is `max over (source, destination) of ceil(count / B)`, agreed by a `pmax` over the whole
mesh and run by a `lax.while_loop`; with a bucket chosen from the previous step's routing (see
`choose_bucket`), one round is the steady state and skewed steps take extra rounds, so even all
tokens on one expert are delivered. Memory per round is `O(N * B * D)` whatever the routing.

Reverse-mode differentiation of `while_loop` is unsupported, so the exchange is a `custom_vjp`
whose backward runs the same rounds: it re-sends the round's rows and output gradients, takes the
VJP of the local experts on the receiver, and returns row gradients through the reverse
all-to-all (recomputing the forward per round: activation memory stays per round too).

On CPU the exchange is a padded `all_to_all` (`ragged_all_to_all` does not compile on XLA:CPU).
On GPU/TPU `jax.lax.ragged_all_to_all` could send exactly `count` rows per pair in one round;
that branch is not written (it could not be tested here).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax._config import MoEConfig
from moejax._permute import dispatch, make_layout
from moejax._types import Routing
from moejax.parallel import _collectives as col
from moejax.parallel._local import combine_varying, regrouped_ffn


class RoundPlan(NamedTuple):
    """Where the sender's expert-sorted rows go (`A` rows, `N` destinations)."""

    dest_start: jax.Array  # [N] int32 first sorted row for each destination device
    dest_count: jax.Array  # [N] int32 rows for each destination device
    row_dest: jax.Array  # [A] int32 destination of each sorted row
    row_local: jax.Array  # [A] int32 local expert (on the destination) of each sorted row
    total: jax.Array  # [] int32 kept rows (rows past it are unused)
    rounds: jax.Array  # [] int32 rounds, the same on every device


def default_bucket(tokens: int, top_k: int, n: int) -> int:
    """`B` for perfectly balanced routing: `ceil(T * K / N)` rows per (source, destination)."""
    return max(1, math.ceil(tokens * top_k / n))


def choose_bucket(max_pair_count: int, tokens: int, top_k: int, n: int, *, max_factor=1.25):
    """Host-side bucket for the next step from the last step's largest (source, dest) count.

    The bucket is `max_pair_count` rounded up to a multiple of `balanced / 8` (a few static
    buckets, hence few compilations), capped at `max_factor * balanced` rows (`balanced` =
    `default_bucket`): heavier skew takes extra rounds instead of a bigger buffer. (Cap 1.25x is
    the buffer budget of a capacity-factor-1.25 layer, which never drops.)
    """
    balanced = default_bucket(tokens, top_k, n)
    quantum = max(1, math.ceil(balanced / 8))
    cap = math.ceil(max_factor * balanced / quantum) * quantum
    want = math.ceil(max(1, max_pair_count) / quantum) * quantum
    return int(min(want, cap))


def dropless_all_to_all(
    x: jax.Array,
    routing: Routing,
    experts: dict,
    config: MoEConfig,
    implementation: str,
    axes: col.MeshAxes,
    bucket: int,
) -> jax.Array:
    """Expert outputs of the local tokens through bounded all-to-all rounds.

    Args:
      x: `[T, D]` local tokens.
      routing: their routing (global expert ids; dropless keeps everything).
      experts: this device's `G` experts.
      config: the layer config.
      implementation: as for `moejax.parallel._local.local_moe` ("auto" allowed).
      axes: the mesh axes.
      bucket: `B`, rows per (source, destination) pair per round.

    Returns:
      `[T, D]` routed output (a partial sum over `model` when F is sliced).
    """
    e, n = config.num_experts, axes.n
    g = e // n
    with jax.named_scope("dispatch"):
        layout = make_layout(routing, e, 1)  # A rows sorted by expert
        rows = dispatch(x, layout)  # [A, D]
        counts = layout.group_sizes
        dest_count = counts.reshape(n, g).sum(1).astype(jnp.int32)
        dest_start = (jnp.cumsum(dest_count) - dest_count).astype(jnp.int32)
        rounds = jnp.max((dest_count + bucket - 1) // bucket).astype(jnp.int32)
        plan = RoundPlan(
            dest_start=dest_start,
            dest_count=dest_count,
            row_dest=layout.group_of_row // g,
            row_local=layout.group_of_row % g,
            total=jnp.sum(counts).astype(jnp.int32),
            rounds=col.pmax(rounds, axes.all),
        )
    ffn = functools.partial(_ffn, config=config, implementation=implementation)
    out = _exchange(ffn, bucket, axes.expert, rows, plan, experts)
    with jax.named_scope("combine"):
        return combine_varying(out, routing.weight, layout)


def _ffn(rows, local_expert, experts, *, config, implementation):
    return regrouped_ffn(rows, local_expert, experts, config, implementation)


def _round_slots(plan: RoundPlan, r, bucket: int, num_local: int, num_rows: int):
    """Sorted row feeding each of the `N * B` send slots of round `r`, and its local expert."""
    pos = r * bucket + jnp.arange(bucket, dtype=jnp.int32)  # [B]
    valid = pos[None, :] < plan.dest_count[:, None]  # [N, B]
    idx = jnp.where(valid, plan.dest_start[:, None] + pos[None, :], num_rows).reshape(-1)
    local = jnp.take(plan.row_local, idx, mode="fill", fill_value=num_local)
    return idx, jnp.where(valid.reshape(-1), local, num_local)


def _row_slots(plan: RoundPlan, bucket: int, num_rows: int):
    """Round of each sorted row (-1 if unused) and its slot in that round's `[N * B]` buffer."""
    i = jnp.arange(num_rows, dtype=jnp.int32)
    d = jnp.clip(plan.row_dest, 0, plan.dest_start.shape[0] - 1)
    pos = i - plan.dest_start[d]
    rnd = jnp.where(i < plan.total, pos // bucket, -1)
    return rnd, d * bucket + pos % bucket


def _take(x, idx):
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


def _num_local(experts) -> int:
    return jax.tree.leaves(experts)[0].shape[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _exchange(ffn, bucket, axis, rows, plan, experts):
    """`rows [A, D]` (expert-sorted) -> each row's expert output `[A, D]`, in rounds."""
    return _exchange_fwd(ffn, bucket, axis, rows, plan, experts)[0]


def _exchange_fwd(ffn, bucket, axis, rows, plan, experts):
    a, g = rows.shape[0], _num_local(experts)
    rnd, slot = _row_slots(plan, bucket, a)

    def body(carry):
        r, out = carry
        idx, local = _round_slots(plan, r, bucket, g, a)
        with jax.named_scope("dispatch"):
            recv = col.all_to_all(_take(rows, idx), axis)
            recv_local = col.all_to_all(local, axis)
        with jax.named_scope("experts"):
            y = ffn(recv, recv_local, experts)
        with jax.named_scope("combine"):
            back = col.all_to_all(y, axis)
        return r + 1, jnp.where((rnd == r)[:, None], _take(back, slot), out)

    init = col.vary_like(jnp.zeros_like(rows), col.vma(rows, experts))
    _, out = jax.lax.while_loop(lambda c: c[0] < plan.rounds, body, (jnp.int32(0), init))
    return out, (rows, plan, experts)


def _exchange_bwd(ffn, bucket, axis, res, d_out):
    rows, plan, experts = res
    a, g = rows.shape[0], _num_local(experts)
    rnd, slot = _row_slots(plan, bucket, a)

    def body(carry):
        r, d_rows, d_experts = carry
        idx, local = _round_slots(plan, r, bucket, g, a)
        recv = col.all_to_all(_take(rows, idx), axis)
        recv_local = col.all_to_all(local, axis)
        d_y = col.all_to_all(_take(d_out, idx), axis)
        _, vjp = jax.vjp(lambda x, w: ffn(x, recv_local, w), recv, experts)
        d_recv, d_w = vjp(d_y)
        d_back = col.all_to_all(d_recv, axis)
        d_rows = jnp.where((rnd == r)[:, None], _take(d_back, slot), d_rows)
        return r + 1, d_rows, jax.tree.map(jnp.add, d_experts, d_w)

    init = (jnp.int32(0), jnp.zeros_like(rows), jax.tree.map(jnp.zeros_like, experts))
    _, d_rows, d_experts = jax.lax.while_loop(lambda c: c[0] < plan.rounds, body, init)
    return d_rows, None, d_experts


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def max_pair_count(topk_indices, kept, token_shards: int, n: int, num_experts: int) -> int:
    """Host side (numpy, no tracing): the largest (source device, destination device) count.

    Args:
      topk_indices: `[T, K]` global expert ids (e.g. last step's `aux.topk_indices`).
      kept: `[T, K]` bool (`~aux.dropped_mask`).
      token_shards: devices the tokens were split over (contiguous blocks, `data` major).
      n: `N`, devices on the expert axis.
      num_experts: `E`.

    Returns:
      The count the next step's `bucket` must cover for one round (`choose_bucket`).
    """
    import numpy as np

    idx = np.asarray(topk_indices).reshape(token_shards, -1)
    keep = np.asarray(kept).reshape(token_shards, -1)
    dest = idx // (num_experts // n)
    counts = [np.bincount(d[k], minlength=n) for d, k in zip(dest, keep, strict=True)]
    return int(np.max(counts))
