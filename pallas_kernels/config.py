"""Tiling `Config`, backend names, what fits each target, and the default tiles of every kernel.

Shape letters (docs/design.md): `M` rows of lhs, `K` contraction, `N` output columns, `G` groups.

Backends (`BACKENDS`, see `ops`): "auto", "pallas", "reference", "pallas_triton",
"pallas_mosaic_gpu", "pallas_tpu".

Kernels (`KERNELS`), each with its own tiles:
  * `"gmm"`: `out[rows of g] = lhs[rows of g] @ rhs[g]` (the forward expert matmul);
  * `"gmm_t"`: the same with `rhs[g]` transposed (the lhs gradient of gmm);
  * `"tgmm"`: `out[g] = lhs_g^T @ rhs_g` (the weight gradient);
  * `"gather_gmm"`: gmm reading lhs rows through an index (Pallas-Triton only, `fused.py`).

What fits (checked by `check_fits` before a kernel is traced, so a bad tile is an error that
names the config and the limit, not a compiler failure):
  * Pallas-Triton (H100): the shared memory Triton allocates for its software pipeline must stay
    within the 232,448 bytes a block may opt into. Triton keeps `num_stages` copies of each
    operand tile; `triton_smem_bytes` is that count, equal byte for byte to what XLA's thunk
    sequence reports on a deviceless H100 compile (tested).
  * Pallas Mosaic GPU (Hopper): the shared-memory ring of `num_stages` slots of both operand
    tiles plus the epilogue's TMA-store slots and the pipeline's barriers
    (`mosaic_gpu_smem_bytes`, equal byte for byte to what Mosaic GPU computes when it lowers a
    kernel) within the same 232,448 bytes; 16-bit operands only (Hopper's tf32 wgmma reads no
    transposed operand), and tiles at least wgmma's: 64 rows of output per warpgroup.
  * Pallas-TPU (Mosaic): VMEM holds two buffers of every block (double buffering), the fp32
    accumulator, and scratch Mosaic adds itself (its "register allocator spill slots": up to
    13 MiB for big bf16 tgmm tiles). `mosaic_vmem_bytes` is the blocks exactly plus an upper
    envelope of that scratch, fitted to ~450 deviceless compiles (never below the measured
    total); it is held to the 16 MiB scoped VMEM default of v4, v5e and v5p (v6e: 32 MiB).
    Mosaic also needs tk and tn multiples of 128 and tm a multiple of 8, unless a tile covers
    its whole (padded) dimension.

Default tiles (`default_config`) are chosen per kernel, dtype and shape so that on H100 no kernel
spills registers (ptxas reports zero spill stores at both model shapes of `shapes.py`) and the
revisits of tiles straddling a group boundary stay a small share of the work.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Backend = Literal["auto", "pallas", "reference", "pallas_triton", "pallas_mosaic_gpu", "pallas_tpu"]
BACKENDS: tuple[str, ...] = (
    "auto", "pallas", "reference", "pallas_triton", "pallas_mosaic_gpu", "pallas_tpu",
)  # fmt: skip
Kernel = Literal["gmm", "gmm_t", "tgmm", "gather_gmm"]
KERNELS: tuple[str, ...] = ("gmm", "gmm_t", "tgmm", "gather_gmm")

TRITON_SMEM_LIMIT = 232_448  # H100 `sharedMemPerBlockOptin` (also what Triton may request)
MOSAIC_GPU_SMEM_LIMIT = TRITON_SMEM_LIMIT  # the same opt-in limit, as Mosaic GPU checks it
# The Triton in jaxlib 0.11 gives the masked lhs tile of a row-tile kernel's straddling path
# (`triton.gmm`'s `jnp.where`, 16-bit operands) a shared-memory buffer beside the pipeline's;
# the Tritons of jaxlib 0.10 and 0.12 place it in a pipeline buffer. Measured on deviceless H100
# compiles with each (`tests/accelerator/test_deviceless_kernels.py`).
TRITON_OWN_MASKED_LHS = (0, 11) <= jax.__version_info__ < (0, 12)
# Row alignment of the groups at which the Mosaic GPU kernels run without realigning rows: a
# multiple of their default row tiles (gmm 128, tgmm 64). `moejax` pads experts to it.
GROUP_ALIGNMENT = 128
MOSAIC_GPU_EPILOGUE_TILE = 64  # rows and columns of one TMA store of the epilogue
# How the Mosaic GPU kernels bring K blocks to shared memory (`Config.pipeline`,
# `mosaic_gpu.run_tiles`): jax's pipeline once per output tile, or one ring across the tiles.
MOSAIC_GPU_PIPELINES = ("per_tile", "stream")
# Smallest (tm, tk, tn) of the Mosaic GPU kernels: each consumer warpgroup's wgmma covers 64
# output rows (gmm: tm; tgmm: tk) and K in steps of 16; TMA swizzles rows of >= 32 bytes, so
# tn // 2 >= 16 columns per warpgroup.
_MOSAIC_GPU_MIN = {"gmm": (64, 16, 32), "gmm_t": (64, 16, 32), "tgmm": (16, 64, 32)}
MOSAIC_VMEM_LIMIT = 16 * 2**20  # scoped VMEM default of TPU v4, v5e, v5p (v6e: 32 MiB)
_MOSAIC_ALIGN = (8, 128, 128)  # (tm, tk, tn) multiples compiled Mosaic blocks need


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of one grouped-matmul kernel (gmm or tgmm).

    Attributes:
      tm: rows of lhs per tile. Also the granularity at which group boundaries are handled: a
        tile that straddles a boundary is computed once per group it touches (masked revisit).
      tk: contraction columns per step of the inner loop.
      tn: output columns per tile.
      num_warps: Triton only: warps per program.
      num_stages: Triton and Mosaic GPU: software-pipelining depth (operand tiles kept in
        shared memory).
      raster: Mosaic GPU only: the persistent schedule walks `raster` m-tiles (gmm) or k-tiles
        (tgmm) before moving to the next n-tile, snaking, so the CTAs in flight share operand
        tiles in L2.
      pipeline: Mosaic GPU only: how the K blocks reach shared memory (`MOSAIC_GPU_PIPELINES`):
        jax's warp-specialized pipeline, filled and drained for every output tile ("per_tile",
        the one measured), or one ring across all of a CTA's tiles ("stream",
        `mosaic_gpu.tile_stream`).

    Tiles are clamped to the problem (see `effective_tiles`), so a large default is safe on small
    inputs. Triton needs power-of-two tiles. Compiled Mosaic (TPU) needs tk and tn >= 128 and
    tm >= 8 unless the tile covers the whole (padded) dimension; interpret mode accepts any
    power of two, which the CPU tests use.
    """

    tm: int = 128
    tk: int = 128
    tn: int = 128
    num_warps: int = 4
    num_stages: int = 3
    raster: int = 8
    pipeline: str = "per_tile"

    def __post_init__(self):
        for name in ("tm", "tk", "tn", "num_warps", "num_stages", "raster"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        if self.pipeline not in MOSAIC_GPU_PIPELINES:
            raise ValueError(
                f"Config.pipeline must be one of {MOSAIC_GPU_PIPELINES}, got {self.pipeline!r}"
            )
        for name in ("tm", "tk", "tn"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"Config.{name} must be a power of two, got {value}")


DEFAULT_CONFIG = Config()


# Precision of every kernel's tile products, whatever `jax_default_matmul_precision` says: bf16
# products are exact in the fp32 accumulator; fp32 operands multiply as TF32 on H100 and in bf16
# passes on TPU, what XLA does for fp32 dots by default. Why fixed: under "highest", Mosaic
# rejects bf16 operands and Triton's IEEE fp32 path (no tensor cores) spills ~14 KB per thread
# at these tiles and changes their shared memory. For fp32-exact products use the XLA paths.
KERNEL_PRECISION = jax.lax.Precision.DEFAULT


def next_power_of_2(x: int) -> int:
    """Smallest power of two >= x (and >= 1)."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def effective_tiles(
    config: Config, m: int, k: int, n: int, *, kernel: str = "gmm", backend: str | None = None
) -> tuple[int, int, int]:
    """Clamps (tm, tk, tn) to the problem so a tile never exceeds the next power of two of its dim.

    Why: interpret mode and small tests use large tiles on small shapes; a 128-row tile over 12
    rows would otherwise pad 10x. Clamped tiles stay powers of two (Triton's requirement). On
    "pallas_mosaic_gpu" no tile goes below what wgmma needs (`_MOSAIC_GPU_MIN`; padded instead).
    """
    tiles = (
        min(config.tm, next_power_of_2(m)),
        min(config.tk, next_power_of_2(k)),
        min(config.tn, next_power_of_2(n)),
    )
    if backend == "pallas_mosaic_gpu":
        floor = _MOSAIC_GPU_MIN[kernel]
        tiles = tuple(max(t, f) for t, f in zip(tiles, floor, strict=True))
    return tiles


def _operand_tiles(kernel: str, tiles: tuple[int, int, int]) -> tuple[int, int]:
    """Elements of the (lhs, rhs) tiles one inner-loop step reads."""
    tm, tk, tn = tiles
    if kernel == "tgmm":  # lhs [tm, tk] and rhs [tm, tn]: both are row tiles of the M axis
        return tm * tk, tm * tn
    return tm * tk, tk * tn


def triton_smem_bytes(kernel: str, tiles: tuple[int, int, int], config: Config, dtype) -> int:
    """Shared memory Triton allocates for one program: its pipelined operand buffers.

    `num_stages` buffers of each operand tile, and on jaxlib 0.11 one more lhs tile for the
    16-bit row-tile kernels (`TRITON_OWN_MASKED_LHS`). Matches the compiled kernels' launch
    shared memory exactly (measured on deviceless H100 compiles, see BENCHMARKS.md).
    """
    itemsize = jnp.dtype(dtype).itemsize
    lhs, rhs = _operand_tiles(kernel, tiles)
    masked_copy = TRITON_OWN_MASKED_LHS and kernel != "tgmm" and itemsize == 2
    return (config.num_stages * (lhs + rhs) + masked_copy * lhs) * itemsize


def mosaic_gpu_smem_bytes(
    kernel: str, tiles: tuple[int, int, int], config: Config, dtype, out_dtype
) -> int:
    """Shared memory of one Mosaic GPU CTA (`mosaic_gpu.py`): `num_stages` slots of both operand
    tiles, two epilogue slots of 64 x 64 per consumer warpgroup (one if a warpgroup's tile is
    one store), and one "loaded" and one "consumed" 8-byte mbarrier per stage.

    Tiles: gmm, gmm_t: (tm, tk, tn) = CTA rows, contraction step, CTA columns; tgmm: (tm, tk, tn)
    = rows contracted per step, output rows (of K) and columns (of N) per CTA. Each of the two
    consumer warpgroups owns tn // 2 columns.
    """
    tm, tk, tn = tiles
    itemsize, out_itemsize = jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize
    operands, out_rows = (tm * tk + tm * tn, tk) if kernel == "tgmm" else (tm * tk + tk * tn, tm)
    cols = tn // 2
    epi_m, epi_n = min(MOSAIC_GPU_EPILOGUE_TILE, out_rows), min(MOSAIC_GPU_EPILOGUE_TILE, cols)
    slots = min(2, (out_rows * cols) // (epi_m * epi_n))
    epilogue = 2 * slots * epi_m * epi_n * out_itemsize
    return config.num_stages * (operands * itemsize + 2 * 8) + epilogue


def check_mosaic_gpu_dtype(dtype) -> None:
    """Raises TypeError unless `dtype` is one the Mosaic GPU kernels multiply (16-bit)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(
            f"backend='pallas_mosaic_gpu' multiplies bfloat16 or float16 operands, got "
            f"{jnp.dtype(dtype).name}: Hopper's tf32 wgmma cannot read the transposed operands "
            "these kernels need. Use backend='pallas' (Triton's TF32 kernel for fp32 on GPU) "
            "or 'pallas_triton'."
        )


def mosaic_block_bytes(kernel: str, tiles: tuple[int, int, int], dtype, out_dtype) -> int:
    """VMEM of one Mosaic kernel's blocks: two buffers of each input and output block and the
    fp32 accumulator scratch (`tpu.py`). Equal to the blocks part of Mosaic's own accounting."""
    tm, tk, tn = tiles
    itemsize, out_itemsize = jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize
    lhs, rhs = _operand_tiles(kernel, tiles)
    out = tk * tn if kernel == "tgmm" else tm * tn
    return 2 * (lhs + rhs) * itemsize + 2 * out * out_itemsize + out * 4


def mosaic_vmem_bytes(kernel: str, tiles: tuple[int, int, int], dtype, out_dtype) -> int:
    """An upper bound of the scoped VMEM one Mosaic kernel uses: `mosaic_block_bytes` plus the
    scratch Mosaic adds, which grows with the lhs and output tiles (bf16 more than fp32; tgmm
    most, for the masked copies of both row blocks). Envelope fitted on deviceless v5e/v5p/v6e
    compiles (Mixtral and fine-grained shapes, tiles 128-2048): it never under-estimated."""
    tm, tk, tn = tiles
    narrow, quarter_mib = jnp.dtype(dtype).itemsize < 4, 2**18
    if kernel == "tgmm":
        extra = quarter_mib + (4 * tm * tk + 3 * tm * tn // 2 if narrow else tm * tk + 2 * tm * tn)
    else:
        extra = quarter_mib + 2 * tm * tk + tm * tn if narrow else tm * tk
    return mosaic_block_bytes(kernel, tiles, dtype, out_dtype) + extra


def check_fits(
    kernel: str,
    backend: str,
    config: Config,
    tiles: tuple[int, int, int],
    dtype,
    out_dtype,
    dims: tuple[int, int, int] | None = None,
) -> None:
    """Raises ValueError naming the config and the limit when the kernel cannot compile.

    Args:
      kernel, backend, config: what is compiled.
      tiles: the effective (tm, tk, tn) (`effective_tiles`).
      dtype, out_dtype: operand and output dtypes.
      dims: the problem's (M, K, N), for Mosaic's block alignment (None: not checked).
    """
    if backend == "pallas_tpu" and dims is not None:
        for name, tile, dim, align in zip(
            ("tm", "tk", "tn"), tiles, dims, _MOSAIC_ALIGN, strict=True
        ):
            if tile % align and tile < dim:
                raise ValueError(
                    f"{config} for {kernel} on pallas_tpu: {name}={tile} must be a multiple of "
                    f"{align} (Mosaic's block alignment) or cover the dimension ({dim})"
                )
    if backend == "pallas_triton":
        need, limit, what = (
            triton_smem_bytes(kernel, tiles, config, dtype),
            TRITON_SMEM_LIMIT,
            ("shared memory per block on H100"),
        )
    elif backend == "pallas_mosaic_gpu":
        check_mosaic_gpu_dtype(dtype)
        need, limit, what = (
            mosaic_gpu_smem_bytes(kernel, tiles, config, dtype, out_dtype),
            MOSAIC_GPU_SMEM_LIMIT,
            "shared memory per block on H100",
        )
    elif backend == "pallas_tpu":
        need, limit, what = (
            mosaic_vmem_bytes(kernel, tiles, dtype, out_dtype),
            (MOSAIC_VMEM_LIMIT),
            "scoped VMEM on TPU v5e",
        )
    else:
        return
    if need > limit:
        raise ValueError(
            f"{config} (tiles {tiles}) for {kernel} at {jnp.dtype(dtype).name} on {backend} needs "
            f"{need} bytes; the limit is {limit} bytes of {what}. Use smaller tiles or fewer "
            "stages (see pallas_kernels.default_config)."
        )


def fits(kernel: str, backend: str, config: Config, dtype, out_dtype=None) -> bool:
    """Whether `config`'s full tiles fit `backend`'s target (see `check_fits`)."""
    tiles = (config.tm, config.tk, config.tn)
    try:
        check_fits(kernel, backend, config, tiles, dtype, out_dtype or dtype, dims=tiles)
    except (ValueError, TypeError):
        return False
    return True


def _divisor_tile(dim: int, target: int, floor: int) -> int:
    """The largest power of two in [floor, target] dividing `dim` (no padding), else target."""
    tile = target
    while tile > floor and dim % tile:
        tile //= 2
    return tile if dim % tile == 0 else target


def default_config(
    kernel: str, backend: str, dtype, m: int, k: int, n: int, g: int, *, out_dtype=None
) -> Config:
    """Tiles for one kernel on one backend, by dtype and shape (see the module docstring).

    Args:
      kernel: one of `KERNELS`.
      backend: "pallas_triton", "pallas_mosaic_gpu" or "pallas_tpu" (anything else gets
        `DEFAULT_CONFIG`).
      dtype: operand dtype.
      m, k, n, g: the problem (`M` rows, `K` contraction, `N` output columns, `G` groups).
      out_dtype: output dtype (None: dtype); Mosaic GPU's epilogue slots hold it.

    Returns:
      A Config that fits the backend's target (`fits`).
    """
    wide = jnp.dtype(dtype).itemsize >= 4
    # A tile straddling a group boundary is computed once per group: with ~G boundaries the
    # extra work is about G * tm / M. Keep it under 1/8 where the mean group allows it
    # (Mixtral-like: 8 * 128 / 16384 = 6%), else use 64-row tiles (fine-grained experts).
    tm = 128 if g * 128 * 8 <= m else 64
    if backend == "pallas_triton":
        # H100, measured with ptxas -v on deviceless compiles: 8 warps keep the two [tm, tn]
        # fp32 accumulators of gmm (the group's partial product and the tile's sum) in registers
        # (4 warps spill 80-2000 bytes); fp32 operands take half the tk of bf16 for the same
        # shared memory.
        if kernel == "tgmm":
            # Measured on one H100 (bf16): 256 output columns and 4 stages are 10% faster where
            # groups are large (Mixtral: 319 vs 290 TFLOP/s) and 5-8% slower with 128 small
            # groups (fine-grained), so they follow the same group-size test as tm above.
            large_groups = not wide and g * 128 * 8 <= m
            return Config(tm=64, tk=_divisor_tile(k, 128, 16),
                          tn=_divisor_tile(n, 256 if large_groups else 128, 16),
                          num_warps=8, num_stages=4 if large_groups else 3)  # fmt: skip
        if not wide and kernel in ("gmm", "gmm_t"):
            # bf16, measured on one H100 (experiments/tune_kernels.py, BENCHMARKS.md): 64 x 256
            # output tiles run 1.4x faster than 128 x 128 at the Mixtral shape (416-445 vs
            # 300-309 TFLOP/s) and 1.1-1.4x at the fine-grained one; 128 x 256 was 5-9% faster
            # still at Mixtral's while it spilled. With one accumulator (`triton.gmm`) it spills
            # nothing (216-245 registers, 3 stages): where groups are large it takes tokamax's
            # winning Triton ragged-dot tile, 128 x 256 x 64, 8 warps, 3 stages.
            if tm == 128:
                return Config(tm=128, tk=64, tn=_divisor_tile(n, 256, 16), num_warps=8,
                              num_stages=3)  # fmt: skip
            return Config(tm=64, tk=64, tn=_divisor_tile(n, 256, 16), num_warps=8, num_stages=4)
        return Config(tm=tm, tk=32 if wide else 64, tn=_divisor_tile(n, 128, 16),
                      num_warps=8, num_stages=3 if wide else 4)  # fmt: skip
    if backend == "pallas_mosaic_gpu":
        return _mosaic_gpu_config(kernel, dtype, out_dtype or dtype, k, n)
    if backend == "pallas_tpu":
        # Mosaic pays per grid step, so tiles are large: 256-row tiles where the revisits stay
        # under 1/8 of the work (128 otherwise, the MXU's size), 1024 columns in bf16 and 512 in
        # fp32, shrunk to a divisor of the model dim where a power of two divides it (768 ->
        # 256) so nothing is padded. All fit 16 MiB with Mosaic's scratch (`fits`).
        tm = 256 if g * 256 * 8 <= m else 128
        wide_tile = 512 if wide else 1024
        return Config(
            tm=tm, tk=_divisor_tile(k, wide_tile, 128), tn=_divisor_tile(n, wide_tile, 128)
        )
    return DEFAULT_CONFIG


def vjp_configs(backend: str, dtype, m: int, k: int, n: int, g: int, **replace) -> dict:
    """{kernel: Config} for the three kernels of a forward `[M, K] x [G, K, N]` and its VJP
    (gmm; gmm_t, which multiplies `[M, N]` by the weights transposed; tgmm), each its
    `default_config` with the fields in `replace` changed (e.g. `pipeline="stream"`)."""
    problems = {"gmm": (m, k, n), "gmm_t": (m, n, k), "tgmm": (m, k, n)}
    return {
        kernel: dataclasses.replace(default_config(kernel, backend, dtype, *p, g), **replace)
        for kernel, p in problems.items()
    }


def _mosaic_gpu_config(kernel: str, dtype, out_dtype, k: int, n: int) -> Config:
    """Hopper tiles (deviceless ptxas: 168 registers, no spills at the model shapes): CTA
    128 x 256 (two consumer warpgroups of 128 x 128) with 64-deep contraction steps for gmm;
    for tgmm 128 x 256 output tiles over 64 rows a step. As many stages as shared memory holds,
    up to 4 (4 fit with a 16-bit output, 3 with fp32); the raster walks 16 m-tiles
    (gmm) or 8 k-tiles (tgmm) per n-tile, whose operands then fit L2 together."""
    if kernel == "tgmm":
        tiles = (64, _divisor_tile(k, 128, 64), _divisor_tile(n, 256, 16))
        raster = 8
    else:
        tiles = (128, _divisor_tile(k, 64, 16), _divisor_tile(n, 256, 16))
        raster = 16
    for stages in (4, 3, 2):
        config = Config(*tiles, num_warps=4, num_stages=stages, raster=raster)
        if mosaic_gpu_smem_bytes(kernel, tiles, config, dtype, out_dtype) <= MOSAIC_GPU_SMEM_LIMIT:
            return config
    return config
