"""Public grouped-matmul ops: backend choice by compile target, padding to tiles, the VJP.

Backends (`backend=`):
  * "auto": by the platform the program is compiled for (`jax.lax.platform_dependent`, decided
    at lowering, not from the host): Pallas-TPU (Mosaic) on TPU; on an NVIDIA GPU, Pallas
    Mosaic GPU (warp-specialized wgmma kernels) for a Hopper target with 16-bit operands and
    Pallas-Triton otherwise (older GPUs, fp32, ROCm); the pure-jnp reference elsewhere (CPU).
  * "pallas": the Pallas kernels everywhere: as "auto" on GPU and TPU, and on any other
    platform the Triton kernel in interpret mode (Triton semantics, what the CPU tests run).
  * "reference", "pallas_triton", "pallas_mosaic_gpu", "pallas_tpu": that one, whatever the
    target. `interpret=True` runs a Pallas kernel in interpret mode on any platform
    (`pltpu.InterpretParams()` for the TPU kernel's memory semantics; the Mosaic GPU kernels
    always run under their own interpreter, `mgpu_compat.interpret_params()`).

Which GPU a program is compiled for is read from the compile target, never from the host:
the current abstract mesh's device (`jax.set_mesh` / `targets.lowering` on a deviceless mesh),
else the default device (`targets.gpu_kind`); a GPU target that names no device (a bare
`.lower(lowering_platforms=("cuda",))`) is taken to be a Hopper GPU.

The Mosaic GPU kernels need every group to start on their row tile. `group_alignment` is the
caller's static promise that every group size is a multiple of it (`moejax`'s permute pads
experts to `GROUP_ALIGNMENT`); otherwise the op moves rows into an aligned layout and back (two
gathers, `metadata.align_rows`).

Because "auto" and "pallas" are decided at lowering, a deviceless compile for an H100 or TPU mesh
on a CPU host runs the real kernels: the compiled program holds the Triton or Mosaic calls.

Pallas paths pad M, K, N up to tile multiples with zeros (an extra copy of lhs/rhs when the
shapes are not multiples; zero padding adds nothing to any product) and slice the result back.
Tiles come from `config` (one Config for every kernel, or a dict by kernel name) or, per kernel
and backend, from `config.default_config`; a tile that cannot fit the target is an error before
anything compiles (`config.check_fits`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import metadata as md
from pallas_kernels import mgpu_compat, mosaic_gpu, targets, tpu, triton, tuned, vma
from pallas_kernels.config import (
    BACKENDS,
    GROUP_ALIGNMENT,
    Config,
    check_fits,
    check_mosaic_gpu_dtype,
    default_config,
    effective_tiles,
    round_up,
)
from pallas_kernels.reference import _check_num_groups, reference_gmm, reference_tgmm

Configs = Config | Mapping[str, Config] | None


def _validate(lhs, rhs, group_sizes, *, rhs_ndim: int) -> jax.Array:
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
    if rhs.ndim != rhs_ndim:
        raise ValueError(f"rhs must have {rhs_ndim} dims, got shape {rhs.shape}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be a 1-D integer array, got {group_sizes.shape} {group_sizes.dtype}"
        )
    return group_sizes.astype(jnp.int32)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_alignment(group_alignment) -> None:
    if not isinstance(group_alignment, int) or group_alignment <= 0:
        raise ValueError(f"group_alignment must be a positive int, got {group_alignment!r}")


def _pad(x: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
    """Zero-pads each axis of x up to a multiple of the matching entry (1 = leave alone)."""
    widths = [(0, round_up(d, t) - d) for d, t in zip(x.shape, multiples, strict=True)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def same_varying_axes(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """Inside shard_map(check_vma=True), cast all operands to vary over the same mesh axes, as
    pallas_call requires (the kernels then declare their output varying over those axes).

    Differentiable ops cast *before* their custom VJP: the VJP's cotangents then vary like its
    (cast) primals, and autodiff turns each cast into the `psum` the gradient of a less-varying
    operand needs (e.g. expert weights replicated over `data` meeting tokens split over it).
    """
    axes = vma.varying_axes(*xs)
    return tuple(vma.cast_varying(x, axes) for x in xs)


def _common_dtype(lhs: jax.Array, rhs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Kernels multiply one input dtype (Mosaic rejects mixed dots): promote the other operand.
    Mixed inputs arise in the VJP of `preferred_element_type=float32` with bf16 operands."""
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    return lhs.astype(dtype), rhs.astype(dtype)


