"""Shared helpers for the pallas_kernels tests: inputs, a float64 numpy oracle, one tolerance."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation under test: a backend, interpret mode, and tiles."""

    backend: str
    interpret: bool = True
    config: pk.Config = pk.Config(tm=64, tk=128, tn=128)  # large tiles: interpret mode is slow

    def kwargs(self):
        return dict(backend=self.backend, interpret=self.interpret, config=self.config)


IMPLS = [Impl("reference"), Impl("pallas_triton"), Impl("pallas_tpu")]


def tolerance(dtype) -> float:
    """Relative tolerance for comparing two implementations whose outputs are rounded to `dtype`.

    Both sides accumulate in fp32 but in different orders, then round to `dtype`: a result may
    land on either side of a rounding boundary, i.e. differ by one ulp of `dtype` (2 * eps, with
    margin). fp32 outputs also carry fp32 accumulation error, ~sqrt(K) * eps_fp32 relative to
    the largest term for K <= 256 terms of unit size, which 2e-5 covers.
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return 2e-5
    return 2 * float(jnp.finfo(dtype).eps)


def assert_close(actual, expected, dtype=None) -> None:
    """Elementwise |actual - expected| <= tol * max(|expected|, scale), scale = max|expected|."""
    dtype = dtype or actual.dtype
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    tol = tolerance(dtype)
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale)


def random_inputs(m, k, n, g, dtype, *, seed=0, transpose_rhs=False):
    """lhs [M, K], rhs [G, K, N] (or [G, N, K]), both standard normal, cast to dtype."""
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    shape = (g, n, k) if transpose_rhs else (g, k, n)
    rhs = jnp.asarray(rng.standard_normal(shape), dtype)
    return lhs, rhs


def numpy_gmm(lhs, rhs, group_sizes, transpose_rhs=False) -> np.ndarray:
    """float64 loop over groups: the oracle for the reference itself."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    if transpose_rhs:
        rhs = rhs.transpose(0, 2, 1)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        out[start : start + size] = lhs[start : start + size] @ rhs[g]
        start += size
    return out


def numpy_tgmm(lhs, rhs, group_sizes) -> np.ndarray:
    """float64 loop over groups: out[g] = lhs_g^T rhs_g."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    sizes = np.asarray(group_sizes)
    out = np.zeros((len(sizes), lhs.shape[1], rhs.shape[1]))
    start = 0
    for g, size in enumerate(sizes):
        out[g] = lhs[start : start + size].T @ rhs[start : start + size]
        start += size
    return out
