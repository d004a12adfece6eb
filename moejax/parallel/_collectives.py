"""Collectives over mesh axes that may be absent (an absent axis has size 1: identity).

Used inside `jax.shard_map(..., check_vma=True)` bodies. `MeshAxes` names the axes the body may
use; every helper is the identity for `None` / empty axes, so one body serves every mesh.
The varying-axes helpers are `pallas_kernels.vma`'s.
"""

from __future__ import annotations

import dataclasses

import jax

from moejax.parallel import mesh as mesh_lib
from pallas_kernels.vma import cast_varying


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Which of the conventional axes a mesh has, and their sizes."""

    token: tuple[str, ...]  # axes the tokens are split over ("data", "fsdp", "expert" present)
    expert: str | None  # the expert axis, N devices
    model: str | None  # the model (F) axis, M devices
    all: tuple[str, ...]  # every axis of the mesh
    n: int  # N, devices on the expert axis
    m: int  # M, devices on the model axis
    token_shards: int  # devices the tokens are split over (data x fsdp x expert)

    @classmethod
    def of(cls, mesh) -> MeshAxes:
        names = mesh.axis_names
        return cls(
            token=mesh_lib.token_axes(mesh),
            expert=mesh_lib.EXPERT if mesh_lib.EXPERT in names else None,
            model=mesh_lib.MODEL if mesh_lib.MODEL in names else None,
            all=tuple(names),
            n=mesh_lib.axis_size(mesh, mesh_lib.EXPERT),
            m=mesh_lib.axis_size(mesh, mesh_lib.MODEL),
            token_shards=mesh_lib.token_shards(mesh),
        )


def all_to_all(x: jax.Array, axis: str | None) -> jax.Array:
    """Tiled all-to-all on dim 0: block `i` of `[N * B, ...]` goes to device `i`; the result's
    block `s` came from device `s`."""
    if axis is None:
        return x
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def all_gather(x: jax.Array, axis: str | None, dim: int = 0) -> jax.Array:
    """Tiled all-gather along `dim` (device order)."""
    if axis is None:
        return x
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


def psum(x, axes: tuple[str, ...] | str | None):
    """`psum` over the given axes (identity when none); see `_reduce` for values that do not
    vary over all of them."""
    return _reduce(jax.lax.psum, x, axes)


def pmax(x, axes: tuple[str, ...] | str | None):
    """`pmax` over the given axes (identity when none); see `_reduce`."""
    return _reduce(jax.lax.pmax, x, axes)


def _reduce(collective, x, axes):
    """`collective(x, axes)` with `x` first marked varying over every reduced axis.

    A value may vary over only some of the axes reduced (the dropless round count varies over
    `data` and `expert`, not `model`). jax up to 0.11.0 cast such a value to varying inside
    `pmax`/`pmin`/`psum` itself; from 0.11.1 those raise instead ("can only accept axis_name
    which corresponds to one of varying ... state of the input"). The cast is a no-op on values,
    so reducing over an axis the value is invariant on keeps its meaning: the max of equal
    copies, or the sum of `size` equal copies.
    """
    axes = _tuple(axes)
    if not axes:
        return x
    return collective(cast_varying(x, frozenset(axes)), axes)


def psum_scatter(x: jax.Array, axis: str | None) -> jax.Array:
    """Reduce-scatter on dim 0 (tiled): device `i` keeps block `i` of the sum."""
    if axis is None:
        return x
    return jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)


def axis_index(axis: str | None) -> jax.Array | int:
    """This device's index along `axis` (0 when absent)."""
    return 0 if axis is None else jax.lax.axis_index(axis)


def _tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)