def _out_dtype(preferred_element_type, lhs: jax.Array):
    return jnp.dtype(preferred_element_type or lhs.dtype)


def kernel_config(
    configs: Configs, kernel: str, backend: str, dtype, m, k, n, g, out_dtype=None
) -> Config:
    """The Config for `kernel`: given (one for all kernels, or by kernel name), else autotuned
    (Pallas-Triton gmm, if cached), else `default_config`."""
    if isinstance(configs, Config):
        return configs
    if configs is not None and kernel in configs:
        return configs[kernel]
    if backend == "pallas_triton" and kernel in ("gmm", "gmm_t"):
        found = tuned.cached_config(tuned.cache_key(m, k, n, g, dtype, kernel=kernel))
        if found is not None:
            return found
    return default_config(kernel, backend, dtype, m, k, n, g, out_dtype=out_dtype)


def tiled(configs: Configs, kernel: str, backend: str, interpret, dtype, out_dtype, m, k, n, g):
    """(config, effective tiles) for one kernel call, checked against the target unless the
    kernel is interpreted (interpret mode has no shared memory or VMEM limit)."""
    config = kernel_config(configs, kernel, backend, dtype, m, k, n, g, out_dtype)
    tiles = effective_tiles(config, m, k, n, kernel=kernel, backend=backend)
    if not interpret:
        check_fits(kernel, backend, config, tiles, dtype, out_dtype, dims=(m, k, n))
    return config, tiles


def gpu_backend(dtype) -> str:
    """The NVIDIA GPU kernels "auto" and "pallas" compile to for operands of `dtype`:
    "pallas_mosaic_gpu" on a Hopper target (or a GPU target that names no device) for 16-bit
    operands, else "pallas_triton" (pre-Hopper GPUs, fp32: Triton's TF32 kernels)."""
    kind = targets.gpu_kind()
    hopper = kind is None or targets.is_hopper(kind)
    try:
        check_mosaic_gpu_dtype(dtype)
    except TypeError:
        return "pallas_triton"
    return "pallas_mosaic_gpu" if hopper else "pallas_triton"


def group_alignment() -> int:
    """The group alignment at which `backend="pallas"` runs without moving rows on the current
    compile target: `GROUP_ALIGNMENT` (128) for a Hopper GPU (`targets.gpu_kind`), whose Mosaic
    GPU kernels need groups on their row tile, else 1 (no padding: other kernels handle groups
    that straddle tiles). What `moejax` pads experts to for `implementation="pallas"`."""
    return GROUP_ALIGNMENT if targets.is_hopper(targets.gpu_kind()) else 1


def on_target(backend: str, interpret, make: Callable[[str, Any], Callable], *args):
    """`make(concrete_backend, interpret)(*args)`, with "auto" and "pallas" resolved by the
    platform the program is lowered for (see the module docstring); args[0] is the lhs, whose
    dtype picks the GPU kernels."""
    _check_backend(backend)
    if interpret or backend == "pallas":  # "pallas" interprets where no kernel compiles
        vma.install_interpret_fix()
    if backend not in ("auto", "pallas"):
        return make(backend, interpret)(*args)
    if backend == "auto":
        fallback = make("reference", False)
    else:
        fallback = make("pallas_triton", interpret or True)
    return jax.lax.platform_dependent(
        *args,
        tpu=make("pallas_tpu", interpret),
        cuda=make(gpu_backend(args[0].dtype), interpret),
        rocm=make("pallas_triton", interpret),
        default=fallback,
    )


