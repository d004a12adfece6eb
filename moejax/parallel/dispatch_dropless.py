"""Dispatcher (b): bounded dropless all-to-all. Never drops; never allocates the worst case.

Every device sorts its `A = T * K` kept assignments by expert (so by destination device) and sends
them in rounds: round `r` carries, to each of the `N` expert-axis devices, the destination's rows
`[r * B, (r + 1) * B)` into an `[N * B, D]` receive buffer (`B` = `bucket`, a static number of
rows per (source, destination) pair; block `s` holds source `s`'s rows). The receiver runs its `G`
experts on the `N * B` rows of the round and a second exchange returns the outputs. The number of
rounds is `max over (source, destination) of ceil(count / B)`, agreed by a `pmax` over the whole
mesh; with a bucket chosen from the previous step's routing (see `choose_bucket`), one round is
the steady state and skewed steps take extra rounds, so even all tokens on one expert are
delivered. Memory per round is `O(N * B * D)` whatever the routing.

**Round 0 is straight-line code; rounds 1.. run in a loop.** A `lax.while_loop` is opaque to
XLA's scheduler: nothing outside it can run inside its all-to-all windows, and it runs its rounds
one after the other (a deviceless 8 x H100 compile of the layer put no GEMM inside any exchange
window, at any chunk count, when every round was in the loop). So round 0, the only round of the
steady state, is ordinary differentiable code (its exchanges, the expert FFN, and their
transposes in the backward), which the scheduler can overlap with other work: another chunk's
expert GEMMs under staged pipelining (`DroplessStages` with `moejax.parallel.pipeline.staged`),
another micro-batch's attention. Only the rows past the first `B` of a pair go through the loop
(`_leftover`), which runs zero iterations in the steady state; each call keeps its own loop.
In the steady state XLA runs nothing of the loops but their entry (on GPU, layout copies of the
expert weights the kernels read) and, in the backward, a weight-sized zero gradient that round
0's is added to. Two ways around those cost more, measured deviceless: the loops inside a
`lax.cond` taken only when rounds remain cost Mixtral's v5p-64 train step 8 GiB of temporaries
(it no longer fit), and threading round 0's weight gradient through the backward loop moved 2
of the 10 delayed attention weight gradients that sit in all-to-all windows out of them.

Reverse-mode differentiation of `while_loop` is unsupported, so the leftover rounds are a
`custom_vjp` whose backward runs the same rounds: it re-sends the round's rows and output
gradients, takes the VJP of the local experts on the receiver, and returns row gradients through
the reverse exchange (recomputing the forward per round: activation memory stays per round too).
Round 0 keeps its FFN activations for autodiff like any layer: one round's worth.

**The sizes are exchanged first.** One tiny all-to-all of `N * (G + 1)` ints per call tells
every receiver how many rows each source sends to each of its local experts (so it can tell the
received rows' local experts itself, in every round) and where the source keeps them (for the
return).

**The exchange** (`Strategy.exchange`): `"padded"` (the default) is the padded `all_to_all`
below on every platform; XLA:GPU's latency-hiding scheduler fills its windows (with another
micro-batch's attention, the experts' weight gradients). `"ragged"` chooses by compile target
as follows; it sends fewer bytes under skew, but with jax 0.10.2 XLA:GPU left its windows empty
in the LM step (deviceless H100 schedule) and libtpu runs it synchronously. **By compile
target** (`jax.lax.platform_dependent`, decided at lowering: a deviceless compile for an H100 or
TPU mesh on a CPU host keeps the accelerator branch):
- GPU, TPU: `jax.lax.ragged_all_to_all` sends exactly `min(count - r * B, B)` rows per pair,
  straight from the sorted rows into block `source * B` of the receive buffer (the offset in the
  receiver's buffer is given by the sender: `source * B`), and returns the outputs straight into
  their sorted positions at the sender: no padding on the wire, no gather. XLA:GPU makes it
  async (`ragged-all-to-all-start`/`-done`); the XLA:TPU of libtpu 0.0.42.1 compiles it
  synchronous, even with `--xla_tpu_enable_async_all_to_all` (which makes the sizes'
  `all-to-all` async).
- CPU (XLA:CPU cannot compile `ragged-all-to-all`): the padded `all_to_all` of the `[N * B, D]`
  buffer, gathered from the sorted rows, and its reverse, scattered back.
Both branches produce the same buffers (empty slots are zeros). Send and return are linear and
each other's transpose, so each is a `custom_vjp` whose backward is the other: autodiff's own
transpose of the `platform_dependent` would stay a `conditional` in XLA:GPU's backward (opaque
to the scheduler, like a loop), and jax's ragged transpose would exchange offsets both sides
already know. The CPU tests run the padded branch, and the ragged one through an emulation of
`ragged_all_to_all` (`tests/parallel/test_dropless_ragged.py`); the deviceless tests compile the
ragged one for H100 and TPU.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax import _wgrad
from moejax._config import MoEConfig
from moejax._permute import make_layout, permute
from moejax._types import Routing
from moejax.parallel import _collectives as col
from moejax.parallel._local import combine_varying, regrouped_ffn
from pallas_kernels.vma import cast_varying, match_varying, varying_axes

# Lowering platforms that compile `ragged-all-to-all` (XLA:CPU does not).
_RAGGED_PLATFORMS = ("cuda", "rocm", "tpu")
EXCHANGES = ("padded", "ragged")


class RoundPlan(NamedTuple):
    """Where the sender's expert-sorted rows go (`A` rows, `N` destinations), and what the
    receiver gets from each of the `N` sources (`G` local experts)."""

    dest_start: jax.Array  # [N] int32 first sorted row for each destination device
    dest_count: jax.Array  # [N] int32 rows for each destination device
    row_dest: jax.Array  # [A] int32 destination of each sorted row
    total: jax.Array  # [] int32 kept rows (rows past it are unused)
    rounds: jax.Array  # [] int32 rounds, the same on every device
    recv_counts: jax.Array  # [N, G] int32 rows each source sends to each local expert
    recv_start: jax.Array  # [N] int32 where each source keeps its rows for this device


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
    exchange: str = "padded",
    side=None,
):
    """Expert outputs of the local tokens through bounded all-to-all rounds.

    Args:
      x: `[T, D]` local tokens.
      routing: their routing (global expert ids; dropless keeps everything).
      experts: this device's `G` experts.
      config: the layer config.
      implementation: as for `moejax.parallel._local.local_moe` ("auto" allowed).
      axes: the mesh axes.
      bucket: `B`, rows per (source, destination) pair per round.
      exchange: `"padded"` (an `all_to_all` of the `[N * B, D]` buffer, every platform) or
        `"ragged"` (`ragged_all_to_all` of exactly the rows when compiled for GPU or TPU,
        padded on CPU); see `Strategy.exchange`.
      side: delayed weight gradients (`moejax._wgrad.Delayed`) to compute inside the window of
        round 0's return exchange's transpose, or None.

    Returns:
      `([T, D]` routed output (a partial sum over `model` when F is sliced), the side's slots
      or None).
    """
    stages = DroplessStages(experts, config, implementation, axes, bucket, exchange)
    sent = stages.dispatch(x, routing)
    return stages.combine(stages.experts(sent), sent, side)


class DroplessStages:
    """The bounded dropless all-to-all as three stages, separable for staged pipelining
    (`moejax.parallel.pipeline.staged`): `dispatch` plans the rounds and sends round 0,
    `experts` runs round 0's rows, `combine` returns them, runs the leftover rounds (none in
    the steady state) and forms the weighted sum per token."""

    def __init__(self, experts, config, implementation, axes, bucket, exchange="padded"):
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange={exchange!r}: must be one of {EXCHANGES}")
        self.experts_params, self.config, self.implementation = experts, config, implementation
        self.axes, self.bucket, self.ragged = axes, bucket, exchange == "ragged"
        self._ffn = functools.partial(_ffn, config=config, implementation=implementation)

    def dispatch(self, x: jax.Array, routing: Routing) -> dict:
        """Sort, plan, exchange the sizes and send round 0. Returns the received rows
        `[N * B, D]`, their local expert ids, and what `combine` needs."""
        e, n, b = self.config.num_experts, self.axes.n, self.bucket
        g = e // n
        with jax.named_scope("dispatch"):
            layout = make_layout(routing, e, 1)  # A rows sorted by expert
            rows = permute(x, layout)  # [A, D]
            plan = _plan(layout, n, g, b, self.axes)
            # The experts' weight gradients inside the window of the send's transpose.
            recv, experts = _send_tied(b, (self.axes.expert, self.ragged), rows, plan, 0,
                                       self.experts_params)  # fmt: skip
        return {
            "recv": recv,
            "experts": experts,
            "local": _recv_local(plan, 0, b, g),
            "rows": rows,
            "plan": plan,
            "layout": layout,
            "weight": routing.weight,
        }

    def experts(self, sent: dict) -> jax.Array:
        """The `G` local experts on round 0's received rows."""
        with jax.named_scope("experts"):
            return self._ffn(sent["recv"], sent["local"], sent["experts"])

    def combine(self, out: jax.Array, sent: dict, side=None):
        """Return round 0's outputs (`side`'s weight gradients inside the window of that
        exchange's transpose, `moejax._wgrad.around`), run the leftover rounds, weighted sum
        per token. Returns `(y, slots)`."""
        axis, b, rows, plan = self.axes.expert, self.bucket, sent["rows"], sent["plan"]
        with jax.named_scope("combine"):
            if side is None:
                first, slots = _return(out, plan, 0, b, axis, rows, self.ragged), None
            else:  # `_wgrad.around`, its lower bound inside the exchange's VJP (_return_held)
                out, slots = _wgrad.collect(out, side.weights, side.templates)
                wire = (axis, self.ragged)
                first, slots = _return_held(b, wire, rows.shape[0], out, plan, 0, slots)
        rest = _leftover(self._ffn, b, (axis, self.ragged), rows, plan, self.experts_params)
        with jax.named_scope("combine"):
            return combine_varying(first + rest, sent["weight"], sent["layout"]), slots


