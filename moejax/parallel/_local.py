"""Expert compute on one device, reusing the core phases (permute, grouped FFN, unpermute).

Two entry points, both pure:

- `local_moe`: tokens and their routing in, the weighted sum of the outputs of the experts this
  device holds out (the experts in `[offset, offset + Ev)`; other assignments contribute zero).
- `regrouped_ffn`: received rows with a local expert id per row in, each row's expert output out,
  in the same row order (the receive side of an all-to-all dispatcher).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax._config import MoEConfig
from moejax._experts import grouped_ffn
from moejax._layer import _gmm_for, by_target
from moejax._permute import combine, make_layout, permute
from moejax._types import Routing
from pallas_kernels.vma import cast_varying, varying_axes


def _routing(expert_index, weight, kept) -> Routing:
    # make_layout reads only expert_index and kept; logits/probs are not needed here.
    return Routing(logits=None, probs=None, expert_index=expert_index, weight=weight, kept=kept)


def local_moe(
    x: jax.Array,
    expert_index: jax.Array,
    weight: jax.Array,
    kept: jax.Array,
    experts: dict,
    config: MoEConfig,
    implementation: str,
    *,
    offset=0,
    max_kept: int | None = None,
) -> jax.Array:
    """Weighted output of the `Ev` experts held here, for every token.

    Args:
      x: `[T, D]` tokens.
      expert_index: `[T, K]` global expert ids.
      weight: `[T, K]` combine weights.
      kept: `[T, K]` bool.
      experts: local expert params with leading dim `Ev` (F possibly a slice).
      config: the layer config.
      implementation: `ragged_dot`, `blocked`, `pallas` or `auto` (decided by the compile
        target, `moejax._layer.by_target`).
      offset: global id of local expert 0 (traced or static).
      max_kept: static bound on kept assignments landing here (default `T * K`).

    Returns:
      `[T, D]`: `sum_k weight * ffn_e(x)` over the assignments to local experts.
    """
    run = functools.partial(_local_moe, config=config, max_kept=max_kept)
    return by_target(run, implementation, x, expert_index, weight, kept, experts, offset)


def _local_moe(x, expert_index, weight, kept, experts, offset, implementation, *, config, max_kept):
    ev = jax.tree.leaves(experts)[0].shape[0]
    gmm, alignment = _gmm_for(implementation, config)
    local = expert_index - offset
    mine = kept & (local >= 0) & (local < ev)
    layout = make_layout(
        _routing(jnp.clip(local, 0, ev - 1), weight, mine), ev, alignment, max_kept
    )
    rows = permute(x, layout)
    out = grouped_ffn(rows, layout.group_sizes, layout.group_of_row, experts, config, gmm)
    return combine_varying(out, jnp.where(mine, weight, 0.0), layout)


def regrouped_ffn(
    rows: jax.Array,
    local_expert: jax.Array,
    experts: dict,
    config: MoEConfig,
    implementation: str,
) -> jax.Array:
    """Expert output of every received row, in received order.

    Args:
      rows: `[S, D]` received rows (any order; invalid rows are ignored).
      local_expert: `[S]` int32 local expert of each row; `G` (or more) marks an empty slot.
      experts: local expert params, leading dim `G`.
      config: the layer config.
      implementation: as for `local_moe`.

    Returns:
      `[S, D]` expert outputs; zeros on empty slots.
    """
    run = functools.partial(_regrouped_ffn, config=config)
    return by_target(run, implementation, rows, local_expert, experts)


def _regrouped_ffn(rows, local_expert, experts, implementation, *, config):
    g = jax.tree.leaves(experts)[0].shape[0]
    gmm, alignment = _gmm_for(implementation, config)
    ones = jnp.ones((rows.shape[0], 1), jnp.float32)
    valid = (local_expert < g)[:, None]
    layout = make_layout(_routing(local_expert[:, None], ones, valid), g, alignment)
    grouped = permute(rows, layout)
    out = grouped_ffn(grouped, layout.group_sizes, layout.group_of_row, experts, config, gmm)
    return combine_varying(out, ones, layout)


def combine_varying(rows: jax.Array, weight: jax.Array, layout) -> jax.Array:
    """The core `combine`, with `weight` first marked varying over every axis `rows` varies over.

    The core `combine` VJP returns the weight cotangent with the rows' varying axes, which
    `check_vma` rejects for a less-varying weight (e.g. routing weights, invariant over `model`,
    meeting F-sliced expert outputs). The `pcast` transposes to the `psum` the math needs.
    """
    return combine(rows, cast_varying(weight, varying_axes(rows, weight)), layout)
