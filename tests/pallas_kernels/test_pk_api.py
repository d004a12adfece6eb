"""Public surface, argument validation, backend choice, autotune cache keys and named shapes."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import autotune, config, introspect, shapes, tuned


def test_public_names_import():
    for name in pk.__all__:
        assert getattr(pk, name) is not None, name
    assert {"gmm", "tgmm", "grouped_matmul", "Config", "reference_gmm", "reference_tgmm"} <= set(
        pk.__all__
    )


def test_package_does_not_import_moejax():
    import pathlib

    for path in pathlib.Path(pk.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "import moejax" not in text and "from moejax" not in text, path


def test_config_is_frozen_and_validated():
    cfg = pk.Config(tm=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tm = 32
    with pytest.raises(ValueError, match="tm"):
        pk.Config(tm=96)
    with pytest.raises(ValueError, match="num_warps"):
        pk.Config(num_warps=0)
    assert pk.Config().pipeline == "per_tile"  # the Mosaic GPU pipeline measured on a GPU
    with pytest.raises(ValueError, match=r"pipeline must be one of \('per_tile', 'stream'\)"):
        pk.Config(pipeline="ring")
    assert config.effective_tiles(pk.Config(128, 128, 128), 200, 24, 5) == (128, 32, 8)


@pytest.mark.parametrize(
    "backend, want",
    [
        ("auto", {"cpu": [], "cuda": ["gmm/triton"], "tpu": ["gmm/mosaic"]}),
        ("pallas", {"cpu": ["gmm/interpret"], "cuda": ["gmm/triton"], "tpu": ["gmm/mosaic"]}),
        ("pallas_tpu", {"cpu": ["gmm/mosaic"], "cuda": ["gmm/mosaic"], "tpu": ["gmm/mosaic"]}),
        ("reference", {"cpu": [], "cuda": [], "tpu": []}),
    ],
)
def test_backend_is_chosen_by_the_compile_target(backend, want):
    """ "auto" and "pallas" keep, per lowering platform, one kernel (or the reference)."""
    args = (jnp.ones((64, 32)), jnp.ones((2, 32, 16)), jnp.asarray([30, 34], jnp.int32))
    jaxpr = jax.make_jaxpr(lambda x, w, s: pk.gmm(x, w, s, backend=backend))(*args)
    for platform, calls in want.items():
        assert [str(c) for c in introspect.kernel_calls(jaxpr, platform)] == calls, platform


def test_auto_on_cpu_runs_the_reference_and_pallas_the_interpreted_kernel():
    lhs, rhs = jnp.ones((64, 32)), jnp.ones((2, 32, 16))
    sizes = jnp.asarray([30, 34], jnp.int32)
    for backend in ("auto", "pallas"):  # eager and jitted: each runs the CPU branch
        assert float(pk.gmm(lhs, rhs, sizes, backend=backend).sum()) == 64 * 16 * 32
        f = jax.jit(lambda x, w, s, b=backend: pk.gmm(x, w, s, backend=b))
        assert float(f(lhs, rhs, sizes).sum()) == 64 * 16 * 32
    with pytest.raises(ValueError, match="backend"):
        pk.gmm(lhs, rhs, sizes, backend="cuda")


@pytest.mark.parametrize(
    "lhs_shape, rhs_shape, sizes, match",
    [
        ((4, 3), (2, 5, 6), [2, 2], "does not match"),
        ((4, 3, 1), (2, 3, 6), [2, 2], "lhs"),
        ((4, 3), (3, 6), [2, 2], "rhs"),
        ((4, 3), (3, 3, 6), [2, 2], "does not match"),
    ],
)
def test_gmm_validation(lhs_shape, rhs_shape, sizes, match):
    with pytest.raises(ValueError, match=match):
        pk.gmm(jnp.ones(lhs_shape), jnp.ones(rhs_shape), jnp.asarray(sizes, jnp.int32))


def test_group_sizes_must_be_integer_and_num_groups_consistent():
    with pytest.raises(ValueError, match="group_sizes"):
        pk.gmm(jnp.ones((4, 3)), jnp.ones((2, 3, 5)), jnp.asarray([2.0, 2.0]))
    with pytest.raises(ValueError, match="num_groups"):
        pk.tgmm(jnp.ones((4, 3)), jnp.ones((4, 5)), jnp.asarray([2, 2], jnp.int32), num_groups=3)


def test_autotune_cache_key_buckets_rows():
    key = tuned.cache_key(3000, 512, 1024, 8, jnp.bfloat16, device_kind="NVIDIA H100")
    assert key == (4096, 512, 1024, 8, "bfloat16", "NVIDIA H100", "gmm")
    assert tuned.cache_key(3000, 512, 1024, 8, jnp.bfloat16, "NVIDIA H100", kernel="gmm_t") != key
    assert tuned.cache_key(2049, 512, 1024, 8, jnp.bfloat16, "NVIDIA H100") == key
    assert tuned.cache_key(2048, 512, 1024, 8, jnp.bfloat16, "NVIDIA H100") != key
    assert tuned.cache_key(3000, 512, 1024, 8, jnp.float32, "NVIDIA H100") != key
    assert tuned.cache_key(1, 8, 8, 1, jnp.float32, "x")[0] == 64
    assert tuned.cache_key(10, 8, 8, 1, jnp.float32)[-2] == jax.devices()[0].device_kind


def test_autotune_cache_and_cpu_refusal():
    key = tuned.cache_key(100, 8, 8, 2, jnp.float32, "x")
    tuned.clear_cache()
    assert tuned.cached_config(key) is None
    tuned.store_config(key, pk.Config(tm=32))
    assert tuned.cached_config(key) == pk.Config(tm=32)
    tuned.clear_cache()
    for kernel in ("gmm", "gmm_t"):
        for dtype in (jnp.float32, jnp.bfloat16):
            space = autotune.candidates(kernel, dtype)
            assert 8 <= len(space) == len(set(space)) <= 48
            assert all(pk.fits(kernel, "pallas_triton", c, dtype) for c in space)
    # The filter bites: fp32 drops the big-tile, deep-pipeline candidates that bf16 keeps.
    assert len(autotune.candidates("gmm", jnp.float32)) < len(autotune.candidates("gmm"))
    with pytest.raises(RuntimeError, match="GPU"):
        pk.autotune_gmm(jnp.ones((8, 8)), jnp.ones((2, 8, 8)), jnp.asarray([4, 4], jnp.int32))


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_named_shapes(name):
    spec = shapes.SHAPES[name]
    sizes = spec.group_sizes()
    assert sizes.dtype == np.int32 and sizes.shape == (spec.g,)
    assert sizes.sum() == (spec.used or spec.m) and (sizes >= 0).all()
    small = spec.scaled(m=256, k=64, n=64)
    assert small.group_sizes().sum() <= 256 and small.routing == spec.routing


def test_named_shape_patterns():
    s = shapes.SHAPES
    assert (s["all_in_one"].group_sizes() > 0).sum() == 1
    assert (s["one_per_group"].group_sizes()[:-1] == 1).all()
    assert (s["with_empty"].group_sizes() == 0).any()
    assert s["mixtral_8x7b"] == shapes.ShapeSpec("mixtral_8x7b", 16384, 4096, 14336, 8)
    assert (s["fine_grained"].g, s["fine_grained"].k, s["fine_grained"].n) == (128, 2048, 768)
    zipf = np.sort(s["fine_grained_zipf"].group_sizes())
    assert zipf[-1] > 10 * zipf[0]


def test_shared_memory_model_matches_what_the_h100_compiler_requested():
    """Figures the deviceless H100 compile reported (tests/accelerator checks every default)."""
    smem = config.triton_smem_bytes
    assert smem("gmm", (128, 128, 128), pk.Config(num_stages=3), jnp.float32) == 393216
    assert smem("tgmm", (128, 128, 128), pk.Config(num_stages=3), jnp.float32) == 393216
    own_masked_lhs = config.TRITON_OWN_MASKED_LHS * 128 * 64 * 2  # jaxlib 0.11's Triton
    assert smem("gmm", (128, 64, 128), pk.Config(num_stages=4), jnp.bfloat16) == (
        131072 + own_masked_lhs
    )
    assert smem("tgmm", (64, 128, 128), pk.Config(num_stages=3), jnp.bfloat16) == 98304


def test_config_that_cannot_fit_is_rejected_before_tracing_naming_config_and_limit():
    args = (jnp.ones((256, 512)), jnp.ones((2, 512, 256)), jnp.asarray([100, 156], jnp.int32))
    big = pk.Config(128, 128, 128, num_warps=4, num_stages=3)

    def trace(backend, cfg, **kw):
        return jax.make_jaxpr(lambda x, w, s: pk.gmm(x, w, s, backend=backend, config=cfg, **kw))(
            *args
        )

    match = r"Config\(tm=128, tk=128, tn=128.*gmm at float32 on pallas_triton needs 393216 bytes"
    with pytest.raises(ValueError, match=match + r".*limit is 232448"):
        trace("pallas_triton", big)
    with pytest.raises(ValueError, match=r"tk=32 must be a multiple of 128"):
        trace("pallas_tpu", pk.Config(64, 32, 128))
    with pytest.raises(ValueError, match="pallas_triton needs 393216"):  # "pallas" checks every
        trace("pallas", big)  # target it may be compiled for
    trace("pallas_triton", big, interpret=True)  # interpret mode has no shared-memory limit
    assert not pk.fits("gmm", "pallas_triton", big, jnp.float32)
    assert pk.fits("gmm", "pallas_triton", big, jnp.bfloat16)  # 196608 bytes in bf16


@pytest.mark.parametrize("name", ["mixtral_8x7b", "fine_grained", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_tiles_fit_every_target_at_the_model_shapes(name, dtype):
    spec = shapes.SHAPES[name]
    backends = ["pallas_triton", "pallas_tpu"]
    if dtype == jnp.bfloat16:
        backends.append("pallas_mosaic_gpu")  # 16-bit only
    for k, n in ((spec.k, spec.n), (spec.n, spec.k)):  # up and down projections
        for kernel, backend in itertools.product(pk.KERNELS, backends):
            if backend == "pallas_mosaic_gpu" and kernel == "gather_gmm":
                continue  # composed from gmm there
            for out_dtype in {dtype, jnp.float32} if backend == "pallas_mosaic_gpu" else {dtype}:
                cfg = pk.default_config(
                    kernel, backend, dtype, spec.m, k, n, spec.g, out_dtype=out_dtype
                )
                tiles = config.effective_tiles(cfg, spec.m, k, n, kernel=kernel, backend=backend)
                config.check_fits(
                    kernel, backend, cfg, tiles, dtype, out_dtype, dims=(spec.m, k, n)
                )
                assert n % tiles[2] == 0 and k % tiles[1] == 0  # no padding of model dims
