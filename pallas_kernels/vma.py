"""Varying-manual-axes (vma) plumbing so the kernels run inside `jax.shard_map(check_vma=True)`.

Under `check_vma=True` a `pallas_call` needs its `out_shape` to say over which mesh axes the
output varies, and its inputs to agree. The output of a grouped matmul varies over every axis
any input varies over; inputs that vary over fewer axes are cast to that set (`lax.pcast`,
a no-op on values). Outside shard_map every set is empty and this does nothing.

jax 0.10 keeps the set in `aval.mat.varying` (`ShapeDtypeStruct(manual_axis_type=...)`); older
releases spelled it `aval.vma` (`ShapeDtypeStruct(vma=...)`). Both are handled; only the first
is tested here.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(*xs: jax.Array) -> frozenset:
    """Union of the mesh axes the arrays vary over (empty outside shard_map)."""
    axes: frozenset = frozenset()
    for x in xs:
        axes |= _own_axes(x)
    return axes


def _own_axes(x: jax.Array) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def cast_varying(x: jax.Array, axes: frozenset) -> jax.Array:
    """x marked as varying over `axes` (a superset of its own)."""
    missing = tuple(sorted(axes - _own_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def out_struct(shape, dtype, like: jax.Array, axes: frozenset) -> jax.ShapeDtypeStruct:
    """`out_shape` for pallas_call: varying over `axes`."""
    mat = getattr(jax.typeof(like), "mat", None)
    if mat is None:  # older jax
        return jax.ShapeDtypeStruct(shape, dtype, vma=axes)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat.update(varying=axes))
