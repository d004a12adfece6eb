"""Typed records passed between the phases of the layer (pytrees, so they cross `jit`)."""

from __future__ import annotations

import dataclasses

import jax


def _pytree_dataclass(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(cls)


@_pytree_dataclass
class Routing:
    """What the router decided for T tokens.

    Token-choice routers fill `K` slots per token. Expert choice is expressed in the same form with
    `K = E`: slot `e` of token `t` is expert `e`, kept only if expert `e` chose token `t`.
    """

    logits: jax.Array  # [T, E] fp32 router logits
    probs: jax.Array  # [T, E] fp32 per-expert probabilities used by the load-balance loss
    expert_index: jax.Array  # [T, K] int32 chosen experts
    weight: jax.Array  # [T, K] fp32 combine weights
    kept: jax.Array  # [T, K] bool; False = dropped (capacity) or not chosen (expert choice)


@_pytree_dataclass
class GroupedLayout:
    """Where each (token, slot) assignment sits after sorting by expert.

    Rows are sorted by expert; expert e's rows are padded to a multiple of the row alignment of the
    expert implementation. `R` is a static upper bound on the padded row count.
    """

    row_of_assignment: jax.Array  # [T, K] int32 row of each assignment; R (out of range) if dropped
    token_of_row: jax.Array  # [R] int32 source token of each row; T (out of range) for padding
    assignment_of_row: jax.Array  # [R] int32 flat index t*K+k of each row; T*K for padding
    group_sizes: jax.Array  # [E] int32 padded rows per expert (multiples of the alignment)
    group_of_row: jax.Array  # [R] int32 expert of each row (E-1 past the last used row)


@_pytree_dataclass
class MoEAux:
    """Routing statistics and auxiliary losses returned by `moe_apply` (never kept globally)."""

    router_logits: jax.Array  # [T, E] fp32
    topk_indices: jax.Array  # [T, K] int32 (expert choice: [T, E], slot e = expert e)
    topk_weights: jax.Array  # [T, K] fp32 combine weights; 0 where dropped
    dropped_mask: jax.Array  # [T, K] bool, True = assignment dropped (capacity mode)
    expert_counts: jax.Array  # [E] int32 assignments routed to each expert, before any drop
    kept_counts: jax.Array  # [E] int32 assignments each expert computed
    dropped_fraction: jax.Array  # [] fp32 dropped / routed assignments (expert choice: tokens no
    #                              expert took / T)
    load_balance_loss: jax.Array  # [] fp32 Switch/GShard form, 1.0 when perfectly balanced
    z_loss: jax.Array  # [] fp32 mean(logsumexp(logits)^2)
    routed_fraction: jax.Array  # [E] fp32 f_e: fraction of the routed assignments that chose e
    mean_probs: jax.Array  # [E] fp32 P_e: mean router probability of e over the tokens
    #                        (load_balance_loss = E * sum(f * P); equal-sized batches combine
    #                        exactly by averaging f and P)
    sequence_balance_loss: jax.Array  # [] fp32 DeepSeek-V3 sequence-wise form, mean over
    #                                   sequences (1.0 when every sequence is balanced)

    @property
    def num_dropped(self) -> jax.Array:
        """Number of dropped assignments."""
        return self.dropped_mask.sum()
