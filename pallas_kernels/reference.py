"""Pure-jnp grouped matmuls: the test oracle and the fallback on hardware without a kernel.

Both are built on `jax.lax.ragged_dot_general` (correct forward and backward on every backend;
on CPU it lowers to one masked dense matmul with G times the FLOPs, see BENCHMARKS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _dimension_numbers(contract_lhs: int, contract_rhs: int, ragged: int, group_dims):
    return lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((contract_lhs,), (contract_rhs,)), ((), ())),
        lhs_ragged_dimensions=[ragged],
        rhs_group_dimensions=list(group_dims),
    )


def _rows_in_groups(m: int, group_sizes: jax.Array) -> jax.Array:
    """[M] bool: rows before sum(group_sizes)."""
    return jnp.arange(m) < jnp.sum(group_sizes)


def reference_gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    preferred_element_type=None,
) -> jax.Array:
    """Grouped matmul: rows of group g of lhs times rhs[g].

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [G, K, N], or [G, N, K] with transpose_rhs.
      group_sizes: [G] int32, sum(group_sizes) <= M.
      transpose_rhs: rhs is given as [G, N, K].
      preferred_element_type: output dtype; None means lhs.dtype. Accumulation is fp32.

    Returns:
      [M, N]; rows past sum(group_sizes) are zero.

    >>> import jax.numpy as jnp
    >>> out = reference_gmm(jnp.ones((3, 2)), jnp.ones((2, 2, 4)), jnp.array([1, 1], jnp.int32))
    >>> out[:, 0].tolist()
    [2.0, 2.0, 0.0]
    """
    out_dtype = preferred_element_type or lhs.dtype
    dims = _dimension_numbers(1, 2 if transpose_rhs else 1, 0, [0])
    out = lax.ragged_dot_general(
        lhs, rhs, group_sizes.astype(jnp.int32), dims, preferred_element_type=jnp.float32
    )
    # ragged_dot leaves rows past the sum unspecified on some backends: zero them explicitly.
    out = jnp.where(_rows_in_groups(lhs.shape[0], group_sizes)[:, None], out, 0.0)
    return out.astype(out_dtype)


def reference_tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    num_groups: int | None = None,
    *,
    preferred_element_type=None,
) -> jax.Array:
    """Per-group transposed product (the weight gradient of gmm): out[g] = lhs_g^T @ rhs_g.

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [M, N], same row order.
      group_sizes: [G] int32, sum(group_sizes) <= M.
      num_groups: G; must equal group_sizes.shape[0] if given.
      preferred_element_type: output dtype; None means lhs.dtype. Accumulation is fp32.

    Returns:
      [G, K, N]; empty groups are zero, rows past the sum contribute nothing.
    """
    _check_num_groups(num_groups, group_sizes)
    out_dtype = preferred_element_type or lhs.dtype
    valid = _rows_in_groups(lhs.shape[0], group_sizes)[:, None]
    lhs = jnp.where(valid, lhs, 0)
    # Ragged contracting dimension: lhs [M, K] contracted with rhs [M, N] over ragged M.
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out = lax.ragged_dot_general(
        lhs, rhs, group_sizes.astype(jnp.int32), dims, preferred_element_type=jnp.float32
    )
    return out.astype(out_dtype)


def _check_num_groups(num_groups: int | None, group_sizes: jax.Array) -> None:
    if num_groups is not None and num_groups != group_sizes.shape[0]:
        raise ValueError(
            f"num_groups={num_groups} must equal group_sizes.shape[0]={group_sizes.shape[0]}"
        )
