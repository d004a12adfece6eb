"""The dense pieces of the transformer: RMSNorm, rotary embeddings, GQA causal attention, SwiGLU.

Pure functions over parameter dicts; shapes use the letters of `moejax.models._config`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.models._attention import causal_attention


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


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """`cos`, `sin` tables `[S, Dh/2]` (fp32) for positions `0..S-1`.

    Frequency `i` is `theta^(-2i/Dh)` (RoFormer; Llama, Mixtral).
    """
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate feature pairs `(i, i + Dh/2)` of every head by the position's angles.

    This is the "rotate-half" layout of the Hugging Face Llama/Mixtral code: the two halves of
    the head dim are the real and imaginary parts.

    Args:
      x: `[B, S, heads, Dh]`.
      cos, sin: `[S, Dh/2]` from `rope_tables`.

    Returns:
      `[B, S, heads, Dh]` in `x.dtype` (rotation in fp32).
    """
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
) -> jax.Array:
    """Causal self-attention with grouped query heads and RoPE.

    Each of the `Hkv` key/value heads serves `R = H / Hkv` consecutive query heads (query head
    `h` reads kv head `h // R`, as Hugging Face's `repeat_kv`). Scores and the softmax are fp32.
    The core is `moejax.models._attention.causal_attention`: flash-attention kernels on GPU and
    TPU (`implementation="auto"`, by compile target), the XLA reference on CPU.

    Args:
      p: `{"wq": [D, H, Dh], "wk": [D, Hkv, Dh], "wv": [D, Hkv, Dh], "wo": [H, Dh, D]}`.
      x: `[B, S, D]` (already normalised).
      cos, sin: `[S, Dh/2]` RoPE tables.
      mesh: with a mesh the core runs under `shard_map` (batch over the token axes, heads over
        `model`); the projections are left to the surrounding `jit`.
      implementation: the core's, `"auto"`, `"xla"` or `"pallas"`.

    Returns:
      `[B, S, D]`.
    """
    q = apply_rope(jnp.einsum("bsd,dhk->bshk", x, p["wq"]), cos, sin)
    k = apply_rope(jnp.einsum("bsd,dhk->bshk", x, p["wk"]), cos, sin)
    v = jnp.einsum("bsd,dhk->bshk", x, p["wv"])
    out = causal_attention(q, k, v, mesh=mesh, implementation=implementation)
    return jnp.einsum("bshk,hkd->bsd", out, p["wo"])


def swiglu_mlp(p: dict, x: jax.Array) -> jax.Array:
    """Dense SwiGLU MLP `(silu(x Wg) * x Wu) Wd`.

    Args:
      p: `{"w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]}`.
      x: `[..., D]`.

    Returns:
      `[..., D]`.
    """
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]
