"""Varying-manual-axes (vma) helpers, so core code runs inside `jax.shard_map(check_vma=True)`.

Inside a `check_vma` body every value is typed with the manual mesh axes it varies over; a loop
carry must keep its type, and a custom VJP's cotangent must vary over the same axes as its primal.
Outside shard_map every set is empty and every helper here is the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def vma(*trees) -> frozenset:
    """Union of the varying-manual-axes sets of every leaf."""
    out: set = set()
    for leaf in jax.tree.leaves(trees):
        aval = jax.typeof(leaf)
        mat = getattr(aval, "manual_axis_type", None)  # jax 0.10: vma lives here
        out |= set(mat.varying if mat is not None else getattr(aval, "vma", ()))
    return frozenset(out)


def vary_like(x, target: frozenset):
    """`x` marked varying over every axis of `target` it is not varying over yet."""
    missing = tuple(sorted(target - vma(x)))
    if not missing:
        return x
    return jax.tree.map(lambda a: jax.lax.pcast(a, missing, to="varying"), x)


def zeros_like_vma(shape, dtype, *operands) -> jax.Array:
    """`jnp.zeros(shape, dtype)` varying over every axis the operands vary over (a loop carry that
    accumulates values computed from the operands must start with their type)."""
    return vary_like(jnp.zeros(shape, dtype), vma(*operands))


def match_vma(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent given the primal's varying axes: `psum` over the axes only the cotangent varies
    over (the transpose of the implicit `pcast` the forward did), `pcast` over those it lacks."""
    extra = tuple(sorted(vma(ct) - vma(primal)))
    if extra:
        ct = jax.lax.psum(ct, extra)
    return vary_like(ct, vma(primal))
