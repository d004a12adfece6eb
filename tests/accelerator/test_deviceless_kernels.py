"""Every kernel, forward and VJP, fp32 and bf16, at the Mixtral and fine-grained shapes,
compiled for H100 (Triton -> PTX -> ptxas sm_90a; Mosaic GPU -> ptxas sm_90a) and TPU (Mosaic)
on this CPU machine.

H100: each kernel is in the compiled program and ptxas reports zero spill stores at the chosen
tiles. Triton: the shared memory of every launch equals `config.triton_smem_bytes` (so the
check that rejects a config before compiling is exact). Mosaic GPU (what H100 runs for bf16;
also at DeepSeek-V3's shape): the model `config.mosaic_gpu_smem_bytes` is within the limit and
is what Mosaic GPU itself computes. TPU: each kernel is in the program and the scoped VMEM
Mosaic reserves is within the model `check_fits` uses, and within the limit.
Figures: BENCHMARKS.md ("Deviceless accelerator compiles"), `python experiments/compile_report.py`.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from _targets import CACHE_WARNING, needs_cuda, needs_tpu

import pallas_kernels as pk
from pallas_kernels import config, resources, targets, triton

pytestmark = [pytest.mark.deviceless, CACHE_WARNING]
KERNELS = {"gmm", "gmm_t", "tgmm"}


@functools.cache
def _report(platform, generation="v5e"):
    return resources.report(platform, generation=generation)


def _check_cases(rows, platform):
    cases = {tuple(r["case"].values()) for r in rows}
    want = {tuple(c.__dict__.values()) for c in resources.default_cases(platform)}
    assert cases == want
    for case in resources.default_cases(platform):
        kernels = {r["kernel"] for r in rows if r["case"] == case.__dict__}
        assert kernels == set(case.kernels()), case


@needs_cuda
def test_h100_triton_kernels_compile_without_spills_and_smem_as_modelled():
    rows = [r for r in _report("cuda") if r["backend"] == "pallas_triton"]
    assert len(rows) == 2 * 2 * 2 * 3 + 2 * 2  # shapes x dtypes x projections x kernels + gather
    for r in rows:
        what = f"{r['case']} {r['kernel']}"
        assert r["in_program"] == 1, what
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, what
        assert 0 < r["registers"] <= 255, what
        assert r["smem"] == r["smem_model"] <= config.TRITON_SMEM_LIMIT, what
        tm, tk, tn = r["tiles"]
        m, k, n, g = resources.Case(**r["case"]).dims()
        if r["kernel"] == "tgmm":  # one program per (group, k-tile, n-tile)
            assert r["grid"] == [g, k // tk, n // tn], what
        else:
            cols = k if r["kernel"] == "gmm_t" else n
            assert r["grid"] == [m // tm, cols // tn, 1], what
        assert r["threads"] == 32 * r["config"]["num_warps"], what


@needs_cuda
def test_h100_runs_mosaic_gpu_for_bf16_without_spills_within_shared_memory():
    """`backend="pallas"` on an H100 with bf16: the warp-specialized Mosaic GPU kernels, at the
    Mixtral, fine-grained and DeepSeek-V3 shapes, both projections."""
    rows = [r for r in _report("cuda") if r["backend"] == "pallas_mosaic_gpu"]
    shapes = {r["case"]["shape"] for r in rows}
    assert shapes == {"mixtral_8x7b", "fine_grained", "deepseek_v3"}
    assert len(rows) == 3 * 2 * 3 and {r["case"]["dtype"] for r in rows} == {"bfloat16"}
    for r in rows:
        what = f"{r['case']} {r['kernel']}"
        assert r["in_program"] == 1, what  # the mosaic_gpu custom call, by kernel name
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, what
        # 3 warpgroups of 128 threads share 64K registers: <= 170 each at launch (the
        # consumers then take 232 from the producer's share, `set_max_registers`).
        assert 0 < r["registers"] <= 168, what
        assert r["smem_model"] <= config.MOSAIC_GPU_SMEM_LIMIT, what
        assert r["config"]["num_stages"] == 4, what  # the deepest ring that fits


@needs_cuda
def test_h100_mosaic_gpu_stream_pipeline_compiles_without_spills():
    """`Config(pipeline="stream")` (one shared-memory ring across a CTA's tiles) at the
    fine-grained shape, where tiles are shortest: the three kernels in the program, no spills,
    the launch's registers, the same shared memory model."""
    case = resources.Case("fine_grained", "bfloat16", "in", pipeline="stream")
    rows = resources.report("cuda", [case])
    assert {r["kernel"] for r in rows} == KERNELS
    for r in rows:
        what = r["kernel"]
        assert r["backend"] == "pallas_mosaic_gpu" and r["config"]["pipeline"] == "stream", what
        assert r["in_program"] == 1, what
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, what
        assert 0 < r["registers"] <= 168, what
        assert r["smem_model"] <= config.MOSAIC_GPU_SMEM_LIMIT, what


@needs_cuda
@pytest.mark.parametrize("pipeline", ["per_tile", "stream"])
def test_mosaic_gpu_shared_memory_model_is_what_mosaic_gpu_checks(pipeline):
    """One stage more than fits: Mosaic GPU refuses the kernel naming the bytes the model
    computes, and `check_fits` refuses the same config before tracing (on either pipeline:
    the same rings, barriers and epilogue slots)."""
    from pallas_kernels import metadata, mosaic_gpu

    cfg, tiles = pk.Config(128, 64, 256, num_stages=5, pipeline=pipeline), (128, 64, 256)
    need = config.mosaic_gpu_smem_bytes("gmm", tiles, cfg, jnp.bfloat16, jnp.bfloat16)
    assert need == 5 * (128 * 64 + 64 * 256) * 2 + 2 * 2 * 64 * 64 * 2 + 5 * 16 == 278608
    mesh = targets.gpu_mesh((1,), ("x",))
    lhs, rhs, sizes = _abstract(
        mesh, ((1024, 512), jnp.bfloat16), ((4, 512, 512), jnp.bfloat16), ((4,), jnp.int32),
    )  # fmt: skip
    checked = jax.jit(lambda x, w, s: pk.gmm(x, w, s, backend="pallas_mosaic_gpu", config=cfg))
    with pytest.raises(ValueError, match=r"needs 278608 bytes.*232448"), targets.lowering(mesh):
        checked.trace(lhs, rhs, sizes)

    def unchecked(x, w, s, cfg=cfg):
        groups = metadata.aligned_tile_groups(s, m=1024, tm=128)
        return mosaic_gpu.gmm(
            x, w, groups, tiles=tiles, config=cfg, transpose_rhs=False,
            out_dtype=jnp.bfloat16, interpret=False,
        )  # fmt: skip

    too_big = pytest.raises(Exception, match=f"smem_bytes={need} > max_smem_bytes=232448")
    with too_big, targets.lowering(mesh):
        jax.jit(unchecked).lower(lhs, rhs, sizes).compile()
    fits = pk.Config(128, 64, 256, num_stages=4, pipeline=pipeline)
    assert config.mosaic_gpu_smem_bytes("gmm", tiles, fits, jnp.bfloat16, jnp.bfloat16) == 229440
    with targets.lowering(mesh):
        jax.jit(functools.partial(unchecked, cfg=fits)).lower(lhs, rhs, sizes).compile()


@needs_cuda
def test_h100_lowers_each_distinct_kernel_once():
    """Three gmm calls, two of one shape: the program holds two Mosaic GPU kernels, each a
    function called where the kernel runs (the kernel's jit is lowered once per module and
    shape; a deep model's lowering grows with its distinct kernels, not its layers)."""
    mesh = targets.gpu_mesh((1,), ("x",))
    args = _abstract(
        mesh, ((1024, 512), jnp.bfloat16), ((4, 512, 512), jnp.bfloat16), ((4,), jnp.int32),
    )  # fmt: skip

    def layers(x, w, s):
        x = pk.gmm(x, w, s, backend="pallas_mosaic_gpu")
        x = pk.gmm(x, w, s, backend="pallas_mosaic_gpu")
        return pk.gmm(x[:512], w, s, backend="pallas_mosaic_gpu")

    with targets.lowering(mesh):
        text = jax.jit(layers).lower(*args).as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu\w*\(", text)) == 2
    assert len(re.findall(r"call @gmm(?:_\d+)?\(", text)) == 3


@needs_tpu
@pytest.mark.parametrize("generation", ["v5e", pytest.param("v5p", marks=pytest.mark.slow)])
def test_tpu_kernels_compile_within_the_vmem_model(generation):
    rows = _report("tpu", generation)
    _check_cases(rows, "tpu")
    assert len(rows) == 2 * 2 * 2 * 3
    for r in rows:
        what = f"{r['case']} {r['kernel']}"
        assert r["in_program"] == 1, what
        # Mosaic's own accounting: at least the blocks, at most the model's envelope.
        blocks = config.mosaic_block_bytes(r["kernel"], r["tiles"], *[r["case"]["dtype"]] * 2)
        assert blocks <= r["vmem"] <= r["vmem_model"] <= config.MOSAIC_VMEM_LIMIT, what


def _abstract(mesh, *shapes):
    s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=s) for shape, dtype in shapes]


