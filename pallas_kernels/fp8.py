"""Block-scaled FP8 quantization, the DeepSeek-V3 recipe: pure jnp, any backend.

Activations take one fp32 scale per row per 128 columns (1 x 128 tiles, `quantize_rows`);
weights one per 128 x 128 block (`quantize_blocks`). A tile's scale is `amax / fmax` (`fmax`:
448 for e4m3, 57344 for e5m2), so its largest element maps to the format's largest finite value
and nothing saturates; an all-zero tile gets scale 1 (zeros, no division by zero). Tiles at the
edge of an axis that is not a multiple of 128 are partial: their scale covers the elements that
exist. `dequantize_*` multiplies back in fp32.

Hopper's fp8 wgmma reads both operands K-major (the contracted axis contiguous), so each matmul
of the backward wants its own layout (DeepGEMM's `nn` and `tn` grouped GEMMs):
  * forward `x [M, K] @ w [K, N]`: x rowwise along K; w as `[N, K]`, `transpose_blocks` of the
    weight's quantization (a 128 x 128 block's scale is the same either way round, so the
    weights are quantized once for both).
  * dlhs `dy [M, N] @ w^T`: dy rowwise along N; w as stored `[K, N]`.
  * weight gradient `x^T @ dy` (contract M): both transposed and quantized along M,
    `quantize_rows(x.T)`: 128 x 1 tiles of x.

Under `jit` XLA fuses each quantization (amax, scale, divide, cast) into one or two passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128  # elements per scale along a quantized axis
FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def fp8_dtype(name_or_dtype) -> jnp.dtype:
    """The fp8 dtype for "e4m3" (`float8_e4m3fn`) or "e5m2" (`float8_e5m2`), or one of them."""
    if isinstance(name_or_dtype, str) and name_or_dtype in FORMATS:
        return jnp.dtype(FORMATS[name_or_dtype])
    try:
        dtype = jnp.dtype(name_or_dtype)
    except TypeError:
        dtype = None
    if dtype not in [jnp.dtype(d) for d in FORMATS.values()]:
        raise ValueError(f"fp8 format must be one of {tuple(FORMATS)}, got {name_or_dtype!r}")
    return dtype


def fmax(dtype) -> float:
    """Largest finite value of an fp8 format (448 for e4m3, 57344 for e5m2)."""
    return float(jnp.finfo(fp8_dtype(dtype)).max)


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def _tile_amax(x: jax.Array, axes: tuple[int, ...], block: int) -> jax.Array:
    """Max |x| over `block`-wide tiles of each axis in `axes` (zero-padded at the edges), fp32.

    abs and max are exact in x's own float dtype, so the tile maxima are taken there and only
    they are widened: XLA then reads x once per reduction instead of writing an fp32 copy of it
    (twice that copy's size for bf16 inputs) and reading that back.
    """
    x = jnp.abs(x)
    pads = [(0, 0)] * x.ndim
    for a in axes:
        pads[a] = (0, _blocks(x.shape[a], block) * block - x.shape[a])
    x = jnp.pad(x, pads)
    shape, reduce = [], []
    for a, d in enumerate(x.shape):
        if a in axes:
            shape += [d // block, block]
            reduce.append(len(shape) - 1)
        else:
            shape.append(d)
    return jnp.max(x.reshape(shape), axis=tuple(reduce)).astype(jnp.float32)


def _expand(scale: jax.Array, shape, axes: tuple[int, ...], block: int) -> jax.Array:
    """Each scale repeated over its tile, cut to `shape`."""
    for a in axes:
        scale = jnp.repeat(scale, block, axis=a)
    return scale[tuple(slice(0, d) for d in shape)]


def tile_scale(amax: jax.Array, dtype) -> jax.Array:
    """The fp32 scale of tiles whose largest magnitudes are `amax`: `amax / fmax`, written as
    the product XLA would rewrite the division into anyway, so it is one correctly rounded fp32
    multiply on every backend (and in the fused Mosaic GPU quantizers). An all-zero tile gets
    scale 1: zeros back, not 0/0."""
    return jnp.where(amax > 0, amax * jnp.float32(1 / fmax(dtype)), 1.0).astype(jnp.float32)


def _quantize(x: jax.Array, dtype, axes: tuple[int, ...], block: int):
    dtype = fp8_dtype(dtype)
    big = fmax(dtype)
    scale = tile_scale(_tile_amax(x, axes, block), dtype)
    y = x.astype(jnp.float32) / _expand(scale, x.shape, axes, block)
    # x / (amax / fmax) can land a rounding step above fmax: clip so nothing becomes NaN.
    return jnp.clip(y, -big, big).astype(dtype), scale


def quantize_rows(x: jax.Array, dtype="e4m3", *, block: int = BLOCK):
    """1 x `block` tiles along the last axis (activations, gradients of activations).

    Args:
      x: `[..., K]` float.
      dtype: "e4m3" or "e5m2" (or the jnp dtype).
      block: tile width (128 in the recipe).

    Returns:
      `(q [..., K] fp8, scale [..., ceil(K / block)] fp32)`, `x ~= q * scale` per tile.

    >>> import jax.numpy as jnp
    >>> q, s = quantize_rows(jnp.array([[1.0, -2.0, 0.5]]))
    >>> s.tolist(), q.astype(jnp.float32).tolist()
    ([[0.004464285913854837]], [[224.0, -448.0, 112.0]])
    """
    return _quantize(x, dtype, (x.ndim - 1,), block)


def quantize_blocks(w: jax.Array, dtype="e4m3", *, block: int = BLOCK):
    """`block` x `block` tiles over the last two axes (weights).

    Args:
      w: `[..., K, N]` float (e.g. `[G, K, N]` expert weights).
      dtype: "e4m3" or "e5m2".
      block: tile side (128 in the recipe).

    Returns:
      `(q [..., K, N] fp8, scale [..., ceil(K / block), ceil(N / block)] fp32)`.
    """
    return _quantize(w, dtype, (w.ndim - 2, w.ndim - 1), block)


def dequantize_rows(q: jax.Array, scale: jax.Array, *, block: int = BLOCK) -> jax.Array:
    """fp32 `q * scale` for `quantize_rows` output (`q [..., K]`, `scale [..., ceil(K/block)]`)."""
    return q.astype(jnp.float32) * _expand(scale, q.shape, (q.ndim - 1,), block)


def dequantize_blocks(q: jax.Array, scale: jax.Array, *, block: int = BLOCK) -> jax.Array:
    """fp32 `q * scale` for `quantize_blocks` output."""
    return q.astype(jnp.float32) * _expand(scale, q.shape, (q.ndim - 2, q.ndim - 1), block)


def transpose_blocks(q: jax.Array, scale: jax.Array):
    """The block-quantized `w^T` (last two axes swapped) of a block-quantized `w`: the same
    tiles, so the K-major copy the forward needs costs a transpose, not a requantization."""
    return jnp.swapaxes(q, -1, -2), jnp.swapaxes(scale, -1, -2)


def quantize_cols(x: jax.Array, dtype="e4m3", *, block: int = BLOCK):
    """The transposed copy `x^T [K, M]` quantized along M (128 x 1 tiles of x): the operand
    layout of the weight gradient `x^T @ dy`, which contracts the rows.

    Args:
      x: `[M, K]`.
      dtype: "e4m3" or "e5m2".

    Returns:
      `(q [K, M] fp8, scale [K, ceil(M / block)] fp32)`.
    """
    # The scales are taken on x as it is laid out (a reduction over 128-row tiles) and only the
    # fp8 result is transposed: transposing x first made XLA write fp32 copies of x^T.
    q, scale = _quantize(x, dtype, (0,), block)
    return q.T, scale.T


def rounding_bound(dtype) -> float:
    """Relative rounding error of a normal fp8 value: half an ulp, 2^-(mantissa bits + 1)
    (2^-4 for e4m3, 2^-3 for e5m2). Values far below a tile's amax can fall into the format's
    subnormals, where the absolute error is at most half the smallest subnormal times the scale
    (`subnormal_bound`)."""
    return 2.0 ** -(jnp.finfo(fp8_dtype(dtype)).nmant + 1)


def subnormal_bound(dtype) -> float:
    """Absolute rounding error, in units of the tile scale, below the smallest normal value:
    half the smallest subnormal (2^-10 for e4m3, 2^-17 for e5m2)."""
    info = jnp.finfo(fp8_dtype(dtype))
    return float(info.smallest_subnormal) / 2


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """`silu(gate) * up` in fp32, written with `exp` and one division (what the fused Mosaic GPU
    quantizers lower), so the kernels and XLA evaluate the same expression."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    return gate / (1 + jnp.exp(-gate)) * up


def swiglu_grad(dh: jax.Array, gate: jax.Array, up: jax.Array):
    """`(dgate, dup)`, the gradients of `swiglu(gate, up)` for the output gradient `dh`, fp32:
    with `s = sigmoid(gate)`, `dgate = dh * up * s * (1 + gate * (1 - s))`, `dup = dh * gate * s`.
    """
    dh, gate, up = (a.astype(jnp.float32) for a in (dh, gate, up))
    s = 1 / (1 + jnp.exp(-gate))
    return dh * up * (s * (1 + gate * (1 - s))), dh * (gate * s)
