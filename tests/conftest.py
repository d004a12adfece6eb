"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere; the fixture that
puts the Mosaic GPU kernels under `implementation="pallas"` on CPU."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

# Tiles of the Mosaic GPU kernels in the CPU tests (interpreting is slow: few, large tiles) and
# the group alignment they need (their row tile, gmm and tgmm alike).
MOSAIC_GPU_TILES = dict(tm=64, tk=64, tn=128, num_stages=2, raster=2)
MOSAIC_GPU_ALIGNMENT = 64


@pytest.fixture
def mosaic_gpu_kernels(monkeypatch):
    """`implementation="pallas"` on CPU runs what an H100 compiles, not the Triton interpreter:
    the Mosaic GPU kernels (in their interpreter), with the permute phase padding experts to
    their row tile (`pallas_kernels.group_alignment()`)."""
    import pallas_kernels as pk
    from moejax import _gmm

    def gmm(lhs, rhs, group_sizes, group_alignment=1):
        assert group_alignment == MOSAIC_GPU_ALIGNMENT  # the permute padded every expert to it
        return pk.grouped_matmul(
            lhs, rhs, group_sizes, backend="pallas_mosaic_gpu", interpret=True,
            config=pk.Config(**MOSAIC_GPU_TILES), group_alignment=group_alignment,
        )  # fmt: skip

    monkeypatch.setattr(_gmm, "pallas_gmm", gmm)
    monkeypatch.setattr(pk, "group_alignment", lambda: MOSAIC_GPU_ALIGNMENT)
