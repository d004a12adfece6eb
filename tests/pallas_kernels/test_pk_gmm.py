"""Forward and VJP of every backend against the reference, on the named small shapes.

One shared base (`impl` fixture): the reference (checked against numpy in test_pk_reference.py),
Pallas-Triton and Pallas-TPU, both in interpret mode on CPU. Shapes are small with large tiles
because interpret-mode cost grows with the tile count.
"""

from __future__ import annotations

import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pk_testing import IMPLS, Impl, assert_close, numpy_gmm, numpy_tgmm, random_inputs
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels.shapes import SHAPES


@pytest.fixture(params=IMPLS, ids=lambda i: i.backend)
def impl(request):
    return request.param


SMALL = ["balanced", "all_in_one", "one_per_group", "with_empty", "partial_rows", "zipf_small"]


@functools.cache
def _jitted_forward_and_vjp(impl, transpose_rhs):
    # Cached so every routing of one (M, K, N, G, dtype) reuses one compiled interpret kernel.
    def f(lhs, rhs, sizes):
        def op(x, w):
            return pk.grouped_matmul(x, w, sizes, transpose_rhs=transpose_rhs, **impl.kwargs())

        out, vjp = jax.vjp(op, lhs, rhs)
        dout = jax.random.normal(jax.random.key(1), out.shape, out.dtype)
        return (out, *vjp(dout))

    return jax.jit(f)


def _forward_and_vjp(impl, lhs, rhs, sizes, transpose_rhs):
    """(out, dlhs, drhs) from `grouped_matmul` under jit, for a fixed random cotangent."""
    return _jitted_forward_and_vjp(impl, transpose_rhs)(lhs, rhs, sizes)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", SMALL)
def test_forward_and_vjp_match_reference(impl, name, dtype):
    spec = SHAPES[name]
    lhs, rhs = random_inputs(spec.m, spec.k, spec.n, spec.g, dtype)
    sizes = jnp.asarray(spec.group_sizes())
    got = _forward_and_vjp(impl, lhs, rhs, sizes, transpose_rhs=False)
    want = _forward_and_vjp(Impl("reference"), lhs, rhs, sizes, transpose_rhs=False)
    for a, b, what in zip(got, want, ("out", "dlhs", "drhs"), strict=True):
        assert a.dtype == b.dtype == dtype, what
        assert_close(a, b, dtype)
    used = int(sizes.sum())
    # Rows past sum(group_sizes): zero output and zero gradient, exactly.
    assert not np.asarray(got[0][used:], np.float32).any()
    assert not np.asarray(got[1][used:], np.float32).any()


@st.composite
def _routings(draw, m=200, g=8):
    """[G] int32 sizes with sum <= M: random cut points, often repeated (empty groups)."""
    used = draw(st.integers(0, m))
    cuts = sorted(draw(st.lists(st.integers(0, used), min_size=g - 1, max_size=g - 1)))
    return np.diff(np.array([0, *cuts, used])).astype(np.int32)


@pytest.mark.parametrize("impl_", IMPLS[1:], ids=lambda i: i.backend)
def test_random_routings_match_reference(impl_):
    """Property: any routing of the shared (M, K, N, G) gives the reference's forward and VJP."""
    spec = SHAPES["balanced"]
    lhs, rhs = random_inputs(spec.m, spec.k, spec.n, spec.g, jnp.float32, seed=5)

    @hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
    @hypothesis.given(_routings(spec.m, spec.g))
    def check(sizes):
        sizes = jnp.asarray(sizes)
        got = _forward_and_vjp(impl_, lhs, rhs, sizes, transpose_rhs=False)
        want = _forward_and_vjp(Impl("reference"), lhs, rhs, sizes, transpose_rhs=False)
        for a, b in zip(got, want, strict=True):
            assert_close(a, b, jnp.float32)

    check()


@pytest.mark.parametrize("name", ["with_empty", "partial_rows"])
def test_transpose_rhs_matches_numpy(impl, name):
    spec = SHAPES[name]
    lhs, rhs = random_inputs(spec.m, spec.k, spec.n, spec.g, jnp.float32, transpose_rhs=True)
    sizes = jnp.asarray(spec.group_sizes())
    out, dlhs, drhs = _forward_and_vjp(impl, lhs, rhs, sizes, transpose_rhs=True)
    assert drhs.shape == rhs.shape
    assert_close(out, numpy_gmm(lhs, rhs, sizes, transpose_rhs=True), jnp.float32)
    # Cross-check the transposed VJP against the untransposed one on the same weights.
    _, dlhs_n, drhs_n = _forward_and_vjp(impl, lhs, rhs.transpose(0, 2, 1), sizes, False)
    assert_close(dlhs, dlhs_n, jnp.float32)
    assert_close(drhs, drhs_n.transpose(0, 2, 1), jnp.float32)