def _take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _mosaic_gmm(lhs, rhs, group_sizes, cfg, tiles, *, transpose_rhs, out_dtype, interpret,
                group_alignment):  # fmt: skip
    """gmm on Mosaic GPU: rows realigned to the row tile unless the caller's groups are."""
    check_mosaic_gpu_dtype(lhs.dtype)
    tm, tk, tn = tiles
    m = lhs.shape[0]
    aligned = group_alignment % tm == 0
    if not aligned:
        layout = md.align_rows(group_sizes, m=m, tm=tm)
        lhs, group_sizes = _take_rows(lhs, layout.source), layout.group_sizes
    lhs_p = _pad(lhs, (tm, tk))
    rhs_p = _pad(rhs, (1, tn, tk) if transpose_rhs else (1, tk, tn))
    tile_group = md.aligned_tile_groups(group_sizes, m=lhs_p.shape[0], tm=tm)
    out = mosaic_gpu.gmm(
        lhs_p, rhs_p, tile_group, tiles=tiles, config=cfg, transpose_rhs=transpose_rhs,
        out_dtype=out_dtype, interpret=mgpu_compat.interpret_mode(interpret),
    )  # fmt: skip
    return out[:m] if aligned else _take_rows(out, layout.dest)


def _mosaic_tgmm(lhs, rhs, group_sizes, cfg, tiles, *, out_dtype, interpret, group_alignment):
    """tgmm on Mosaic GPU: rows realigned to the contraction tile unless the groups are."""
    check_mosaic_gpu_dtype(lhs.dtype)
    tm, tk, tn = tiles
    if group_alignment % tm:
        layout = md.align_rows(group_sizes, m=lhs.shape[0], tm=tm)
        lhs, rhs = _take_rows(lhs, layout.source), _take_rows(rhs, layout.source)
        group_sizes = layout.group_sizes
    return mosaic_gpu.tgmm(
        _pad(lhs, (tm, tk)), _pad(rhs, (tm, tn)), group_sizes, tiles=tiles, config=cfg,
        out_dtype=out_dtype, interpret=mgpu_compat.interpret_mode(interpret),
    )  # fmt: skip


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    preferred_element_type=None,
    backend: str = "auto",
    config: Configs = None,
    interpret: Any = False,
    group_alignment: int = 1,
) -> jax.Array:
    """Grouped matmul: rows of group g of lhs times rhs[g]. Not differentiable (see
    `grouped_matmul`).

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [G, K, N], or [G, N, K] with transpose_rhs.
      group_sizes: [G] integer, sum(group_sizes) <= M (not checked: it is traced).
      transpose_rhs: rhs is given as [G, N, K].
      preferred_element_type: output dtype; None means lhs.dtype. Accumulation is fp32.
      backend: one of `BACKENDS` (see the module docstring).
      config: tiles; None means the default for the kernel, backend, dtype and shape. With
        "auto" or "pallas" a given Config is used (and checked) on every target the program
        may be compiled for; name a backend to tile for one.
      interpret: run Pallas kernels in interpret mode.
      group_alignment: every group size is a multiple of this (a static promise, not checked:
        the sizes are traced); Mosaic GPU skips realigning rows when it is a multiple of its
        row tile (see the module docstring).

    Returns:
      [M, N]; rows past sum(group_sizes) are zero.

    >>> import jax.numpy as jnp
    >>> out = gmm(jnp.ones((3, 2)), jnp.ones((2, 2, 4)), jnp.array([2, 0], jnp.int32))
    >>> out[:, 0].tolist()
    [2.0, 2.0, 0.0]
    """
    group_sizes = _validate(lhs, rhs, group_sizes, rhs_ndim=3)
    _check_backend(backend)
    _check_alignment(group_alignment)
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    m, k, n, g = lhs.shape[0], lhs.shape[1], rhs.shape[n_axis], group_sizes.shape[0]
    if rhs.shape[k_axis] != k or rhs.shape[0] != g:
        raise ValueError(
            f"rhs shape {rhs.shape} (transpose_rhs={transpose_rhs}) does not match lhs "
            f"{lhs.shape} and group_sizes {group_sizes.shape}"
        )
    out_dtype = _out_dtype(preferred_element_type, lhs)
    if 0 in (m, k, n, g):  # an empty grid: the answer is all zeros
        return jnp.zeros((m, n), out_dtype)
    kernel = "gmm_t" if transpose_rhs else "gmm"

    def make(concrete, interp):
        def run(lhs, rhs, group_sizes):
            if concrete == "reference":
                return reference_gmm(
                    lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                    preferred_element_type=out_dtype,
                )  # fmt: skip
            cfg, tiles = tiled(config, kernel, concrete, interp, lhs.dtype, out_dtype, m, k, n, g)
            if concrete == "pallas_mosaic_gpu":
                return _mosaic_gmm(
                    lhs, rhs, group_sizes, cfg, tiles, transpose_rhs=transpose_rhs,
                    out_dtype=out_dtype, interpret=interp, group_alignment=group_alignment,
                )[:, :n]  # fmt: skip
            tm, tk, tn = tiles
            lhs_p = _pad(lhs, (tm, tk))
            rhs_p = _pad(rhs, (1, tn, tk) if transpose_rhs else (1, tk, tn))
            kw = dict(
                tiles=tiles, transpose_rhs=transpose_rhs, out_dtype=out_dtype, interpret=interp
            )
            if concrete == "pallas_tpu":
                out = tpu.gmm(lhs_p, rhs_p, group_sizes, **kw)
            else:
                out = triton.gmm(lhs_p, rhs_p, group_sizes, config=cfg, **kw)
            return out[:m, :n]

        return run

    lhs, rhs = _common_dtype(lhs, rhs)
    return on_target(backend, interpret, make, *same_varying_axes(lhs, rhs, group_sizes))


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    num_groups: int | None = None,
    *,
    preferred_element_type=None,
    backend: str = "auto",
    config: Configs = None,
    interpret: Any = False,
    group_alignment: int = 1,
) -> jax.Array:
    """Per-group transposed product, the weight gradient of gmm: out[g] = lhs_g^T @ rhs_g.

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [M, N], same row order.
      group_sizes: [G] integer, sum(group_sizes) <= M.
      num_groups: G; must equal group_sizes.shape[0] if given.
      preferred_element_type: output dtype; None means lhs.dtype. Accumulation is fp32.
      backend, config, interpret, group_alignment: as for `gmm` (tgmm has its own default
        tiles).

    Returns:
      [G, K, N]; empty groups give zeros.
    """
    group_sizes = _validate(lhs, rhs, group_sizes, rhs_ndim=2)
    _check_backend(backend)
    _check_alignment(group_alignment)
    _check_num_groups(num_groups, group_sizes)
    if rhs.shape[0] != lhs.shape[0]:
        raise ValueError(f"lhs {lhs.shape} and rhs {rhs.shape} must have the same M")
    m, k, n, g = lhs.shape[0], lhs.shape[1], rhs.shape[1], group_sizes.shape[0]
    out_dtype = _out_dtype(preferred_element_type, lhs)
    if 0 in (m, k, n, g):
        return jnp.zeros((g, k, n), out_dtype)

    def make(concrete, interp):
        def run(lhs, rhs, group_sizes):
            if concrete == "reference":
                return reference_tgmm(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
            cfg, tiles = tiled(config, "tgmm", concrete, interp, lhs.dtype, out_dtype, m, k, n, g)
            if concrete == "pallas_mosaic_gpu":
                out = _mosaic_tgmm(
                    lhs, rhs, group_sizes, cfg, tiles, out_dtype=out_dtype, interpret=interp,
                    group_alignment=group_alignment,
                )  # fmt: skip
                return out[:, :k, :n]
            tm, tk, tn = tiles
            lhs_p, rhs_p = _pad(lhs, (tm, tk)), _pad(rhs, (tm, tn))
            kw = dict(tiles=tiles, out_dtype=out_dtype, interpret=interp)
            if concrete == "pallas_tpu":
                out = tpu.tgmm(lhs_p, rhs_p, group_sizes, **kw)
            else:
                out = triton.tgmm(lhs_p, rhs_p, group_sizes, config=cfg, **kw)
            return out[:, :k, :n]

        return run

    lhs, rhs = _common_dtype(lhs, rhs)
    return on_target(backend, interpret, make, *same_varying_axes(lhs, rhs, group_sizes))


def hashable_configs(config: Configs):
    """`config` in a form custom_vjp can take as a static argument (dicts become item tuples)."""
    if config is None or isinstance(config, Config):
        return config
    return tuple(sorted(config.items()))


def _configs(static) -> Configs:
    return dict(static) if isinstance(static, tuple) else static


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _grouped_matmul(
    lhs, rhs, group_sizes, transpose_rhs, out_dtype, backend, config, interpret, alignment
):
    return gmm(
        lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype,
        backend=backend, config=_configs(config), interpret=interpret, group_alignment=alignment,
    )  # fmt: skip


def _fwd(lhs, rhs, group_sizes, transpose_rhs, out_dtype, backend, config, interpret, alignment):
    out = _grouped_matmul(
        lhs, rhs, group_sizes, transpose_rhs, out_dtype, backend, config, interpret, alignment
    )
    return out, (lhs, rhs, group_sizes)


def _bwd(transpose_rhs, out_dtype, backend, config, interpret, alignment, residuals, dout):
    lhs, rhs, group_sizes = residuals
    opts = dict(
        backend=backend, config=_configs(config), interpret=interpret, group_alignment=alignment
    )
    if backend == "pallas_mosaic_gpu" and dout.dtype != lhs.dtype:
        # A wider cotangent (an fp32 output's) in the operands' 16-bit dtype: the Mosaic GPU
        # kernels multiply 16-bit operands only.
        dout = dout.astype(lhs.dtype)
    # dlhs[rows of g] = dout[rows of g] @ rhs[g]^T: the same gmm with the other rhs layout.
    dlhs = gmm(
        dout, rhs, group_sizes, transpose_rhs=not transpose_rhs,
        preferred_element_type=lhs.dtype, **opts,
    )  # fmt: skip
    # drhs[g] = lhs_g^T @ dout_g ([G, K, N]); for rhs stored [G, N, K] swap the operands.
    if transpose_rhs:
        drhs = tgmm(dout, lhs, group_sizes, preferred_element_type=rhs.dtype, **opts)
    else:
        drhs = tgmm(lhs, dout, group_sizes, preferred_element_type=rhs.dtype, **opts)
    return dlhs, drhs, None  # group_sizes is integer: no cotangent


_grouped_matmul.defvjp(_fwd, _bwd)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    preferred_element_type=None,
    backend: str = "auto",
    config: Configs = None,
    interpret: Any = False,
    group_alignment: int = 1,
) -> jax.Array:
    """Differentiable `gmm` (custom VJP: dlhs by gmm with the transposed rhs, drhs by tgmm).

    Safe inside `jax.shard_map(check_vma=True)`: operands are cast to common varying axes before
    the VJP, so every cotangent varies like its primal (see `same_varying_axes`).

    Args:
      lhs: [M, K], rows sorted by group.
      rhs: [G, K, N], or [G, N, K] with transpose_rhs.
      group_sizes: [G] integer, sum(group_sizes) <= M; not differentiated.
      transpose_rhs, preferred_element_type, backend, interpret, group_alignment: as for `gmm`.
      config: one Config for all three kernels, or a dict from "gmm", "gmm_t", "tgmm" to
        Configs (missing kernels get their defaults); None: every kernel's default.

    Returns:
      [M, N]; rows past sum(group_sizes) are zero (and get zero lhs gradient).

    >>> import jax, jax.numpy as jnp
    >>> f = lambda w: grouped_matmul(jnp.ones((3, 2)), w, jnp.array([1, 2], jnp.int32)).sum()
    >>> jax.grad(f)(jnp.ones((2, 2, 1)))[:, 0, 0].tolist()
    [1.0, 2.0]
    """
    group_sizes = _validate(lhs, rhs, group_sizes, rhs_ndim=3)
    _check_backend(backend)
    _check_alignment(group_alignment)
    out_dtype = _out_dtype(preferred_element_type, lhs)
    lhs, rhs, group_sizes = same_varying_axes(lhs, rhs, group_sizes)
    return _grouped_matmul(
        lhs, rhs, group_sizes, transpose_rhs, out_dtype, backend, hashable_configs(config),
        interpret, group_alignment,
    )  # fmt: skip
