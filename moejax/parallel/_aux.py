"""`MoEAux` of a sharded call: the single-device statistics over all tokens of the mesh.

Per-token fields stay sharded like the tokens; counts are `psum`med over the token axes, and the
losses are formed from global sums (the load-balance loss is a product of two global means, so it
cannot be averaged from per-device losses).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax import _routing
from moejax._config import MoEConfig
from moejax._types import MoEAux, Routing
from moejax.parallel import _collectives as col


def sharded_aux(
    routing: Routing, config: MoEConfig, axes: col.MeshAxes, num_sequences: int | None = None
) -> MoEAux:
    """Aux of the whole mesh's tokens from this device's `routing` (`[T, K]` local fields;
    `num_sequences` whole sequences on this device, as many on every token shard; None: x had
    no sequence axis, so all the mesh's tokens are one sequence)."""
    e = config.num_experts
    t, k = routing.expert_index.shape
    tg = t * axes.token_shards  # global tokens
    expert_choice = config.router == "expert_choice"
    dropped = ~routing.kept
    routed = col.psum(_routing.expert_counts(routing.expert_index, e), axes.token)
    kept_counts = col.psum(
        _routing.expert_counts(routing.expert_index, e, routing.kept), axes.token
    )
    if expert_choice:
        unserved = col.psum(jnp.sum(~routing.kept.any(-1)), axes.token)
        dropped_fraction = unserved / tg
    else:
        dropped_fraction = col.psum(jnp.sum(dropped), axes.token) / (tg * k)
    f = routed.astype(jnp.float32) / (tg * k)
    p = col.psum(routing.probs.sum(0), axes.token) / tg
    if num_sequences is None:  # no sequence axis: all tokens are one sequence, as on one device
        seq_loss = e * jnp.sum(f * p)
    else:
        seq_sum = _routing.sequence_balance_sum(routing, e, num_sequences)
        seq_loss = col.psum(seq_sum, axes.token) / (num_sequences * axes.token_shards)
    lse2 = col.psum(jnp.sum(jax.nn.logsumexp(routing.logits, axis=-1) ** 2), axes.token)
    return MoEAux(
        router_logits=routing.logits,
        topk_indices=routing.expert_index,
        topk_weights=routing.weight,
        dropped_mask=jnp.zeros_like(dropped) if expert_choice else dropped,
        expert_counts=kept_counts if expert_choice else routed,
        kept_counts=kept_counts,
        dropped_fraction=jnp.asarray(dropped_fraction, jnp.float32),
        load_balance_loss=e * jnp.sum(f * p),
        z_loss=lse2 / tg,
        routed_fraction=f,
        mean_probs=p.astype(jnp.float32),
        sequence_balance_loss=seq_loss,
    )
