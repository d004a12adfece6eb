"""Phase 1, route: `x [T, D]` -> `Routing` (experts, weights, kept mask) and auxiliary losses.

Every router computes in fp32 (``config.router_dtype``) whatever the activation dtype. The
functions here are pure: parameters and activations in, records out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax._config import MoEConfig
from moejax._types import Routing


def router_logits(router_params: dict, x: jax.Array, config: MoEConfig) -> jax.Array:
    """Router logits in fp32.

    Args:
      router_params: `{"kernel": [D, E], "bias": [E] (optional)}`.
      x: `[T, D]` tokens, any float dtype.
      config: the layer config.

    Returns:
      `[T, E]` logits in `config.router_dtype`.
    """
    dtype = jnp.dtype(config.router_dtype)
    logits = jnp.dot(x.astype(dtype), router_params["kernel"].astype(dtype))
    if config.router_bias:
        logits = logits + router_params["bias"].astype(dtype)
    return logits


def route(
    router_params: dict,
    x: jax.Array,
    config: MoEConfig,
    *,
    num_sequences: int = 1,
    replay: jax.Array | None = None,
) -> Routing:
    """Choose experts and combine weights for every token.

    Args:
      router_params: `router/...` parameters (see `router_logits`).
      x: `[T, D]` tokens; when `num_sequences > 1`, T = num_sequences * S in sequence-major order.
      config: the layer config.
      num_sequences: capacity groups for expert choice (each sequence chooses separately).
      replay: None, or `[T, K]` int expert ids to use instead of the router's own top-k
        (router replay, `replayed`).

    Returns:
      A `Routing` with `K = config.top_k` slots per token (`K = E` for expert choice). All slots
      are kept; capacity dropping is a later phase (`apply_capacity`).
    """
    logits = router_logits(router_params, x, config)
    if replay is not None:
        return replayed(router_params, logits, replay, config)
    kind = config.router
    if kind == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        weight, index = jax.lax.top_k(probs, config.top_k)
        if config.norm_topk_prob:
            weight = weight / weight.sum(-1, keepdims=True)
    elif kind == "sigmoid":
        index, weight, probs = _sigmoid_route(router_params, logits, config)
    elif kind == "topk_softmax":
        top_logits, index = jax.lax.top_k(logits, config.top_k)
        weight = jax.nn.softmax(top_logits, axis=-1)
        probs = jax.nn.softmax(logits, axis=-1)
    elif kind == "expert_choice":
        return _expert_choice(logits, config, num_sequences)
    else:  # unreachable: MoEConfig validates `router`
        raise ValueError(f"unknown router {kind!r}")
    return Routing(
        logits=logits,
        probs=probs,
        expert_index=index.astype(jnp.int32),
        weight=weight * config.routed_scaling_factor,  # x 1.0 (the default) is exact
        kept=jnp.ones(index.shape, bool),
    )


def replayed(
    router_params: dict, logits: jax.Array, index: jax.Array, config: MoEConfig
) -> Routing:
    """Router replay: the given experts, weighted by the current router (so it still learns).

    Each router weighs the given experts as it weighs its own choice: `"softmax"` takes their
    softmax probabilities (renormalised with `norm_topk_prob`), `"sigmoid"` their unbiased scores
    (renormalised with `norm_topk_prob`), `"topk_softmax"` the softmax over their logits; each
    times `routed_scaling_factor`. Replaying the router's own choice gives its routing bit for
    bit.

    Args:
      router_params: `router/...` parameters.
      logits: `[T, E]` router logits.
      index: `[T, K]` int expert ids, `K = config.top_k`, distinct within a token, in `[0, E)`.
        Under `jit` they cannot be checked: a token whose ids are out of range or repeated gets
        NaN weights (so a training step with them is skipped as non-finite, never silently
        routed elsewhere).
      config: the layer config (not `router="expert_choice"`, whose experts choose tokens).

    Returns:
      A `Routing` with `expert_index = index` and all slots kept.
    """
    e = config.num_experts
    if config.router == "expert_choice":
        raise ValueError("router replay: router='expert_choice' has no per-token expert choice")
    index = index.astype(jnp.int32)
    valid = (index >= 0).all(-1) & (index < e).all(-1)
    if index.shape[-1] > 1:
        ordered = jnp.sort(index, axis=-1)
        valid = valid & (ordered[:, 1:] != ordered[:, :-1]).all(-1)
    safe = jnp.clip(index, 0, e - 1)
    if config.router == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        weight = jnp.take_along_axis(probs, safe, axis=-1)
        if config.norm_topk_prob:
            weight = weight / weight.sum(-1, keepdims=True)
    elif config.router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        weight = jnp.take_along_axis(scores, safe, axis=-1)
        if config.norm_topk_prob:
            weight = weight / (weight.sum(-1, keepdims=True) + 1e-20)
        probs = scores / scores.sum(-1, keepdims=True)
    else:  # topk_softmax
        weight = jax.nn.softmax(jnp.take_along_axis(logits, safe, axis=-1), axis=-1)
        probs = jax.nn.softmax(logits, axis=-1)
    weight = jnp.where(valid[:, None], weight * config.routed_scaling_factor, jnp.nan)
    kept = jnp.ones(index.shape, bool)
    return Routing(logits=logits, probs=probs, expert_index=safe, weight=weight, kept=kept)


def check_replay(replay, leading: tuple[int, ...], config: MoEConfig, what: str = "replay") -> None:
    """Raise a ValueError for recorded expert ids of the wrong shape or dtype, or (when concrete)
    out of range or repeated within a token. `leading`: the token axes they must have."""
    want = (*leading, config.top_k)
    if config.router == "expert_choice":
        raise ValueError(f"{what}: router='expert_choice' has no per-token expert choice to replay")
    shape = tuple(getattr(replay, "shape", ()))
    if shape != want:
        raise ValueError(f"{what}.shape={shape}: need {want} (token axes, then top_k)")
    if not jnp.issubdtype(replay.dtype, jnp.integer):
        raise ValueError(f"{what}.dtype={replay.dtype}: need integer expert ids")
    if isinstance(replay, jax.core.Tracer):
        return  # checked on device (`replayed`: NaN weights)
    ids = np.asarray(replay).reshape(-1, config.top_k)
    bad = (ids < 0) | (ids >= config.num_experts)
    if bad.any():
        raise ValueError(
            f"{what}: expert id {int(ids[bad][0])} out of range [0, {config.num_experts})"
        )
    ordered = np.sort(ids, axis=-1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        row = int(np.nonzero((ordered[:, 1:] == ordered[:, :-1]).any(-1))[0][0])
        raise ValueError(f"{what}: token {row} repeats an expert ({ids[row].tolist()})")


def _sigmoid_route(router_params, logits, config):
    """DeepSeek-V3: choose on sigmoid scores + correction bias, weigh by the unbiased scores."""
    t, e = logits.shape
    scores = jax.nn.sigmoid(logits)
    choice = scores
    if config.score_correction_bias:
        choice = scores + router_params["score_correction_bias"].astype(scores.dtype)
    if config.num_groups > 1:
        grouped = choice.reshape(t, config.num_groups, e // config.num_groups)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, groups]
        _, keep_groups = jax.lax.top_k(group_scores, config.topk_groups)
        group_mask = jnp.zeros((t, config.num_groups), bool)
        group_mask = group_mask.at[jnp.arange(t)[:, None], keep_groups].set(True)
        choice = jnp.where(group_mask[:, :, None], grouped, -jnp.inf).reshape(t, e)
    _, index = jax.lax.top_k(choice, config.top_k)
    weight = jnp.take_along_axis(scores, index, axis=-1)
    if config.norm_topk_prob:
        weight = weight / (weight.sum(-1, keepdims=True) + 1e-20)
    probs = scores / scores.sum(-1, keepdims=True)
    return index, weight, probs  # `route` multiplies by routed_scaling_factor


def _expert_choice(logits, config, num_sequences):
    """Each expert takes its top-C tokens (per sequence) by softmax probability."""
    t, e = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    s = t // num_sequences
    c = min(config.capacity(s), s)
    per_seq = probs.reshape(num_sequences, s, e).transpose(0, 2, 1)  # [B, E, S]
    _, chosen = jax.lax.top_k(per_seq, c)  # [B, E, C] token positions within the sequence
    kept = jnp.zeros((num_sequences, e, s), bool)
    b_idx = jnp.arange(num_sequences)[:, None, None]
    e_idx = jnp.arange(e)[None, :, None]
    kept = kept.at[b_idx, e_idx, chosen].set(True).transpose(0, 2, 1).reshape(t, e)
    return Routing(
        logits=logits,
        probs=probs,
        expert_index=jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32), (t, e)),
        weight=jnp.where(kept, probs, 0.0),
        kept=kept,
    )


def apply_capacity(routing: Routing, config: MoEConfig, num_sequences: int = 1) -> Routing:
    """Drop assignments past each expert's capacity, counted per sequence.

    Priority inside a sequence is slot-major, then position: every token's first choice is served
    before any second choice (GShard, Switch), and earlier tokens before later ones.

    Args:
      routing: a token-choice `Routing` over `T = num_sequences * S` tokens.
      config: the layer config (capacity from `capacity_factor` or `expert_capacity`).
      num_sequences: capacity groups.

    Returns:
      `routing` with `kept` set, and zero weight on dropped assignments.
    """
    t, k = routing.expert_index.shape
    e = config.num_experts
    s = t // num_sequences
    cap = config.capacity(s)
    # [B, K, S] expert ids in priority order; position of each assignment within its expert.
    ids = routing.expert_index.reshape(num_sequences, s, k).transpose(0, 2, 1)
    onehot = jax.nn.one_hot(ids.reshape(num_sequences, k * s), e, dtype=jnp.int32)
    position = (jnp.cumsum(onehot, axis=1) - 1) * onehot  # [B, K*S, E]
    position = position.sum(-1).reshape(num_sequences, k, s).transpose(0, 2, 1).reshape(t, k)
    kept = routing.kept & (position < cap)
    return Routing(
        logits=routing.logits,
        probs=routing.probs,
        expert_index=routing.expert_index,
        weight=jnp.where(kept, routing.weight, 0.0),
        kept=kept,
    )


def load_balance_loss(routing: Routing, num_experts: int) -> jax.Array:
    """Switch/GShard load-balancing loss `E * sum_e f_e * P_e` (1.0 at perfect balance).

    `f_e` is the fraction of the T*K routed assignments that chose expert e, `P_e` the mean router
    probability of e, both over all T tokens of the call. (Hugging Face's Mixtral
    `load_balancing_loss_func` sums f over the K slots and so returns K times this value; Switch's
    and flaxformer's average `f * P` per sequence, which equals this for one sequence.)
    """
    counts = expert_counts(routing.expert_index, num_experts)
    f = counts.astype(jnp.float32) / routing.expert_index.size
    p = routing.probs.mean(0)
    return num_experts * jnp.sum(f * p)


def sequence_balance_sum(routing: Routing, num_experts: int, num_sequences: int) -> jax.Array:
    """Sum over sequences of DeepSeek-V3's sequence-wise balance loss (before the mean).

    For each sequence of `S` tokens, `(E / (K S)) * sum_e c_e * P_e`, where `c_e` counts the
    sequence's assignments to expert e and `P_e` is the sequence's mean of the normalised router
    probabilities (`Routing.probs`: for the sigmoid router the scores divided by their sum, as
    DeepSeek-V3's `s'`). 1.0 per sequence at perfect balance. Returned summed over the
    `num_sequences` sequences of `T = num_sequences * S` sequence-major tokens, so shards add.
    """
    t, k = routing.expert_index.shape
    s = t // num_sequences
    onehot = jax.nn.one_hot(routing.expert_index.reshape(num_sequences, s * k), num_experts)
    counts = onehot.sum(1)  # [B, E]
    p = routing.probs.reshape(num_sequences, s, num_experts).mean(1)  # [B, E]
    return jnp.sum(counts * p) * (num_experts / (k * s))


def z_loss(logits: jax.Array) -> jax.Array:
    """Router z-loss `mean(logsumexp(logits)^2)` (ST-MoE)."""
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)


def expert_counts(expert_index: jax.Array, num_experts: int, mask=None) -> jax.Array:
    """`[E]` int32 count of assignments per expert (optionally only where `mask`)."""
    w = None if mask is None else mask.reshape(-1).astype(jnp.int32)
    return jnp.bincount(expert_index.reshape(-1), weights=w, length=num_experts).astype(jnp.int32)


def update_correction_bias(bias: jax.Array, counts: jax.Array, rate: float = 1e-3) -> jax.Array:
    """Aux-loss-free balancing (DeepSeek-V3): nudge each expert's score bias against its load.

    Overloaded experts (count above the mean) lose `rate`, underloaded ones gain it. Applied
    outside the optimizer, once per step, from the observed `expert_counts`.

    Args:
      bias: `[E]` current `router/score_correction_bias`.
      counts: `[E]` observed assignments per expert (summed over layers' batch, any int/float).
      rate: update speed (DeepSeek-V3 uses 1e-3).

    Returns:
      `[E]` the new bias, same dtype as `bias`.

    >>> import jax.numpy as jnp
    >>> update_correction_bias(jnp.zeros(3), jnp.array([5, 1, 3]), rate=0.1)
    Array([-0.1,  0.1,  0. ], dtype=float32)
    """
    counts = counts.astype(jnp.float32)
    return (bias + rate * jnp.sign(counts.mean() - counts)).astype(bias.dtype)
