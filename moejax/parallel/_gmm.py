"""Grouped matmuls usable inside `shard_map(check_vma=True)`.

Copied from `moejax._gmm.blocked_gmm` (same math, same custom VJP) with one change: the loop
accumulators start as zeros marked varying over the operands' manual axes. The core version starts
them invariant, and `check_vma` rejects a `fori_loop` whose carry becomes varying. Once the core
makes that change (see the issue-4 report), `gmm_for` can return the core functions directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax._config import MoEConfig
from moejax._gmm import _DOT_T, _block_groups
from moejax._layer import _gmm_for
from moejax.parallel._collectives import vary_like, vma


def gmm_for(implementation: str, config: MoEConfig):
    """`(gmm, alignment)` as `moejax._layer._gmm_for`, with the vma-safe blocked loop."""
    if implementation == "blocked":
        return functools.partial(blocked_gmm, block=config.block_size), config.block_size
    return _gmm_for(implementation, config)


def _zeros(shape, dtype, *operands):
    return vary_like(jnp.zeros(shape, dtype), vma(*operands))


def _blocked_matmul(lhs, rhs, group_sizes, block, transpose_rhs):
    r, _ = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    groups, used = _block_groups(group_sizes, block, r // block)
    acc_dtype = jnp.promote_types(lhs.dtype, jnp.float32)

    def body(b, out):
        x = jax.lax.dynamic_slice_in_dim(lhs, b * block, block)
        w = rhs[groups[b]]
        if transpose_rhs:
            y = jax.lax.dot_general(x, w, _DOT_T, preferred_element_type=acc_dtype)
        else:
            y = jnp.dot(x, w, preferred_element_type=acc_dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), b * block, 0)

    init = _zeros((r, n), lhs.dtype, lhs, rhs, group_sizes)
    return jax.lax.fori_loop(0, used, body, init)


def _blocked_tgmm(lhs, dout, group_sizes, block):
    r, k = lhs.shape
    n = dout.shape[1]
    e = group_sizes.shape[0]
    groups, used = _block_groups(group_sizes, block, r // block)
    acc_dtype = jnp.promote_types(lhs.dtype, jnp.float32)

    def body(b, acc):
        x = jax.lax.dynamic_slice_in_dim(lhs, b * block, block)
        g = jax.lax.dynamic_slice_in_dim(dout, b * block, block)
        upd = jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype)
        return acc.at[groups[b]].add(upd)

    return jax.lax.fori_loop(0, used, body, _zeros((e, k, n), acc_dtype, lhs, dout, group_sizes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def blocked_gmm(lhs, rhs, group_sizes, block):
    """`moejax._gmm.blocked_gmm`: `lhs [R, K]`, `rhs [E, K, N]`, block-aligned `group_sizes [E]`
    -> `[R, N]`."""
    return _blocked_matmul(lhs, rhs, group_sizes, block, transpose_rhs=False)


def _fwd(lhs, rhs, group_sizes, block):
    return blocked_gmm(lhs, rhs, group_sizes, block), (lhs, rhs, group_sizes)


def _bwd(block, res, dout):
    lhs, rhs, group_sizes = res
    dlhs = _blocked_matmul(dout, rhs, group_sizes, block, transpose_rhs=True)
    drhs = _blocked_tgmm(lhs, dout, group_sizes, block).astype(rhs.dtype)
    # Cotangents carry the primal's varying axes (the transposes of implicit pcasts do the psums).
    return _match(dlhs, lhs), _match(drhs, rhs), None


def _match(ct, primal):
    extra = vma(ct) - vma(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else vary_like(ct, vma(primal))


blocked_gmm.defvjp(_fwd, _bwd)