def test_tgmm_matches_numpy_with_empty_groups(impl):
    # Empty groups at the start, middle and end; rows past the sum hold garbage (inf).
    sizes = jnp.asarray([0, 70, 0, 0, 61, 0], jnp.int32)
    lhs, _ = random_inputs(150, 96, 1, 1, jnp.float32, seed=3)
    rhs, _ = random_inputs(150, 80, 1, 1, jnp.float32, seed=4)
    lhs = lhs.at[131:].set(jnp.inf)
    out = jax.jit(lambda x, y, s: pk.tgmm(x, y, s, num_groups=6, **impl.kwargs()))(lhs, rhs, sizes)
    want = numpy_tgmm(lhs[:131], rhs[:131], sizes)
    assert out.shape == (6, 96, 80)
    assert not np.asarray(out[jnp.asarray([0, 2, 3, 5])]).any()
    assert_close(out, want, jnp.float32)


def test_all_groups_empty(impl):
    lhs, rhs = random_inputs(70, 32, 48, 3, jnp.float32)
    sizes = jnp.zeros((3,), jnp.int32)
    out, dlhs, drhs = _forward_and_vjp(impl, lhs, rhs, sizes, transpose_rhs=False)
    assert not np.asarray(out).any() and not np.asarray(dlhs).any()
    assert not np.asarray(drhs).any()


@pytest.mark.parametrize("m, k, n, g", [(0, 8, 8, 2), (8, 0, 8, 2), (8, 8, 0, 2), (8, 8, 8, 0)])
def test_degenerate_shapes_give_zeros(impl, m, k, n, g):
    lhs, rhs = random_inputs(m, k, n, g, jnp.float32)
    sizes = jnp.asarray([min(m, 3)] + [0] * (g - 1), jnp.int32)[:g]
    out, dlhs, drhs = _forward_and_vjp(impl, lhs, rhs, sizes, transpose_rhs=False)
    assert out.shape == (m, n) and dlhs.shape == (m, k) and drhs.shape == (g, k, n)
    assert not np.asarray(out).any() and not np.asarray(dlhs).any()
    assert not np.asarray(drhs).any()


def test_preferred_element_type(impl):
    lhs, rhs = random_inputs(64, 32, 32, 2, jnp.bfloat16)
    sizes = jnp.asarray([30, 34], jnp.int32)
    out = pk.gmm(lhs, rhs, sizes, preferred_element_type=jnp.float32, **impl.kwargs())
    assert out.dtype == jnp.float32
    assert_close(out, numpy_gmm(lhs, rhs, sizes), jnp.float32)


def test_tpu_kernel_under_tpu_interpret_semantics():
    """One tiny case under `pltpu.InterpretParams()` (TPU memory/DMA semantics; ~100x slower)."""
    from jax.experimental.pallas import tpu as pltpu

    lhs, rhs = random_inputs(24, 16, 16, 3, jnp.float32)
    sizes = jnp.asarray([5, 0, 14], jnp.int32)
    kw = dict(backend="pallas_tpu", interpret=pltpu.InterpretParams(), config=pk.Config(16, 16, 16))
    out = pk.gmm(lhs, rhs, sizes, **kw)
    assert_close(out, numpy_gmm(lhs, rhs, sizes), jnp.float32)
    drhs = pk.tgmm(lhs, out, sizes, **kw)
    assert_close(drhs, numpy_tgmm(lhs, out, sizes), jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("name", SMALL)
def test_triton_compiled_on_gpu(name):
    """The compiled (not interpreted) Triton kernels on a real GPU, bf16, forward and VJP."""
    spec = SHAPES[name]
    lhs, rhs = random_inputs(spec.m, spec.k, spec.n, spec.g, jnp.bfloat16)
    sizes = jnp.asarray(spec.group_sizes())
    got = _forward_and_vjp(Impl("pallas_triton", interpret=False), lhs, rhs, sizes, False)
    want = _forward_and_vjp(Impl("reference"), lhs, rhs, sizes, False)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, jnp.bfloat16)
