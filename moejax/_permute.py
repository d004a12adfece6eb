"""Phases 2 and 4, permute and unpermute: move token rows into expert-sorted order and back.

Every move is a gather, forward and backward: `permute` gathers token rows into expert order and
its VJP gathers the row gradients back per assignment; `combine` gathers expert outputs per
assignment and its VJP gathers output gradients per row. (Scatters are several times slower than
gathers on XLA:CPU; MegaBlocks pairs padded_gather with padded_scatter the same way.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax._types import GroupedLayout, Routing


def max_rows(num_assignments: int, num_experts: int, alignment: int) -> int:
    """Static bound `R` on padded rows: each expert adds at most `alignment - 1` rows of padding."""
    bound = num_assignments + num_experts * (alignment - 1)
    return -(-bound // alignment) * alignment


def make_layout(
    routing: Routing, num_experts: int, alignment: int, max_kept: int | None = None
) -> GroupedLayout:
    """Sort the kept (token, slot) assignments by expert and pad each expert to `alignment` rows.

    Steps (A = T*K assignments, R = `max_rows(max_kept, E, alignment)`):
      1. Dropped assignments get the sentinel expert E, so a stable sort puts them last.
      2. `counts[e]` kept assignments per expert; `padded[e]` = counts rounded up to `alignment`.
      3. Sorted assignment i of expert e lands on row `pad_start[e] + (i - start[e])`.
    Invariants: rows of expert e are contiguous, in token order (stable sort), and start at a
    multiple of `alignment`; padding rows have token T (out of range, gathers give zero); every kept
    assignment has exactly one row; `sum(group_sizes) <= R`.

    Args:
      routing: routing with `expert_index`, `kept` of shape `[T, K]`.
      num_experts: `E`.
      alignment: row alignment of the expert implementation (1 = no padding).
      max_kept: static bound on kept assignments (default T*K).

    Returns:
      A `GroupedLayout`.
    """
    t, k = routing.expert_index.shape
    a = t * k
    r = max_rows(min(a, max_kept or a), num_experts, alignment)
    expert = jnp.where(routing.kept, routing.expert_index, num_experts).reshape(a)
    order = jnp.argsort(expert, stable=True).astype(jnp.int32)
    sorted_expert = expert[order]
    counts = jnp.bincount(expert, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    padded = (counts + alignment - 1) // alignment * alignment
    start = jnp.cumsum(counts) - counts
    pad_start = jnp.cumsum(padded) - padded
    valid = sorted_expert < num_experts
    e_safe = jnp.minimum(sorted_expert, num_experts - 1)
    row = jnp.where(valid, pad_start[e_safe] + jnp.arange(a) - start[e_safe], r).astype(jnp.int32)
    row_of_assignment = jnp.zeros(a, jnp.int32).at[order].set(row, unique_indices=True)
    token_of_row = jnp.full(r, t, jnp.int32).at[row].set(order // k, mode="drop")
    assignment_of_row = jnp.full(r, a, jnp.int32).at[row].set(order, mode="drop")
    group_of_row = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(r), side="right")
    return GroupedLayout(
        row_of_assignment=row_of_assignment.reshape(t, k),
        token_of_row=token_of_row,
        assignment_of_row=assignment_of_row,
        group_sizes=padded,
        group_of_row=jnp.minimum(group_of_row, num_experts - 1).astype(jnp.int32),
    )


def _take_rows(x, index):
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def permute(x: jax.Array, layout: GroupedLayout) -> jax.Array:
    """`x [T, D]` -> `rows [R, D]`: row r holds token `token_of_row[r]` (zeros for padding)."""
    return _take_rows(x, layout.token_of_row)


def _permute_fwd(x, layout):
    return permute(x, layout), (layout, x.shape[0])


def _permute_bwd(res, d_rows):
    layout, _ = res
    dx = _take_rows(d_rows, layout.row_of_assignment).sum(1)  # [T, K, D] -> [T, D]
    return dx, None


permute.defvjp(_permute_fwd, _permute_bwd)


@jax.custom_vjp
def combine(rows: jax.Array, weight: jax.Array, layout: GroupedLayout) -> jax.Array:
    """`rows [R, D]`, `weight [T, K]` -> `y [T, D] = sum_k weight[t, k] * rows[row(t, k)]`.

    Dropped assignments (row R, out of range) contribute zero. The weights are cast to the rows'
    dtype first, as Mixtral and DeepSeek cast routing weights to the hidden dtype.
    """
    gathered = _take_rows(rows, layout.row_of_assignment)  # [T, K, D]
    return jnp.einsum("tkd,tk->td", gathered, weight.astype(rows.dtype))


def _combine_fwd(rows, weight, layout):
    return combine(rows, weight, layout), (rows, weight, layout)


def _combine_bwd(res, dy):
    rows, weight, layout = res
    t, k = weight.shape
    w_rows = _take_rows(weight.astype(rows.dtype).reshape(t * k), layout.assignment_of_row)
    d_rows = _take_rows(dy, layout.token_of_row) * w_rows[:, None]
    gathered = _take_rows(rows, layout.row_of_assignment)
    d_weight = jnp.einsum("tkd,td->tk", gathered, dy).astype(weight.dtype)
    return d_rows, d_weight, None


combine.defvjp(_combine_fwd, _combine_bwd)
