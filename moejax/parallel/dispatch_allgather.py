"""Dispatcher (c): all-gather tokens over the expert axis, compute local experts, reduce-scatter.

Every expert-axis device gathers the `N * T` tokens of its expert-axis group with their routing,
runs the experts it holds on the assignments routed to them (dropless: a static `R` of
`N * T * K` rows bounds the permuted buffer, but the blocked implementation's loop only runs the
used blocks), and a reduce-scatter sums the partial outputs and hands each device its own tokens.
No data-dependent buffer sizes at all; traffic `2 (N - 1) T D` per device per call.

The same function serves the tensor-parallel mode (`moejax.parallel.modes`), where the experts
held are all `E` experts on a slice of `F`.
"""

from __future__ import annotations

import jax

from moejax._config import MoEConfig
from moejax._types import Routing
from moejax.parallel import _collectives as col
from moejax.parallel._local import local_moe


def allgather_reduce_scatter(
    x: jax.Array,
    routing: Routing,
    experts: dict,
    config: MoEConfig,
    implementation: str,
    axes: col.MeshAxes,
    max_kept: int | None = None,
) -> jax.Array:
    """Routed output of the local tokens via all-gather + reduce-scatter over the expert axis.

    Args:
      x: `[T, D]` local tokens.
      routing: their routing, global expert ids.
      experts: the experts held here: `G` whole experts (expert mode, local experts
        `[i * G, (i + 1) * G)`), or all `E` experts on a slice of F (tensor mode).
      config: the layer config.
      implementation: as for `moejax.parallel._local.local_moe` ("auto" allowed).
      axes: the mesh axes.
      max_kept: static bound on kept assignments landing here (capacity mode), or None.

    Returns:
      `[T, D]` routed output (a partial sum over `model` when F is sliced over it).
    """
    ev = jax.tree.leaves(experts)[0].shape[0]
    offset = 0 if ev == config.num_experts else col.axis_index(axes.expert) * ev
    with jax.named_scope("dispatch"):
        xg = col.all_gather(x, axes.expert)
        idx, w, kept = (
            col.all_gather(a, axes.expert)
            for a in (routing.expert_index, routing.weight, routing.kept)
        )
    with jax.named_scope("experts"):
        y = local_moe(
            xg, idx, w, kept, experts, config, implementation, offset=offset, max_kept=max_kept
        )
    with jax.named_scope("combine"):
        return col.psum_scatter(y, axes.expert)
