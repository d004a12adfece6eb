"""The dense pieces of the transformer: RMSNorm, rotary embeddings, GQA causal attention, SwiGLU,
the logits of the unembedding.

Pure functions over parameter dicts; shapes use the letters of `moejax.models._config`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from moejax import _wgrad
from moejax.models._attention import (
    XLA_SCOPES,
    causal_attention,
    masked_attention,
    note_xla_fallback,
)
from pallas_kernels.vma import match_varying


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm with the statistic in fp32 (as Llama/Mixtral), output in `x.dtype`.

    Args:
      x: `[..., D]`.
      scale: `[D]` learned gain.
      eps: added to the mean square.

    Returns:
      `[..., D]` `x / rms(x) * scale`.
    """
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv).astype(x.dtype) * scale.astype(x.dtype)


@jax.custom_vjp
def unembed_logits(x: jax.Array, unembed: jax.Array) -> jax.Array:
    """`[B, S, V]` fp32 logits `x @ unembed` (`x [B, S, D]`, `unembed [D, V]`), accumulated in
    fp32 from operands in their own dtype.

    With 16-bit operands the backward multiplies 16-bit operands too: the logits' fp32
    cotangent is rounded to their dtype first (the mixed-precision recipe of PyTorch autocast
    and MaxText), and both gradient matmuls accumulate in fp32. Differentiating the
    fp32-output einsum instead multiplies the fp32 cotangent by fp32 copies of the weights and
    activations: fp32 matmuls, TF32 on a GPU at half the bf16 rate, and the largest matmuls of
    a shallow model (`experiments/step_breakdown.py`). With fp32 operands the backward is
    autodiff's."""
    return _logits(x, unembed)


def _logits(x, unembed):
    return jnp.einsum("bsd,dv->bsv", x, unembed, preferred_element_type=jnp.float32)


def _unembed_logits_fwd(x, unembed):
    return _logits(x, unembed), (x, unembed)


def _unembed_logits_bwd(res, d_logits):
    x, unembed = res
    dtype = jnp.result_type(x, unembed)
    if dtype == jnp.float32:
        return jax.vjp(_logits, x, unembed)[1](d_logits)
    g = d_logits.astype(dtype)
    dx = jnp.einsum("bsv,dv->bsd", g, unembed, preferred_element_type=jnp.float32)
    dw = jnp.einsum("bsd,bsv->dv", x, g, preferred_element_type=jnp.float32)
    return match_varying(dx.astype(x.dtype), x), match_varying(dw.astype(unembed.dtype), unembed)


unembed_logits.defvjp(_unembed_logits_fwd, _unembed_logits_bwd)


