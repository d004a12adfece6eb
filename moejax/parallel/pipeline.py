"""Adaptive pipelining: run dispatch, experts and combine on `n` token chunks (n in 1, 2, 4, 8).

Each chunk is independent (its own exchange, expert compute and combine), so XLA's async
collectives can overlap chunk `i + 1`'s all-to-all with chunk `i`'s expert matmuls. On XLA:CPU
collectives are synchronous: CPU runs prove numerics only.

Two schedules:
- `pipelined`: each chunk is one opaque function. XLA's DotMerger re-merges the chunks' expert
  matmuls (they share weights; docs/design.md), undoing the split, and `stagger=True` here
  (chunk i+1's input paired with chunk i's output in an optimization barrier) keeps them apart
  but fences whole chunks on each other, i.e. serializes them.
- `staged`: the stages (dispatch, experts, combine) are separate, and chunk i+1's received rows
  are paired with chunk i's expert output in an optimization barrier (MaxText's batch-split
  schedule): the matmuls stay apart and chunk i+1's exchange is free to run during chunk i's
  experts. Used for the dispatchers that expose stages: the capacity all-to-all
  (`CapacityStages`) and the bounded dropless one (`DroplessStages`: its round 0, the steady
  state's only round; leftover rounds of skewed steps run in the chunk's `combine`, in a loop).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def chunk_slices(tokens: int, chunks: int) -> list[slice]:
    """`chunks` equal consecutive slices of `tokens` (ValueError unless divisible)."""
    if tokens % chunks:
        raise ValueError(f"Strategy.chunks={chunks}: must divide the local token count {tokens}")
    size = tokens // chunks
    return [slice(i * size, (i + 1) * size) for i in range(chunks)]


def pipelined(
    fn: Callable, x: jax.Array, routing, chunks: int, *, stagger: bool = False, side=None
):
    """`concat_i fn(x[i], routing[i])` over `chunks` token chunks.

    Args:
      fn: `(x [Tc, D], routing over Tc tokens, side) -> ([Tc, D], slots)`.
      x: `[T, D]`.
      routing: a pytree of arrays with leading dim T.
      chunks: pipeline degree `n`.
      stagger: pair each chunk's input with the previous chunk's output in an optimization
        barrier (keeps chunks apart from DotMerger; see module docstring).
      side: delayed weight gradients (`moejax._wgrad.Delayed`) or None, given to the last
        chunk (the first in the backward).

    Returns:
      `([T, D], the last chunk's slots)`.
    """
    if chunks == 1:
        return fn(x, routing, side)
    outs, slices = [], chunk_slices(x.shape[0], chunks)
    for i, sl in enumerate(slices):
        xc, rc = x[sl], jax.tree.map(lambda a, sl=sl: a[sl], routing)
        if stagger and outs:
            xc, outs[-1] = jax.lax.optimization_barrier((xc, outs[-1]))
        with jax.named_scope(f"chunk{i}"):
            y, slots = fn(xc, rc, side if i + 1 == chunks else None)
            outs.append(y)
    return jnp.concatenate(outs, axis=0), slots


def staged(stages, x: jax.Array, routing, chunks: int, *, side=None):
    """Staggered pipeline over `chunks` token chunks of an object with `dispatch(x, routing)`,
    `experts(sent)` and `combine(out, sent, side)` stages (see module docstring); `side` as for
    `pipelined`.

    Schedule (data dependencies only; XLA orders the rest): dispatch 0; then for each i:
    dispatch i+1, experts i, barrier(received i+1, output i), combine i.

    Returns:
      `([T, D], the last chunk's slots)`.
    """
    slices = chunk_slices(x.shape[0], chunks)
    part = lambda sl: (x[sl], jax.tree.map(lambda a: a[sl], routing))  # noqa: E731
    sent = [stages.dispatch(*part(slices[0]))] + [None] * (chunks - 1)
    outs = []
    for i in range(chunks):
        with jax.named_scope(f"chunk{i}"):
            if i + 1 < chunks:
                sent[i + 1] = stages.dispatch(*part(slices[i + 1]))
            out = stages.experts(sent[i])
            if i + 1 < chunks:
                sent[i + 1], out = jax.lax.optimization_barrier((sent[i + 1], out))
            y, slots = stages.combine(out, sent[i], side if i + 1 == chunks else None)
            outs.append(y)
    return jnp.concatenate(outs, axis=0), slots
