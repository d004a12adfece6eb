"""MoE fusion for the first expert matmul: gather token rows by index inside the kernel and
scale each output row by its routing weight in the epilogue.

    out[r] = row_weight[r] * (x[row_index[r]] @ rhs[group of r])

Fused on Pallas-Triton only (the gather is a vector-indexed load, see triton.gmm). The other
backends compute the same function unfused (`jnp.take`, gmm, multiply); Mosaic TPU has no
in-kernel row gather here (it would need one DMA per row).

Backward (custom VJP): d rhs by tgmm on the gathered rows, d x by gmm with the transposed rhs
then a scatter-add to the token rows (XLA), d row_weight = sum_n(dout * unweighted out), which
recomputes the unweighted forward (one extra gmm rather than keeping an [M, N] residual).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import triton
from pallas_kernels.ops import (
    Configs,
    _common_dtype,
    _pad,
    _validate,
    gmm,
    hashable_configs,
    on_target,
    same_varying_axes,
    tgmm,
    tiled,
)


def _forward(x, rhs, group_sizes, row_index, row_weight, out_dtype, backend, config, interpret):
    """[M, N] = row_weight * gmm(x[row_index], rhs); fused on Triton, composed elsewhere."""
    m, k, n, g = row_index.shape[0], x.shape[1], rhs.shape[2], rhs.shape[0]
    configs = dict(config) if isinstance(config, tuple) else config

    def make(concrete, interp):
        def composed(x, rhs, group_sizes, row_index, row_weight):
            y = gmm(
                jnp.take(x, row_index, axis=0), rhs, group_sizes,
                preferred_element_type=jnp.float32, backend=concrete, config=configs,
                interpret=interp,
            )  # fmt: skip
            return (y if row_weight is None else y * row_weight[:, None]).astype(out_dtype)

        def fused(x, rhs, group_sizes, row_index, row_weight):
            cfg, tiles = tiled(
                configs, "gather_gmm", concrete, interp, x.dtype, out_dtype, m, k, n, g
            )
            tm, tk, tn = tiles
            # Pad the index/weight vectors (not x: its rows are gathered) to whole m-tiles;
            # padded rows read token 0 and belong to no group, so they produce zeros.
            weight = None if row_weight is None else _pad(row_weight.astype(jnp.float32), (tm,))
            out = triton.gmm(
                _pad(x, (1, tk)), _pad(rhs, (1, tk, tn)), group_sizes, tiles=tiles, config=cfg,
                transpose_rhs=False, out_dtype=out_dtype, interpret=interp,
                row_index=_pad(row_index, (tm,)), row_weight=weight,
            )  # fmt: skip
            return out[:m, :n]

        return fused if concrete == "pallas_triton" else composed

    if 0 in (m, k, n, g):
        return jnp.zeros((m, n), out_dtype)
    return on_target(backend, interpret, make, x, rhs, group_sizes, row_index, row_weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _op(x, rhs, group_sizes, row_index, row_weight, out_dtype, backend, config, interpret):
    return _forward(
        x, rhs, group_sizes, row_index, row_weight, out_dtype, backend, config, interpret
    )


def _fwd(x, rhs, group_sizes, row_index, row_weight, out_dtype, backend, config, interpret):
    out = _op(x, rhs, group_sizes, row_index, row_weight, out_dtype, backend, config, interpret)
    return out, (x, rhs, group_sizes, row_index, row_weight)


def _bwd(out_dtype, backend, config, interpret, residuals, dout):
    x, rhs, group_sizes, row_index, row_weight = residuals
    opts = dict(backend=backend, config=dict(config) if isinstance(config, tuple) else config,
                interpret=interpret)  # fmt: skip
    dout = dout.astype(jnp.float32)
    dy = dout if row_weight is None else dout * row_weight[:, None]
    dy = dy.astype(x.dtype)
    d_rows = gmm(
        dy, rhs, group_sizes, transpose_rhs=True, preferred_element_type=jnp.float32, **opts
    )
    dx = jnp.zeros(x.shape, jnp.float32).at[row_index].add(d_rows).astype(x.dtype)
    x_rows = jnp.take(x, row_index, axis=0)
    drhs = tgmm(x_rows, dy, group_sizes, preferred_element_type=rhs.dtype, **opts)
    dweight = None
    if row_weight is not None:
        y = _forward(x, rhs, group_sizes, row_index, None, jnp.float32, backend, config, interpret)
        dweight = jnp.sum(dout * y, axis=1).astype(row_weight.dtype)
    return dx, drhs, None, None, dweight


_op.defvjp(_fwd, _bwd)


def gather_grouped_matmul(
    x: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    row_index: jax.Array,
    row_weight: jax.Array | None = None,
    *,
    preferred_element_type=None,
    backend: str = "auto",
    config: Configs = None,
    interpret: Any = False,
) -> jax.Array:
    """Differentiable gather + grouped matmul + row scaling (the MoE dispatch fused into gmm).

    Args:
      x: [T, K] token rows, unpermuted.
      rhs: [G, K, N].
      group_sizes: [G] integer, sum(group_sizes) <= M; not differentiated.
      row_index: [M] integer in [0, T): row r of the grouped lhs is x[row_index[r]] (a token
        may appear several times, e.g. once per top-k choice); not differentiated.
      row_weight: optional [M] float routing weights, multiplied into output row r.
      preferred_element_type, backend, config, interpret: as for `gmm`.

    Returns:
      [M, N]: row_weight[:, None] * gmm(x[row_index], rhs, group_sizes); rows past
      sum(group_sizes) are zero.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(6.0).reshape(3, 2)
    >>> out = gather_grouped_matmul(x, jnp.ones((1, 2, 1)), jnp.array([2], jnp.int32),
    ...                             jnp.array([2, 0], jnp.int32), jnp.array([1.0, 0.5]))
    >>> out[:, 0].tolist()
    [9.0, 0.5]
    """
    group_sizes = _validate(x, rhs, group_sizes, rhs_ndim=3)
    if row_index.ndim != 1 or not jnp.issubdtype(row_index.dtype, jnp.integer):
        raise ValueError(f"row_index must be [M] integer, got {row_index.shape} {row_index.dtype}")
    if row_weight is not None and row_weight.shape != row_index.shape:
        raise ValueError(f"row_weight shape {row_weight.shape} must equal {row_index.shape}")
    if rhs.shape[1] != x.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
        raise ValueError(
            f"rhs {rhs.shape} does not match x {x.shape}, group_sizes {group_sizes.shape}"
        )
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    row_index = jnp.clip(row_index.astype(jnp.int32), 0, max(x.shape[0] - 1, 0))
    x, rhs = _common_dtype(x, rhs)
    extras = (row_index,) if row_weight is None else (row_index, row_weight)
    x, rhs, group_sizes, *extras = same_varying_axes(x, rhs, group_sizes, *extras)
    row_index, row_weight = extras[0], (extras[1] if row_weight is not None else None)
    config = hashable_configs(config)
    return _op(x, rhs, group_sizes, row_index, row_weight, out_dtype, backend, config, interpret)