def rope_frequencies(head_dim: int, theta: float, scaling=None) -> tuple[np.ndarray, float]:
    """RoPE inverse frequencies `[Dh/2]` (float32) and the factor cos/sin are scaled by.

    Without `scaling` frequency `i` is `theta^(-2i/Dh)` (RoFormer; Llama, Mixtral). With a
    `moejax.models.RopeScaling`, transcribed from transformers' `modeling_rope_utils`
    (`_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
    `_compute_yarn_parameters`, transformers 4.5x/5.x):

    - linear: every frequency divided by `factor`;
    - llama3: wavelengths above `original / low_freq_factor` divided by `factor`, below
      `original / high_freq_factor` kept, a linear ramp in `original / wavelength` between;
    - yarn: a ramp over the rotation counts `[beta_slow, beta_fast]` (at the original length)
      between extrapolated (`theta^(-2i/Dh)`) and interpolated (divided by `factor`)
      frequencies; cos and sin scaled by the attention factor.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    base = (1.0 / theta**exponents).astype(np.float32)
    if scaling is None:
        return base, 1.0
    if scaling.kind == "linear":
        return (base / np.float32(scaling.factor)).astype(np.float32), 1.0
    if scaling.kind == "llama3":
        return _llama3_frequencies(base, scaling), 1.0
    return _yarn_frequencies(head_dim, theta, scaling)


def _llama3_frequencies(inv_freq: np.ndarray, sc) -> np.ndarray:
    old = sc.original_max_position_embeddings
    low_wavelen, high_wavelen = old / sc.low_freq_factor, old / sc.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_frequencies(dim: int, base: float, sc) -> tuple[np.ndarray, float]:
    factor, old = sc.factor, sc.original_max_position_embeddings
    attention = sc.attention_factor
    if attention is None:
        if sc.mscale and sc.mscale_all_dim:
            attention = _yarn_mscale(factor, sc.mscale) / _yarn_mscale(factor, sc.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero (as transformers)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the extrapolation share
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq.astype(np.float32), float(attention)


def rope_tables(
    seq_len: int, head_dim: int, theta: float, scaling=None
) -> tuple[jax.Array, jax.Array]:
    """`cos`, `sin` tables `[S, Dh/2]` (fp32) for positions `0..S-1` (`rope_frequencies`; with
    yarn scaling both are multiplied by its attention factor)."""
    if scaling is None:  # computed on device as it always was: identical numerics
        inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
        factor = 1.0
    else:
        inv_freq, factor = rope_frequencies(head_dim, theta, scaling)
        inv_freq = jnp.asarray(inv_freq)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    if factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate feature pairs `(i, i + R/2)` of the first `R = 2 * cos.shape[-1]` features of every
    head by the position's angles; features past `R` pass through unchanged (partial rotary,
    `LMConfig.partial_rotary_factor`; `R = Dh` rotates all).

    This is the "rotate-half" layout of the Hugging Face Llama/Mixtral code: the two halves of
    the rotated features are the real and imaginary parts.

    Args:
      x: `[B, S, heads, Dh]`.
      cos, sin: `[S, R/2]` from `rope_tables`, `R <= Dh`.

    Returns:
      `[B, S, heads, Dh]` in `x.dtype` (rotation in fp32).
    """
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]], axis=-1)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def attention(
    p: dict,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    mesh=None,
    implementation: str = "auto",
    qk_norm: str | None = None,
    norm_eps: float = 1e-5,
    wgrad_slots: dict | None = None,
    window: int | None = None,
) -> jax.Array:
    """Causal self-attention with grouped query heads and RoPE.

    Each of the `Hkv` key/value heads serves `R = H / Hkv` consecutive query heads (query head
    `h` reads kv head `h // R`, as Hugging Face's `repeat_kv`). Scores and the softmax are fp32.
    The core is `moejax.models._attention.causal_attention`: flash-attention kernels on GPU and
    TPU (`implementation="auto"`, by compile target), the XLA reference on CPU.

    Optional pieces, present in `p` as the model config asks (`LMConfig.attention_bias`,
    `attention_out_bias`, `qk_norm`): biases of the projections, and RMSNorm of queries and keys
    after their projections (and biases), before RoPE.

    Args:
      p: `{"wq": [D, H, Dh], "wk": [D, Hkv, Dh], "wv": [D, Hkv, Dh], "wo": [H, Dh, D]}`, and
        `"bq" [H, Dh]`, `"bk", "bv" [Hkv, Dh]` (attention bias), `"bo" [D]` (output bias),
        `"q_norm", "k_norm": {"scale"}` (`[Dh]` for `qk_norm="head"`, `[H, Dh]` resp.
        `[Hkv, Dh]` for `"full"`).
      x: `[B, S, D]` (already normalised).
      cos, sin: `[S, R/2]` RoPE tables (`apply_rope`: the first `R` features of a head rotate).
      mesh: with a mesh the core runs under `shard_map` (batch over the token axes, heads over
        `model`); the projections are left to the surrounding `jit`.
      implementation: the core's, `"auto"`, `"xla"` or `"pallas"`.
      qk_norm: None, `"head"` (over `Dh`) or `"full"` (over all heads' features together).
      norm_eps: the query/key RMSNorm epsilon.
      wgrad_slots: None, or the slots of `moejax.models._wgrad.collect` for `wq`, `wk`, `wv`
        and `wo`: the projections' weight gradients are then computed there (the numbers are
        the same).
      window: None, or a sliding window (`LMConfig.layer_types`). With a window or attention
        sinks (`"sinks" [H]` in `p`) the core is the XLA one
        (`moejax.models._attention.masked_attention`, under the named scope
        `xla_attention_sinks_window`, which compiled programs show) on every platform: jax's
        flash-attention kernels have neither (`note_xla_fallback` says so once, on stderr).

    Returns:
      `[B, S, D]`.
    """
    q = _project(x, p, "q", wgrad_slots)
    k = _project(x, p, "k", wgrad_slots)
    v = _project(x, p, "v", wgrad_slots)
    if qk_norm is not None:
        q = _qk_norm(q, p["q_norm"]["scale"], qk_norm, norm_eps)
        k = _qk_norm(k, p["k_norm"]["scale"], qk_norm, norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if window is None and "sinks" not in p:
        out = causal_attention(q, k, v, mesh=mesh, implementation=implementation)
    else:
        note_xla_fallback("sinks_window", implementation)
        with jax.named_scope(XLA_SCOPES["sinks_window"]):
            out = masked_attention(
                q, k, v, 0, scale=q.shape[-1] ** -0.5, window=window, sinks=p.get("sinks")
            )
    out = _einsum(out, p, "wo", wgrad_slots)
    return out + p["bo"] if "bo" in p else out


def _project(x: jax.Array, p: dict, name: str, slots: dict | None) -> jax.Array:
    """`x [B, S, D]` through `w{name} [D, heads, Dh]` (+ `b{name} [heads, Dh]`)."""
    y = _einsum(x, p, f"w{name}", slots)
    return y + p[f"b{name}"] if f"b{name}" in p else y


def _einsum(x: jax.Array, p: dict, name: str, slots: dict | None) -> jax.Array:
    """`x` through the projection `p[name]` (`_wgrad.ATTENTION_SPECS`), its weight gradient
    left to `slots[name]` where `slots` is given."""
    spec = _wgrad.ATTENTION_SPECS[name]
    if slots is None:
        return jnp.einsum(spec, x, p[name])
    hands_back_x, slot = _wgrad.slot_of(slots, name)
    return _wgrad.project(spec, hands_back_x, x, p[name], slot)


def _qk_norm(x: jax.Array, scale: jax.Array, mode: str, eps: float) -> jax.Array:
    """RMSNorm of `x [B, S, heads, Dh]` per head (`"head"`, `scale [Dh]`) or over all heads
    together (`"full"`, `scale [heads, Dh]`)."""
    if mode == "head":
        return rms_norm(x, scale, eps)
    b, s, h, dh = x.shape
    return rms_norm(x.reshape(b, s, h * dh), scale.reshape(h * dh), eps).reshape(b, s, h, dh)


def swiglu_mlp(p: dict, x: jax.Array) -> jax.Array:
    """Dense SwiGLU MLP `(silu(x Wg) * x Wu) Wd`.

    Args:
      p: `{"w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]}`.
      x: `[..., D]`.

    Returns:
      `[..., D]`.
    """
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]
