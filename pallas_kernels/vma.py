"""Varying-manual-axes (vma) plumbing so the kernels run inside `jax.shard_map(check_vma=True)`.

Under `check_vma=True` a `pallas_call` needs its `out_shape` to say over which mesh axes the
output varies, and its inputs to agree. The output of a grouped matmul varies over every axis
any input varies over; inputs that vary over fewer axes are cast to that set (`lax.pcast`,
a no-op on values). Outside shard_map every set is empty and this does nothing.

jax 0.10 keeps the set in `aval.mat.varying` (`ShapeDtypeStruct(manual_axis_type=...)`); older
releases spelled it `aval.vma` (`ShapeDtypeStruct(vma=...)`). Both are handled; only the first
is tested here. `_install_interpret_fix` (below) makes interpret mode work under `check_vma=True`.
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


def _install_interpret_fix() -> bool:
    """Lets interpret-mode kernels run inside `shard_map(check_vma=True)`.

    jax 0.10's Pallas interpreter (`interpret=True`, and the TPU interpreter) evaluates the
    kernel while lowering, with the shard_map body's varying-axes checks still on but its own
    grid indices typed as not varying, so every interpreted kernel inside a `check_vma=True`
    shard_map fails to lower ("Primitive dynamic_slice requires varying manual axes to match").
    Varying axes are a trace-time type with no meaning in the lowered program, so this wraps the
    `pallas_call` lowering: in interpret mode only, it lowers with the axes dropped from the
    operand types and the check off, as jax already does for the Mosaic GPU lowering (jax PR
    #36180). Compiled (non-interpreted) kernels lower unchanged. Returns False (and changes
    nothing) if this jax lays out those internals differently.
    """
    try:
        from jax._src import config as jax_config
        from jax._src import core
        from jax._src.interpreters import mlir
        from jax._src.pallas import pallas_call as pallas_call_lib

        lowering = pallas_call_lib._pallas_call_lowering
        no_axes = core.ManualAxisType()
        check_vma = jax_config._check_vma
    except (ImportError, AttributeError):
        return False

    def strip(aval):
        if getattr(aval, "manual_axis_type", None) is None:
            return aval
        return aval.update(manual_axis_type=no_axes)

    def lower(ctx, *args, interpret, **params):
        if not interpret:
            return lowering(ctx, *args, interpret=interpret, **params)
        stripped = ctx.replace(
            avals_in=[strip(a) for a in ctx.avals_in],
            avals_out=[strip(a) for a in ctx.avals_out],
        )
        with check_vma(False):
            out = lowering(stripped, *args, interpret=interpret, **params)
        if stripped.tokens_out is not None:  # the TPU interpreter's callbacks carry effects
            ctx.set_tokens_out(stripped.tokens_out)
        return out

    mlir.register_lowering(pallas_call_lib.pallas_call_p, lower)
    return True


INTERPRET_FIX_INSTALLED = _install_interpret_fix()
