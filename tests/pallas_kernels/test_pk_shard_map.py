"""The kernels inside `jax.shard_map`, as the expert-parallel MoE layer calls them.

With `check_vma=True` the Pallas kernels lower for cuda and tpu (the out_shape carries the
varying axes, see pallas_kernels/vma.py), and run in interpret mode on CPU (jax's interpreter
needs the lowering fix `vma.install_interpret_fix`, which the interpreting code paths call;
importing does not install it). Weights replicated over the
mesh meeting sharded rows get the summed gradient: the VJP's cotangents vary like its primals.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pk_testing import assert_close, numpy_gmm, numpy_tgmm, random_inputs
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels import targets

SHARDS, M, K, N, G = 4, 64, 32, 48, 2
SPECS = (P("x"), P("x"), P("x"))
SMALL_TILES = pk.Config(64, 32, 64)  # interpret mode only: compiled Mosaic needs tk, tn >= 128


def _tiles(backend):
    """Small tiles for one interpreted backend; "pallas" stages the compiled TPU and GPU kernels
    too, where these tiles do not compile: it takes its defaults (clamped to these shapes)."""
    return None if backend == "pallas" else SMALL_TILES


def _layer(backend, interpret=True, config="small"):
    config = _tiles(backend) if config == "small" else config

    def body(x, w, s):
        def op(a, b):
            return pk.grouped_matmul(a, b, s, backend=backend, interpret=interpret, config=config)

        out, vjp = jax.vjp(op, x, w)
        return out, *vjp(out)

    return body


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("backend", ["reference", "pallas_triton", "pallas_tpu", "pallas"])
def test_sharded_forward_and_vjp(backend, check_vma):
    mesh = jax.make_mesh((SHARDS,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    lhs, rhs = random_inputs(SHARDS * M, K, N, SHARDS * G, jnp.float32)
    sizes = np.array([[20, 30], [0, 64], [1, 0], [33, 31]], np.int32).reshape(-1)
    f = jax.shard_map(
        _layer(backend), mesh=mesh, in_specs=SPECS, out_specs=SPECS, check_vma=check_vma
    )
    out, dlhs, drhs = jax.jit(f)(lhs, rhs, jnp.asarray(sizes))
    for shard in range(SHARDS):
        rows, groups = slice(shard * M, (shard + 1) * M), slice(shard * G, (shard + 1) * G)
        want = numpy_gmm(lhs[rows], rhs[groups], sizes[groups])
        assert_close(out[rows], want, jnp.float32)
        assert_close(dlhs[rows], numpy_gmm(want, rhs[groups], sizes[groups], True), jnp.float32)
        assert_close(drhs[groups], numpy_tgmm(lhs[rows], want, sizes[groups]), jnp.float32)


@pytest.mark.parametrize(
    "backend, platform, marker",
    [("pallas_triton", "cuda", "__gpu$xla.gpu.triton"), ("pallas_tpu", "tpu", "tpu_custom_call")],
)
def test_lowers_under_shard_map_with_check_vma(backend, platform, marker):
    mesh = (
        targets.abstract_gpu_mesh((SHARDS,), ("x",))  # the GPU the Triton lowering targets
        if platform == "cuda"
        else jax.sharding.AbstractMesh((SHARDS,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    )
    args = (
        jax.ShapeDtypeStruct((SHARDS * 256, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((SHARDS * G, 128, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((SHARDS * G,), jnp.int32),
    )
    f = jax.shard_map(
        _layer(backend, interpret=False, config=None),
        mesh=mesh,
        in_specs=SPECS,
        out_specs=SPECS,
        check_vma=True,
    )
    with targets.lowering_platform(platform, (SHARDS,), ("x",)):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) == 3


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_replicated_weights_get_the_summed_gradient(backend):
    """rhs replicated (P()) with rows sharded: drhs is the sum over shards, as without a mesh."""
    mesh = jax.make_mesh((SHARDS,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    lhs, rhs = random_inputs(SHARDS * M, K, N, G, jnp.float32, seed=2)
    sizes = np.array([[20, 30], [0, 64], [1, 0], [33, 31]], np.int32)

    def loss(x, w, s):
        def body(x, w, s):
            y = pk.grouped_matmul(x, w, s, backend=backend, config=_tiles(backend))
            return jax.lax.psum(jnp.sum(y * y), "x")

        f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P("x")), out_specs=P())
        return f(x, w, s)

    dlhs, drhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs, jnp.asarray(sizes.reshape(-1)))
    want = np.zeros(rhs.shape)
    for shard in range(SHARDS):
        rows = slice(shard * M, (shard + 1) * M)
        y = numpy_gmm(lhs[rows], rhs, sizes[shard])
        want += 2 * numpy_tgmm(lhs[rows], y, sizes[shard])
        assert_close(dlhs[rows], 2 * numpy_gmm(y, rhs, sizes[shard], True), jnp.float32)
    assert_close(drhs, want, jnp.float32)


_IMPORT_THEN_INSTALL = """
from jax._src.interpreters import mlir
from jax._src.pallas import pallas_call as lib
rule = lambda: getattr(mlir._lowerings[lib.pallas_call_p], "rule", None)
import moejax, moejax.models, moejax.parallel, moejax.training, pallas_kernels
from pallas_kernels import vma
assert rule() is lib._pallas_call_lowering, "importing patched the pallas_call lowering"
assert vma.install_interpret_fix() and rule() is not lib._pallas_call_lowering
patched = rule()
assert vma.install_interpret_fix() and rule() is patched  # idempotent
"""


def test_the_interpret_fix_is_an_explicit_call_not_an_import_side_effect():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_THEN_INSTALL], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
