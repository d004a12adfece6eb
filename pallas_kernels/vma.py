"""Varying-manual-axes (vma) helpers: code that runs inside `jax.shard_map(check_vma=True)`.

Inside a `check_vma` body every value is typed with the manual mesh axes it varies over
(`aval.mat.varying`): a `pallas_call` needs its `out_shape` to say over which axes the output
varies and its inputs to agree, a loop carry must keep its type, and a custom VJP's cotangent
must vary over the same axes as its primal. Values that vary over fewer axes are cast to the
needed set (`lax.pcast`, a no-op on values). Outside shard_map every set is empty and every
helper here is the identity. Used by this package's kernels and by moejax's core and parallel
code (the one home of these helpers).

`install_interpret_fix` lets interpret-mode Pallas kernels lower under `check_vma=True`; it is
an explicit call, made by the code paths that run a kernel in interpret mode
(`pallas_kernels.ops`, `moejax.models`' attention), not a side effect of importing this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def varying_axes(*trees) -> frozenset:
    """Union of the mesh axes the leaves of `trees` vary over (empty outside shard_map)."""
    axes: frozenset = frozenset()
    for leaf in jax.tree.leaves(trees):
        mat = getattr(jax.typeof(leaf), "mat", None)  # None: an aval with no mesh axes type
        if mat is not None:
            axes |= frozenset(mat.varying)
    return axes


def cast_varying(tree, axes: frozenset):
    """`tree` with every leaf marked as varying over `axes` too (its own axes are kept)."""

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def zeros_varying(shape, dtype, *operands) -> jax.Array:
    """`jnp.zeros(shape, dtype)` varying over every axis the operands vary over (a loop carry
    that accumulates values computed from the operands must start with their type)."""
    return cast_varying(jnp.zeros(shape, dtype), varying_axes(*operands))


def match_varying(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent given the primal's varying axes: `psum` over the axes only the cotangent
    varies over (the transpose of the implicit `pcast` the forward did), `pcast` over those it
    lacks."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    if extra:
        ct = lax.psum(ct, extra)
    return cast_varying(ct, varying_axes(primal))


def out_struct(shape, dtype, like: jax.Array, axes: frozenset) -> jax.ShapeDtypeStruct:
    """`out_shape` for pallas_call: varying over `axes` (typed like `like` otherwise)."""
    mat = jax.typeof(like).mat
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat.update(varying=axes))


_INTERPRET_FIX: list[bool] = []  # the result of the one install, once made


def install_interpret_fix() -> bool:
    """Lets interpret-mode kernels run inside `shard_map(check_vma=True)`; idempotent.

    jax's Pallas interpreter (`interpret=True`, and the TPU interpreter) evaluates the kernel
    while lowering, with the shard_map body's varying-axes checks still on but its own grid
    indices typed as not varying, so every interpreted kernel inside a `check_vma=True`
    shard_map fails to lower ("Primitive dynamic_slice requires varying manual axes to match").
    Varying axes are a trace-time type with no meaning in the lowered program, so this wraps the
    `pallas_call` lowering (for the whole process, from the first call on): in interpret mode
    only, it lowers with the axes dropped from the operand types and the check off, as jax
    already does for the Mosaic GPU lowering (jax PR #36180). Compiled (non-interpreted)
    kernels lower unchanged.

    Returns:
      Whether the fix is in place: False (and nothing changed) if this jax lays out those
      internals differently.
    """
    if not _INTERPRET_FIX:
        _INTERPRET_FIX.append(_install())
    return _INTERPRET_FIX[0]


def _install() -> bool:
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
