"""Public grouped-matmul ops: backend dispatch, padding to tiles, and the differentiable op.

Backends (`backend=`): "pallas_tpu" (Mosaic), "pallas_triton" (GPU), "reference" (pure jnp,
`jax.lax.ragged_dot_general`), and "auto": Pallas-TPU on TPU, Pallas-Triton on GPU, reference
elsewhere. On CPU the Pallas backends run only with `interpret=True` (or, for "pallas_tpu",
`interpret=pltpu.InterpretParams()`).

Pallas paths pad M, K, N up to tile multiples with zeros (an extra copy of lhs/rhs when the
shapes are not multiples; zero padding adds nothing to any product) and slice the result back.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import autotune, tpu, triton, vma
from pallas_kernels.config import DEFAULT_CONFIG, Config, effective_tiles, resolve_backend, round_up
from pallas_kernels.reference import _check_num_groups, reference_gmm, reference_tgmm


def _validate(lhs, rhs, group_sizes, *, rhs_ndim: int) -> jax.Array:
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
    if rhs.ndim != rhs_ndim:
        raise ValueError(f"rhs must have {rhs_ndim} dims, got shape {rhs.shape}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be a 1-D integer array, got {group_sizes.shape} {group_sizes.dtype}"
        )
    return group_sizes.astype(jnp.int32)


def _pad(x: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
    """Zero-pads each axis of x up to a multiple of the matching entry (1 = leave alone)."""
    widths = [(0, round_up(d, t) - d) for d, t in zip(x.shape, multiples, strict=True)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def _same_varying_axes(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """Inside shard_map(check_vma=True), cast all operands to vary over the same mesh axes, as
    pallas_call requires (the kernels then declare their output varying over those axes)."""
    axes = vma.varying_axes(*xs)
    return tuple(vma.cast_varying(x, axes) for x in xs)


def _common_dtype(lhs: jax.Array, rhs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Kernels multiply one input dtype (Mosaic rejects mixed dots): promote the other operand.
    Mixed inputs arise in the VJP of `preferred_element_type=float32` with bf16 operands."""
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    return lhs.astype(dtype), rhs.astype(dtype)


def _out_dtype(preferred_element_type, lhs: jax.Array):
    return jnp.dtype(preferred_element_type or lhs.dtype)


