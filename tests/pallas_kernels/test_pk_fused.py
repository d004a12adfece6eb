"""gather_grouped_matmul (row gather + routing-weight epilogue) against an unfused composition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pk_testing import IMPLS, assert_close, numpy_gmm, random_inputs

import pallas_kernels as pk
from pallas_kernels import targets

T, TOP_K, K, N, G = 50, 2, 96, 128, 8  # M = T * TOP_K = 100 rows, not a tile multiple


def _routing(seed=0, used=None):
    """(row_index [M], row_weight [M], group_sizes [G]) of a random top-2 routing, sorted."""
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.choice(G, TOP_K, replace=False) for _ in range(T)]).reshape(-1)
    order = np.argsort(experts, kind="stable")
    row_index = (order // TOP_K).astype(np.int32)
    sizes = np.bincount(experts, minlength=G).astype(np.int32)
    if used is not None:  # drop the tail rows from the groups (they become padding rows)
        keep = np.minimum(np.cumsum(sizes), used)
        sizes = np.diff(np.concatenate([[0], keep])).astype(np.int32)
    weight = rng.uniform(0.1, 1.0, T * TOP_K).astype(np.float32)
    return jnp.asarray(row_index), jnp.asarray(weight), jnp.asarray(sizes)


def _unfused(x, w, sizes, index, weight):
    """The same function by autodiff through take + reference grouped_matmul + multiply."""
    y = pk.grouped_matmul(jnp.take(x, index, axis=0), w, sizes, backend="reference")
    return y * weight[:, None]


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.backend)
@pytest.mark.parametrize("used", [None, 70])
def test_forward_and_vjp_match_unfused(impl, used):
    x, w = random_inputs(T, K, N, G, jnp.float32)
    index, weight, sizes = _routing(used=used)

    def fused(x, w, weight):
        return pk.gather_grouped_matmul(x, w, sizes, index, weight, **impl.kwargs())

    dout = jnp.asarray(np.random.default_rng(1).standard_normal((T * TOP_K, N)), jnp.float32)
    out, vjp = jax.vjp(jax.jit(fused), x, w, weight)
    want, vjp_want = jax.vjp(lambda a, b, c: _unfused(a, b, sizes, index, c), x, w, weight)
    want_np = numpy_gmm(np.asarray(x)[np.asarray(index)], w, sizes) * np.asarray(weight)[:, None]
    assert_close(out, want_np, jnp.float32)
    for got, expected in zip(vjp(dout), vjp_want(dout), strict=True):
        assert_close(got, expected, jnp.float32)


def test_without_weight_and_bf16():
    x, w = random_inputs(T, K, N, G, jnp.bfloat16)
    index, _, sizes = _routing(seed=3)
    kw = IMPLS[1].kwargs()  # pallas_triton: the fused kernel
    out = pk.gather_grouped_matmul(x, w, sizes, index, **kw)
    want = pk.gmm(jnp.take(x, index, axis=0), w, sizes, **kw)
    assert out.dtype == jnp.bfloat16
    assert_close(out, want, jnp.bfloat16)


def test_fused_triton_kernel_lowers_for_cuda():
    args = (
        jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((G, 256, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((G,), jnp.int32),
        jax.ShapeDtypeStruct((1024,), jnp.int32),
        jax.ShapeDtypeStruct((1024,), jnp.float32),
    )

    def f(x, w, sizes, index, weight):
        def op(a, b, c):
            return pk.gather_grouped_matmul(a, b, sizes, index, c, backend="pallas_triton")

        out, vjp = jax.vjp(op, x, w, weight)
        return out, *vjp(out)

    with targets.lowering_platform("cuda"):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # forward (fused), dx gmm, tgmm, recomputed unweighted forward (fused)
    assert text.count("__gpu$xla.gpu.triton") == 4
