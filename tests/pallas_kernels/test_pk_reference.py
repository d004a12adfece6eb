"""The reference (the oracle for every kernel) against a float64 numpy loop over groups."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _pk_testing import assert_close, numpy_gmm, numpy_tgmm, random_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels as pk


@st.composite
def problems(draw):
    # Few distinct shapes (each compiles once); the routing varies freely.
    m, k, n = draw(st.sampled_from([1, 17, 40])), 7, 5
    g = draw(st.sampled_from([1, 3, 6]))
    used = draw(st.integers(0, m))
    cuts = sorted(draw(st.lists(st.integers(0, used), min_size=g - 1, max_size=g - 1)))
    sizes = np.diff(np.array([0, *cuts, used])).astype(np.int32)
    return m, k, n, g, sizes, draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(problems())
def test_reference_gmm_and_tgmm_match_numpy(problem):
    m, k, n, g, sizes, transpose = problem
    lhs, rhs = random_inputs(m, k, n, g, jnp.float32, transpose_rhs=transpose)
    out = pk.reference_gmm(lhs, rhs, jnp.asarray(sizes), transpose_rhs=transpose)
    assert_close(out, numpy_gmm(lhs, rhs, sizes, transpose_rhs=transpose), jnp.float32)
    dw = pk.reference_tgmm(lhs, out, jnp.asarray(sizes))
    assert_close(dw, numpy_tgmm(lhs, out, sizes), jnp.float32)


def test_reference_vjp_matches_numpy():
    """grouped_matmul's hand-written VJP on the reference backend equals the analytic one."""
    sizes = np.array([3, 0, 9, 4], np.int32)
    lhs, rhs = random_inputs(20, 6, 5, 4, jnp.float32)
    dout = jnp.asarray(np.random.default_rng(2).standard_normal((20, 5)), jnp.float32)
    _, vjp = jax.vjp(lambda x, w: pk.grouped_matmul(x, w, jnp.asarray(sizes)), lhs, rhs)
    dlhs, drhs = vjp(dout)
    want_dlhs = numpy_gmm(dout, rhs, sizes, transpose_rhs=True)
    assert_close(dlhs, want_dlhs, jnp.float32)
    assert not np.asarray(dlhs[16:]).any()
    assert_close(drhs, numpy_tgmm(lhs, dout, sizes), jnp.float32)