def _ffn(rows, local_expert, experts, *, config, implementation):
    return regrouped_ffn(rows, local_expert, experts, config, implementation)


def _plan(layout, n: int, g: int, bucket: int, axes: col.MeshAxes) -> RoundPlan:
    """The rounds of one call, with the sizes exchanged (one all-to-all of `N * (G + 1)` ints)."""
    counts = layout.group_sizes.astype(jnp.int32)  # [E] rows per expert, E = N * G
    dest_count = counts.reshape(n, g).sum(1)
    dest_start = jnp.cumsum(dest_count) - dest_count
    rounds = jnp.max((dest_count + bucket - 1) // bucket).astype(jnp.int32)
    sizes = jnp.concatenate([counts.reshape(n, g), dest_start[:, None]], axis=1)  # [N, G + 1]
    recv = col.all_to_all(sizes.reshape(-1), axes.expert).reshape(n, g + 1)  # row s: source s
    return RoundPlan(
        dest_start=dest_start,
        dest_count=dest_count,
        row_dest=(layout.group_of_row // g).astype(jnp.int32),
        total=jnp.sum(counts),
        rounds=col.pmax(rounds, axes.all),
        recv_counts=recv[:, :g],
        recv_start=recv[:, g],
    )


def _round_sizes(count, r, bucket: int):
    """Rows of round `r` out of `count` rows of a pair: `clip(count - r * B, 0, B)`."""
    return jnp.clip(count - r * bucket, 0, bucket).astype(jnp.int32)


def _recv_local(plan: RoundPlan, r, bucket: int, num_local: int):
    """Local expert of each of the `N * B` received slots of round `r` (`G`: empty slot)."""
    ends = jnp.cumsum(plan.recv_counts, axis=1)  # [N, G] end of each local expert's run
    pos = r * bucket + jnp.arange(bucket, dtype=jnp.int32)  # [B] position in the source's run
    local = jnp.sum(ends[:, None, :] <= pos[None, :, None], axis=2)  # [N, B] in 0..G
    return local.reshape(-1).astype(jnp.int32)


def _send_slots(plan: RoundPlan, r, bucket: int, num_rows: int):
    """Sorted row feeding each of the `N * B` send slots of round `r` (`num_rows`: empty)."""
    pos = r * bucket + jnp.arange(bucket, dtype=jnp.int32)  # [B]
    valid = pos[None, :] < plan.dest_count[:, None]  # [N, B]
    return jnp.where(valid, plan.dest_start[:, None] + pos[None, :], num_rows).reshape(-1)


def _row_slots(plan: RoundPlan, bucket: int, num_rows: int):
    """Round of each sorted row (-1 if unused) and its slot in that round's `[N * B]` buffer."""
    i = jnp.arange(num_rows, dtype=jnp.int32)
    d = jnp.clip(plan.row_dest, 0, plan.dest_start.shape[0] - 1)
    pos = i - plan.dest_start[d]
    rnd = jnp.where(i < plan.total, pos // bucket, -1)
    return rnd, d * bucket + pos % bucket


def _send(rows, plan: RoundPlan, r, bucket: int, axis, ragged: bool):
    """Round `r` of the sorted rows `[A, D]` -> the receive buffer `[N * B, D]` (block `s`:
    source `s`'s rows, zeros past them). With `ragged`: ragged on GPU/TPU, padded elsewhere."""
    return _send_vjp(bucket, (axis, ragged), rows, plan, jnp.int32(r))


def _return(y, plan: RoundPlan, r, bucket: int, axis, rows, ragged: bool):
    """Round `r`'s outputs `[N * B, D]` back to their senders: `[A, D]`, each of this device's
    round-`r` rows in its sorted position, zeros elsewhere (`rows`: for the shape)."""
    return _return_vjp(bucket, (axis, ragged), rows.shape[0], y, plan, jnp.int32(r))


# `_send` and `_return` are linear and each other's transpose: each one's VJP is the other (see
# the module docstring).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _send_vjp(bucket, wire, rows, plan, r):
    axis, ragged = wire
    kw = dict(bucket=bucket, axis=axis)
    return _by_target(_send_padded, _send_ragged if ragged else None, kw, axis, rows, plan, r)


def _send_fwd(bucket, wire, rows, plan, r):
    return _send_vjp(bucket, wire, rows, plan, r), (plan, r, _witness(rows))


def _send_bwd(bucket, wire, res, ct):
    plan, r, rows = res
    d_rows = _return_vjp(bucket, wire, plan.row_dest.shape[0], ct, plan, r)
    return _as(d_rows, rows), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _return_vjp(bucket, wire, num_rows, y, plan, r):
    axis, ragged = wire
    kw = dict(bucket=bucket, axis=axis, num_rows=num_rows)
    return _by_target(_return_padded, _return_ragged if ragged else None, kw, axis, y, plan, r)


def _return_fwd(bucket, wire, num_rows, y, plan, r):
    return _return_vjp(bucket, wire, num_rows, y, plan, r), (plan, r, _witness(y))


def _return_bwd(bucket, wire, num_rows, res, ct):
    plan, r, y = res
    return _as(_send_vjp(bucket, wire, ct, plan, r), y), None, None


_send_vjp.defvjp(_send_fwd, _send_bwd)
_return_vjp.defvjp(_return_fwd, _return_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _send_tied(bucket, wire, rows, plan, r, experts):
    """`(_send(rows, ...), experts)`: in the backward, the experts' weight gradients pass one
    `optimization_barrier` with the reverse exchange's result, before anything reads it (for
    the padded exchange: before the gather that follows the all-to-all), so the scheduler has
    them to run inside that all-to-all's window (`moejax.parallel._overlap.tie`, which sits
    one step earlier, before the send's gather)."""
    return _send_vjp(bucket, wire, rows, plan, jnp.int32(r)), experts


def _send_tied_fwd(bucket, wire, rows, plan, r, experts):
    return _send_tied(bucket, wire, rows, plan, r, experts), (plan, jnp.int32(r), _witness(rows))


def _send_tied_bwd(bucket, wire, res, cotangents):
    plan, r, rows = res
    ct, d_experts = cotangents
    axis, ragged = wire
    num_rows = plan.row_dest.shape[0]
    if axis is None or any(varying_axes(w) != varying_axes(ct) for w in jax.tree.leaves(d_experts)):
        d_rows = _return_vjp(bucket, wire, num_rows, ct, plan, r)
        return _as(d_rows, rows), None, None, d_experts
    d_rows, d_experts = _by_target_with(
        _return_padded, _return_ragged if ragged else None,
        dict(bucket=bucket, axis=axis, num_rows=num_rows), axis, ct, plan, r, tied=d_experts,
    )  # fmt: skip
    return _as(d_rows, rows), None, None, d_experts


_send_tied.defvjp(_send_tied_fwd, _send_tied_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _return_held(bucket, wire, num_rows, y, plan, r, held):
    """`(_return(y, ...), held)`: in the backward, `held`'s cotangents (delayed weight
    gradients' inputs, `moejax._wgrad`) pass one `optimization_barrier` with the send's buffer
    right before its all-to-all (for the padded exchange: after the gather), so nothing
    computed from them starts before the all-to-all can (`_wgrad.hold`, one step later)."""
    return _return_vjp(bucket, wire, num_rows, y, plan, jnp.int32(r)), held


def _return_held_fwd(bucket, wire, num_rows, y, plan, r, held):
    out = _return_held(bucket, wire, num_rows, y, plan, r, held)
    return out, (plan, jnp.int32(r), _witness(y))


def _return_held_bwd(bucket, wire, num_rows, res, cotangents):
    plan, r, y = res
    ct, d_held = cotangents
    axis, ragged = wire
    if axis is None or varying_axes(d_held) != varying_axes(ct):
        return _as(_send_vjp(bucket, wire, ct, plan, r), y), None, None, d_held
    d_y, d_held = _by_target_with(
        _send_padded, _send_ragged if ragged else None, dict(bucket=bucket, axis=axis),
        axis, ct, plan, r, held=d_held,
    )  # fmt: skip
    return _as(d_y, y), None, None, d_held


_return_held.defvjp(_return_held_fwd, _return_held_bwd)


def _by_target_with(padded, ragged, kw, axis, x, plan, r, **extra):
    """`_by_target` of exchanges that also return an extra value (`tied` or `held`, passed
    through their barrier): `(result typed as there, the extra value)`."""
    target = varying_axes(x, plan) | {axis}

    def run(fn):
        def call(x, plan, r):
            out, other = fn(x, plan, r, **kw, **extra)
            return cast_varying(out, target), other

        return call

    if ragged is None:
        return run(padded)(x, plan, r)
    per_platform = dict.fromkeys(_RAGGED_PLATFORMS, run(ragged))
    return jax.lax.platform_dependent(x, plan, r, **per_platform, default=run(padded))


def _witness(x):
    """A scalar with `x`'s dtype and varying axes (a residual that keeps only `x`'s type)."""
    return cast_varying(jnp.zeros((), x.dtype), varying_axes(x))


def _as(ct, witness):
    """`ct` typed like the primal `witness` stands for (dtype, varying axes)."""
    return match_varying(ct.astype(witness.dtype), witness)


def _by_target(padded, ragged, kw, axis, x, plan, r):
    """`ragged` when compiled for GPU or TPU, `padded` elsewhere (decided at lowering), typed
    alike: both vary over the inputs' axes and the expert axis. `ragged=None`: `padded`."""
    if axis is None:  # one device on the expert axis: nothing to exchange
        return padded(x, plan, r, **kw)
    if ragged is None:
        return cast_varying(padded(x, plan, r, **kw), varying_axes(x, plan) | {axis})
    target = varying_axes(x, plan) | {axis}

    def run(fn):
        return lambda *a: cast_varying(fn(*a, **kw), target)

    ragged = run(ragged)
    return jax.lax.platform_dependent(
        x, plan, r, **dict.fromkeys(_RAGGED_PLATFORMS, ragged), default=run(padded)
    )


def _send_padded(rows, plan, r, *, bucket, axis, held=None):
    """(With `held`: `(buffer, held)`, the two through one barrier right before the
    all-to-all.)"""
    buffer = _take(rows, _send_slots(plan, r, bucket, rows.shape[0]))
    if held is None:
        return col.all_to_all(buffer, axis)
    buffer, held = jax.lax.optimization_barrier((buffer, held))
    return col.all_to_all(buffer, axis), held


def _send_ragged(rows, plan, r, *, bucket, axis, held=None):
    """(With `held`: `(buffer, held)`, the two through one barrier right before the
    exchange.)"""
    if held is None:
        return _send_ragged_rows(rows, plan, r, bucket=bucket, axis=axis)
    rows, held = jax.lax.optimization_barrier((rows, held))
    return _send_ragged_rows(rows, plan, r, bucket=bucket, axis=axis), held


def _send_ragged_rows(rows, plan, r, *, bucket, axis):
    n = plan.dest_count.shape[0]
    sizes = _round_sizes(plan.dest_count, r, bucket)  # to each destination
    starts = jnp.where(sizes > 0, plan.dest_start + r * bucket, 0)
    at = jnp.full((n,), jax.lax.axis_index(axis) * bucket, jnp.int32)  # block `me` there
    recv_sizes = _round_sizes(plan.recv_counts.sum(1), r, bucket)  # from each source
    out = cast_varying(jnp.zeros((n * bucket, rows.shape[1]), rows.dtype), varying_axes(rows))
    return jax.lax.ragged_all_to_all(rows, out, starts, sizes, at, recv_sizes, axis_name=axis)


def _return_padded(y, plan, r, *, bucket, axis, num_rows, tied=None):
    """(With `tied`: `(rows, tied)`, the two through one barrier right after the all-to-all.)"""
    rnd, slot = _row_slots(plan, bucket, num_rows)
    back = col.all_to_all(y, axis)
    if tied is not None:
        back, tied = jax.lax.optimization_barrier((back, tied))
    out = jnp.where((rnd == r)[:, None], _take(back, slot), 0)
    return out if tied is None else (out, tied)


def _return_ragged(y, plan, r, *, bucket, axis, num_rows, tied=None):
    """(With `tied`: `(rows, tied)`, the two through one barrier right after the exchange.)"""
    out = _return_ragged_rows(y, plan, r, bucket=bucket, axis=axis, num_rows=num_rows)
    return out if tied is None else jax.lax.optimization_barrier((out, tied))


def _return_ragged_rows(y, plan, r, *, bucket, axis, num_rows):
    n = plan.dest_count.shape[0]
    sizes = _round_sizes(plan.recv_counts.sum(1), r, bucket)  # back to each source
    starts = jnp.arange(n, dtype=jnp.int32) * bucket  # source s's block
    at = jnp.where(sizes > 0, plan.recv_start + r * bucket, 0)  # its sorted position there
    recv_sizes = _round_sizes(plan.dest_count, r, bucket)  # from each destination
    out = cast_varying(jnp.zeros((num_rows, y.shape[1]), y.dtype), varying_axes(y))
    return jax.lax.ragged_all_to_all(y, out, starts, sizes, at, recv_sizes, axis_name=axis)


def _take(x, idx):
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _leftover(ffn, bucket, wire, rows, plan, experts):
    """`rows [A, D]` (expert-sorted) -> the expert output of each row past round 0 (zeros on
    round 0's rows and unused rows), `[A, D]`, in rounds `1 .. plan.rounds - 1`."""
    return _leftover_fwd(ffn, bucket, wire, rows, plan, experts)[0]


def _leftover_fwd(ffn, bucket, wire, rows, plan, experts):
    g, (axis, ragged) = _num_local(experts), wire

    def body(carry):
        r, out = carry
        with jax.named_scope("dispatch"):
            recv = _send(rows, plan, r, bucket, axis, ragged)
        with jax.named_scope("experts"):
            y = ffn(recv, _recv_local(plan, r, bucket, g), experts)
        with jax.named_scope("combine"):
            return r + 1, out + _return(y, plan, r, bucket, axis, rows, ragged)

    init = cast_varying(jnp.zeros_like(rows), varying_axes(rows, experts))
    _, out = jax.lax.while_loop(lambda c: c[0] < plan.rounds, body, (jnp.int32(1), init))
    return out, (rows, plan, experts)


def _leftover_bwd(ffn, bucket, wire, res, d_out):
    rows, plan, experts = res
    g, (axis, ragged) = _num_local(experts), wire

    def body(carry):
        r, d_rows, d_experts = carry
        recv = _send(rows, plan, r, bucket, axis, ragged)
        d_y = _send(d_out, plan, r, bucket, axis, ragged)
        local = _recv_local(plan, r, bucket, g)
        _, vjp = jax.vjp(lambda x, w: ffn(x, local, w), recv, experts)
        d_recv, d_w = vjp(d_y)
        d_rows = d_rows + _return(d_recv, plan, r, bucket, axis, rows, ragged)
        return r + 1, d_rows, jax.tree.map(jnp.add, d_experts, d_w)

    init = (jnp.int32(1), jnp.zeros_like(rows), jax.tree.map(jnp.zeros_like, experts))
    _, d_rows, d_experts = jax.lax.while_loop(lambda c: c[0] < plan.rounds, body, init)
    return d_rows, None, d_experts


_leftover.defvjp(_leftover_fwd, _leftover_bwd)


def _num_local(experts) -> int:
    return jax.tree.leaves(experts)[0].shape[0]


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
