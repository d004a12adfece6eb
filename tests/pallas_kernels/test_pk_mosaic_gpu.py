"""The Mosaic GPU (Hopper) kernels, forward and VJP, in the Mosaic GPU interpreter on CPU.

The interpreter simulates each CTA's three warpgroups, their barriers, the TMA copies and wgmma
(jax 0.10's reads transposed operands through `mgpu_compat`'s fix). A forward and VJP costs
5-25 s at these sizes, so the default run keeps one case per path (realigned rows, aligned
groups, shard_map, races) and the rest are `slow`. Every kernel call is checked to be the Mosaic
GPU kernel (`introspect`), against the jnp reference (`jax.lax.ragged_dot_general`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pk_testing import assert_close, numpy_gmm, numpy_tgmm, random_inputs
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels import introspect, metadata, mgpu_compat, targets

SMALL = pk.Config(tm=64, tk=64, tn=128, num_stages=2, raster=2)
MOSAIC = dict(backend="pallas_mosaic_gpu", interpret=True, config=SMALL)


def _fwd_vjp(kw, transpose_rhs, out_dtype, alignment):
    def f(lhs, rhs, sizes):
        def op(x, w):
            return pk.grouped_matmul(
                x, w, sizes, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype,
                group_alignment=alignment, **kw,
            )  # fmt: skip

        out, vjp = jax.vjp(op, lhs, rhs)
        dout = jax.random.normal(jax.random.key(1), out.shape, out.dtype)
        return (out, *vjp(dout))

    return f


@functools.cache
def _jitted(backend, transpose_rhs, out_dtype, alignment):
    kw = MOSAIC if backend == "mosaic" else dict(backend="reference")
    return jax.jit(_fwd_vjp(kw, transpose_rhs, out_dtype, alignment))


def _check(m, k, n, sizes, dtype, *, alignment=1, transpose_rhs=False, out_dtype=None, seed=0):
    """Forward and VJP of the Mosaic GPU kernels against the reference; rows past the groups
    hold inf and must come out zero (they belong to no group)."""
    g = len(sizes)
    lhs, rhs = random_inputs(m, k, n, g, dtype, seed=seed, transpose_rhs=transpose_rhs)
    sizes = jnp.asarray(sizes, jnp.int32)
    used = int(sizes.sum())
    lhs = lhs.at[used:].set(jnp.inf)
    args = (lhs, rhs, sizes)
    calls = introspect.traced_kernel_calls(
        _fwd_vjp(MOSAIC, transpose_rhs, out_dtype, alignment), *args, platform="cpu"
    )
    names = ("gmm_t", "gmm", "tgmm") if transpose_rhs else ("gmm", "gmm_t", "tgmm")
    assert calls == [introspect.KernelCall(name, "interpret") for name in names]
    got = _jitted("mosaic", transpose_rhs, out_dtype, alignment)(*args)
    want = _jitted("reference", transpose_rhs, out_dtype, alignment)(*args)
    for a, b, what in zip(got, want, ("out", "dlhs", "drhs"), strict=True):
        assert a.dtype == b.dtype, what
        assert np.isfinite(np.asarray(a, np.float32)).all(), what
        assert_close(a, b, a.dtype)
    assert not np.asarray(got[0][used:], np.float32).any()
    assert not np.asarray(got[1][used:], np.float32).any()


CASES = [
    # (M, K, N, group sizes, group_alignment)
    pytest.param(128, 64, 128, [50, 0, 40], 1, id="G3-realigned-empty"),
    pytest.param(
        256,
        64,
        128,
        [0, 64, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0, 0, 64, 0],
        64,
        id="G16-aligned-empty",
    ),  # fmt: skip
    pytest.param(192, 64, 128, [192], 1, id="G1-all-rows", marks=pytest.mark.slow),
    pytest.param(
        320,
        96,
        80,
        [3, 0, 61, 0, 0, 70, 1, 0, 0, 90, 0, 0, 0, 0, 25, 0],
        1,
        id="G16-realigned-padded-dims",
        marks=pytest.mark.slow,
    ),  # fmt: skip
    pytest.param(512, 64, 128, [0, 0, 0, 0], 1, id="G4-all-empty", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("m, k, n, sizes, alignment", CASES)
def test_forward_and_vjp_match_reference(m, k, n, sizes, alignment):
    _check(m, k, n, sizes, jnp.bfloat16, alignment=alignment)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_transpose_rhs_and_fp32_output(dtype):
    """rhs stored [G, N, K]: the forward is the transposed-rhs kernel, dlhs the plain one."""
    _check(192, 64, 128, [70, 0, 100], dtype, transpose_rhs=True, out_dtype=jnp.float32)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_stream_pipeline_matches_reference(transpose_rhs):
    """`Config(pipeline="stream")`: one shared-memory ring for all of a CTA's tiles. With 2
    slots and 1-4 K blocks a tile (tgmm: one per 64-row tile of a group, groups of 0-192 rows),
    each of the interpreter's 2 CTAs refills every slot several times across tiles; forward and
    both gradients against the reference, rows past the groups zero."""
    config = dataclasses.replace(SMALL, pipeline="stream")
    kw = dict(backend="pallas_mosaic_gpu", interpret=True, config=config)
    lhs, rhs = random_inputs(512, 256, 256, 4, jnp.bfloat16, seed=3, transpose_rhs=transpose_rhs)
    sizes = jnp.asarray([192, 0, 64, 128], jnp.int32)
    f = _fwd_vjp(kw, transpose_rhs, None, 64)
    calls = introspect.traced_kernel_calls(f, lhs, rhs, sizes, platform="cpu")
    names = ("gmm_t", "gmm", "tgmm") if transpose_rhs else ("gmm", "gmm_t", "tgmm")
    assert calls == [introspect.KernelCall(name, "interpret") for name in names]
    got = jax.jit(f)(lhs, rhs, sizes)
    want = jax.jit(_fwd_vjp(dict(backend="reference"), transpose_rhs, None, 64))(lhs, rhs, sizes)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, jnp.bfloat16)
    assert not np.asarray(got[0][384:], np.float32).any()


def test_aligned_groups_run_without_moving_rows():
    """With group_alignment a multiple of the row tile the kernels take lhs as it is; without,
    they read the realigned rows (`metadata.align_rows`: one tile more per group)."""
    lhs, rhs = random_inputs(256, 64, 128, 4, jnp.bfloat16)
    sizes = jnp.asarray([64, 0, 128, 64], jnp.int32)

    def kernel_rows(alignment):
        f = functools.partial(pk.gmm, group_alignment=alignment, **MOSAIC)
        eqns = [e for e in jax.make_jaxpr(f)(lhs, rhs, sizes).eqns]
        (call,) = [e for e in _all_eqns(eqns) if e.primitive.name == "mpmd_map"]
        return call.invars[1].aval.shape[0]  # (tile groups, lhs, rhs)

    assert kernel_rows(64) == 256
    assert kernel_rows(128) == 256
    assert kernel_rows(1) == kernel_rows(32) == metadata.aligned_rows_bound(256, 4, 64)


def _all_eqns(eqns):
    from jax.extend import core as jex_core

    for eqn in eqns:
        yield eqn
        for sub in jex_core.jaxprs_in_params(eqn.params):
            yield from _all_eqns(getattr(sub, "jaxpr", sub).eqns)


def test_pallas_on_hopper_is_mosaic_gpu_for_16_bit_and_triton_otherwise():
    """What `backend="pallas"` compiles to on cuda, decided by the target's abstract device."""
    sizes = jnp.asarray([3, 5], jnp.int32)

    def calls(dtype, mesh):
        lhs, rhs = random_inputs(8, 16, 16, 2, dtype)
        f = functools.partial(pk.gmm, backend="pallas")
        with jax.sharding.use_abstract_mesh(mesh):
            return [str(c) for c in introspect.traced_kernel_calls(f, lhs, rhs, sizes,
                                                                    platform="cuda")]  # fmt: skip

    h100 = targets.abstract_gpu_mesh()
    a100 = jax.sharding.AbstractMesh(
        (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
        abstract_device=jax.sharding.AbstractDevice(
            device_kind="NVIDIA A100-SXM4-80GB", num_cores=108, platform="gpu"
        ),
    )  # fmt: skip
    assert calls(jnp.bfloat16, h100) == ["gmm/mosaic_gpu"]
    assert calls(jnp.float16, h100) == ["gmm/mosaic_gpu"]
    assert calls(jnp.float32, h100) == ["gmm/triton"]  # Hopper's tf32 wgmma: no transposes
    assert calls(jnp.bfloat16, a100) == ["gmm/triton"]
    with jax.sharding.use_abstract_mesh(h100):
        assert pk.group_alignment() == pk.GROUP_ALIGNMENT
    with jax.sharding.use_abstract_mesh(a100):
        assert pk.group_alignment() == 1
    assert pk.group_alignment() == 1  # this CPU host, no mesh


def test_fp32_operands_are_rejected_naming_the_alternative():
    lhs, rhs = random_inputs(64, 16, 16, 2, jnp.float32)
    sizes = jnp.asarray([30, 34], jnp.int32)
    with pytest.raises(TypeError, match="bfloat16 or float16 operands, got float32.*pallas"):
        pk.gmm(lhs, rhs, sizes, **MOSAIC)
    assert not pk.fits("gmm", "pallas_mosaic_gpu", pk.Config(), jnp.float32)
    assert pk.fits("gmm", "pallas_mosaic_gpu", pk.Config(), jnp.bfloat16)


def test_inside_shard_map_with_check_vma():
    """Forward and VJP inside `shard_map(check_vma=True)`: the kernels' outputs and the VJP's
    cotangents carry the operands' varying axes. One device: the Mosaic GPU interpreter
    (jax 0.10-0.12) fails its barrier bookkeeping when several devices interpret a
    warp-specialized kernel at once ("Barrier remains allocated"), a limit of the simulator,
    not of the kernel; the typing is the same on one device."""
    mesh = jax.make_mesh(
        (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1]
    )
    lhs, rhs = random_inputs(128, 64, 128, 3, jnp.bfloat16, seed=4)
    sizes = jnp.asarray([20, 0, 90], jnp.int32)

    def body(x, w, s):
        out, vjp = jax.vjp(lambda a, b: pk.grouped_matmul(a, b, s, **MOSAIC), x, w)
        return out, *vjp(out)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=(P("x"),) * 3,
                      check_vma=True)  # fmt: skip
    out, dlhs, drhs = jax.jit(f)(lhs, rhs, sizes)
    want = numpy_gmm(lhs, rhs, sizes)
    assert_close(out, want, jnp.bfloat16)
    y = np.asarray(out, np.float64)  # the cotangent is the bf16 output
    assert_close(dlhs, numpy_gmm(y, rhs, sizes, True), jnp.bfloat16)
    assert_close(drhs, numpy_tgmm(lhs, y, sizes), jnp.bfloat16)


@pytest.mark.parametrize("kernel", ["gmm", pytest.param("gmm_t", marks=pytest.mark.slow), "tgmm"])
def test_no_shared_memory_races(kernel):
    """The race detector on: the TMA ring's barriers order every smem write before its read."""
    params = mgpu_compat.interpret_params(detect_races=True)
    kw = dict(backend="pallas_mosaic_gpu", interpret=params, config=SMALL)
    lhs, rhs = random_inputs(192, 128, 128, 3, jnp.bfloat16, seed=2)
    sizes = jnp.asarray([64, 0, 128], jnp.int32)
    if kernel == "tgmm":
        out = pk.tgmm(lhs, lhs[:, :128], sizes, group_alignment=64, **kw)
        want = numpy_tgmm(lhs, lhs[:, :128], sizes)
    else:
        t = kernel == "gmm_t"
        w = rhs.transpose(0, 2, 1) if t else rhs
        out = pk.gmm(lhs, w, sizes, transpose_rhs=t, group_alignment=64, **kw)
        want = numpy_gmm(lhs, rhs, sizes)
    assert not mgpu_compat.races_found()
    assert_close(out, want, jnp.bfloat16)
