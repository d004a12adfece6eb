"""The fp8 Mosaic GPU kernels (forward and lhs gradient: fp8_gmm; weight gradient: fp8_tgmm),
compiled for H100 on this CPU machine: in the program, zero spills, registers within the
three-warpgroup launch budget, shared memory within the limit. The default run compiles one
case (DeepSeek-V3's expert shape, the up projection); the other shapes and projections are slow.
"""

import functools

import pytest
from _targets import CACHE_WARNING, needs_cuda

from pallas_kernels import config, fp8_mosaic_gpu, resources

pytestmark = [pytest.mark.deviceless, CACHE_WARNING]


@functools.cache
def _rows(cases):
    return resources.report("cuda", list(cases))


def _check(rows, cases):
    assert len(rows) == 2 * cases
    for r in rows:
        what = f"{r['case']} {r['kernel']}"
        # fp8_gmm runs twice (forward, lhs gradient), fp8_tgmm once
        assert r["in_program"] == (2 if r["kernel"] == "fp8_gmm" else 1), what
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, what
        assert 0 < r["registers"] <= 168, what
        assert r["smem_model"] <= config.MOSAIC_GPU_SMEM_LIMIT, what
        assert r["tiles"] == [fp8_mosaic_gpu.TILE] * 3, what


@needs_cuda
def test_h100_fp8_kernels_compile_without_spills_deepseek_v3():
    case = resources.Case("deepseek_v3", "bfloat16", "in", backend=resources.FP8_BACKEND)
    _check(_rows((case,)), 1)


@needs_cuda
@pytest.mark.slow
def test_h100_fp8_kernels_compile_without_spills_every_shape():
    _check(_rows(tuple(resources.fp8_cases())), len(resources.MOSAIC_GPU_SHAPES) * 2)