@needs_cuda
def test_h100_rejects_before_compile_the_config_the_compiler_rejects():
    """fp32 128^3 with 3 stages: ptxas would need 393216 bytes of shared memory. The check says
    so before tracing a kernel; compiled anyway (the kernel module, unchecked), XLA fails with
    the same number."""
    cfg, tiles = pk.Config(128, 128, 128, num_warps=4, num_stages=3), (128, 128, 128)
    assert config.triton_smem_bytes("gmm", tiles, cfg, jnp.float32) == 393216
    mesh = targets.gpu_mesh((1,), ("x",))
    lhs, rhs, sizes = _abstract(
        mesh, ((1024, 512), jnp.float32), ((8, 512, 512), jnp.float32), ((8,), jnp.int32),
    )  # fmt: skip
    checked = jax.jit(lambda x, w, s: pk.gmm(x, w, s, backend="pallas_triton", config=cfg))
    with pytest.raises(ValueError, match=r"Config\(tm=128.*needs 393216 bytes.*232448"):
        checked.trace(lhs, rhs, sizes)
    unchecked = jax.jit(
        lambda x, w, s: triton.gmm(
            x,
            w,
            s,
            tiles=tiles,
            config=cfg,
            transpose_rhs=False,
            out_dtype=jnp.float32,
            interpret=False,
        )  # fmt: skip
    )
    with pytest.raises(Exception, match="requested 393216, available: 232448"):
        with targets.lowering(mesh):
            lowered = unchecked.lower(lhs, rhs, sizes)
        lowered.compile()
    # Half the contraction tile fits (196608 bytes), and compiles.
    fits = pk.Config(128, 64, 128, num_warps=8, num_stages=3)
    assert pk.fits("gmm", "pallas_triton", fits, jnp.float32)
    with targets.lowering(mesh):
        lowered = jax.jit(lambda x, w, s: pk.gmm(x, w, s, backend="pallas_triton", config=fits))
        lowered = lowered.lower(lhs, rhs, sizes)
    lowered.compile()


@needs_tpu
def test_tpu_rejects_before_compile_the_config_mosaic_rejects():
    """bf16 gmm with 1024 x 2048 x 1024 tiles: 24 MiB of blocks against 16 MiB of scoped VMEM."""
    from pallas_kernels import tpu

    cfg, tiles = pk.Config(1024, 2048, 1024), (1024, 2048, 1024)
    lhs, rhs, sizes = _abstract(
        targets.tpu_mesh((1,), ("x",)), ((4096, 4096), jnp.bfloat16),
        ((8, 4096, 4096), jnp.bfloat16), ((8,), jnp.int32),
    )  # fmt: skip
    checked = jax.jit(lambda x, w, s: pk.gmm(x, w, s, backend="pallas_tpu", config=cfg))
    with pytest.raises(ValueError, match=r"Config\(tm=1024.*on pallas_tpu needs \d+ bytes"):
        checked.trace(lhs, rhs, sizes)
    unchecked = jax.jit(
        lambda x, w, s: tpu.gmm(
            x, w, s, tiles=tiles, transpose_rhs=False, out_dtype=jnp.bfloat16, interpret=False
        )
    )
    with pytest.raises(Exception, match="vmem"):
        unchecked.lower(lhs, rhs, sizes).compile()