def _gmm_config(config: Config | None, backend: str, lhs, num_groups: int, n: int) -> Config:
    """The given config, else an autotuned one (Triton, if cached), else the default."""
    if config is not None:
        return config
    if backend == "pallas_triton":
        key = autotune.cache_key(lhs.shape[0], lhs.shape[1], n, num_groups, lhs.dtype)
        return autotune.cached_config(key) or DEFAULT_CONFIG
    return DEFAULT_CONFIG


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    preferred_element_type=None,
    backend: str = "auto",
    config: Config | None = None,
    interpret: Any = False,
) -> jax.Array:
    """Grouped matmul: rows of group g of lhs times rhs[g]. Not differentiable (see
    `grouped_matmul`).

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [G, K, N], or [G, N, K] with transpose_rhs.
      group_sizes: [G] integer, sum(group_sizes) <= M (not checked: it is traced).
      transpose_rhs: rhs is given as [G, N, K].
      preferred_element_type: output dtype; None means lhs.dtype. Accumulation is fp32.
      backend: "auto", "reference", "pallas_triton" or "pallas_tpu".
      config: tile sizes; None means the default (or the autotuned one, on GPU).
      interpret: run Pallas kernels in interpret mode (needed on CPU).

    Returns:
      [M, N]; rows past sum(group_sizes) are zero.

    >>> import jax.numpy as jnp
    >>> out = gmm(jnp.ones((3, 2)), jnp.ones((2, 2, 4)), jnp.array([2, 0], jnp.int32))
    >>> out[:, 0].tolist()
    [2.0, 2.0, 0.0]
    """
    group_sizes = _validate(lhs, rhs, group_sizes, rhs_ndim=3)
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    m, k, n = lhs.shape[0], lhs.shape[1], rhs.shape[n_axis]
    if rhs.shape[k_axis] != k or rhs.shape[0] != group_sizes.shape[0]:
        raise ValueError(
            f"rhs shape {rhs.shape} (transpose_rhs={transpose_rhs}) does not match lhs "
            f"{lhs.shape} and group_sizes {group_sizes.shape}"
        )
    out_dtype = _out_dtype(preferred_element_type, lhs)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference_gmm(
            lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype
        )
    if 0 in (m, k, n, group_sizes.shape[0]):  # an empty grid: the answer is all zeros
        return jnp.zeros((m, n), out_dtype)
    config = _gmm_config(config, backend, lhs, group_sizes.shape[0], n)
    tm, tk, tn = tiles = effective_tiles(config, m, k, n)
    lhs, rhs, group_sizes = _same_varying_axes(*_common_dtype(lhs, rhs), group_sizes)
    lhs_p = _pad(lhs, (tm, tk))
    rhs_p = _pad(rhs, (1, tn, tk) if transpose_rhs else (1, tk, tn))
    kwargs = dict(tiles=tiles, transpose_rhs=transpose_rhs, out_dtype=out_dtype)
    if backend == "pallas_tpu":
        out = tpu.gmm(lhs_p, rhs_p, group_sizes, interpret=interpret, **kwargs)
    else:
        out = triton.gmm(lhs_p, rhs_p, group_sizes, config=config, interpret=interpret, **kwargs)
    return out[:m, :n]


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    num_groups: int | None = None,
    *,
    preferred_element_type=None,
    backend: str = "auto",
    config: Config | None = None,
    interpret: Any = False,
) -> jax.Array:
    """Per-group transposed product, the weight gradient of gmm: out[g] = lhs_g^T @ rhs_g.

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [M, N], same row order.
      group_sizes: [G] integer, sum(group_sizes) <= M.
      num_groups: G; must equal group_sizes.shape[0] if given.
      preferred_element_type: output dtype; None means lhs.dtype. Accumulation is fp32.
      backend, config, interpret: as for `gmm`.

    Returns:
      [G, K, N]; empty groups give zeros.
    """
    group_sizes = _validate(lhs, rhs, group_sizes, rhs_ndim=2)
    _check_num_groups(num_groups, group_sizes)
    if rhs.shape[0] != lhs.shape[0]:
        raise ValueError(f"lhs {lhs.shape} and rhs {rhs.shape} must have the same M")
    m, k, n = lhs.shape[0], lhs.shape[1], rhs.shape[1]
    out_dtype = _out_dtype(preferred_element_type, lhs)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference_tgmm(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
    if 0 in (m, k, n, group_sizes.shape[0]):
        return jnp.zeros((group_sizes.shape[0], k, n), out_dtype)
    config = config or DEFAULT_CONFIG  # the autotune cache holds gmm tiles only
    tm, tk, tn = tiles = effective_tiles(config, m, k, n)
    lhs, rhs, group_sizes = _same_varying_axes(*_common_dtype(lhs, rhs), group_sizes)
    lhs_p, rhs_p = _pad(lhs, (tm, tk)), _pad(rhs, (tm, tn))
    if backend == "pallas_tpu":
        out = tpu.tgmm(
            lhs_p, rhs_p, group_sizes, tiles=tiles, out_dtype=out_dtype, interpret=interpret
        )
    else:
        out = triton.tgmm(
            lhs_p, rhs_p, group_sizes, tiles=tiles, config=config, out_dtype=out_dtype,
            interpret=interpret,
        )  # fmt: skip
    return out[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _grouped_matmul(lhs, rhs, group_sizes, transpose_rhs, out_dtype, backend, config, interpret):
    return gmm(
        lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype,
        backend=backend, config=config, interpret=interpret,
    )  # fmt: skip


def _fwd(lhs, rhs, group_sizes, transpose_rhs, out_dtype, backend, config, interpret):
    out = _grouped_matmul(
        lhs, rhs, group_sizes, transpose_rhs, out_dtype, backend, config, interpret
    )
    return out, (lhs, rhs, group_sizes)


def _bwd(transpose_rhs, out_dtype, backend, config, interpret, residuals, dout):
    lhs, rhs, group_sizes = residuals
    opts = dict(backend=backend, config=config, interpret=interpret)
    # dlhs[rows of g] = dout[rows of g] @ rhs[g]^T: the same gmm with the other rhs layout.
    dlhs = gmm(
        dout, rhs, group_sizes, transpose_rhs=not transpose_rhs,
        preferred_element_type=lhs.dtype, **opts,
    )  # fmt: skip
    # drhs[g] = lhs_g^T @ dout_g ([G, K, N]); for rhs stored [G, N, K] swap the operands.
    if transpose_rhs:
        drhs = tgmm(dout, lhs, group_sizes, preferred_element_type=rhs.dtype, **opts)
    else:
        drhs = tgmm(lhs, dout, group_sizes, preferred_element_type=rhs.dtype, **opts)
    return dlhs, drhs, None  # group_sizes is integer: no cotangent


_grouped_matmul.defvjp(_fwd, _bwd)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    preferred_element_type=None,
    backend: str = "auto",
    config: Config | None = None,
    interpret: Any = False,
) -> jax.Array:
    """Differentiable `gmm` (custom VJP: dlhs by gmm with the transposed rhs, drhs by tgmm).

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [G, K, N], or [G, N, K] with transpose_rhs.
      group_sizes: [G] integer, sum(group_sizes) <= M; not differentiated.
      transpose_rhs, preferred_element_type, backend, config, interpret: as for `gmm`.

    Returns:
      [M, N]; rows past sum(group_sizes) are zero (and get zero lhs gradient).

    >>> import jax, jax.numpy as jnp
    >>> f = lambda w: grouped_matmul(jnp.ones((3, 2)), w, jnp.array([1, 2], jnp.int32)).sum()
    >>> jax.grad(f)(jnp.ones((2, 2, 1)))[:, 0, 0].tolist()
    [1.0, 2.0]
    """
    group_sizes = _validate(lhs, rhs, group_sizes, rhs_ndim=3)
    out_dtype = _out_dtype(preferred_element_type, lhs)
    return _grouped_matmul(
        lhs, rhs, group_sizes, transpose_rhs, out_dtype, backend, config, interpret
    )
