"""Multi-head latent attention (MLA, DeepSeek-V2/V3): queries and keys/values through low-rank
latents, a rotary part of the head shared by all heads, a KV cache of the latent.

For `x [B, S, D]` (Hugging Face `DeepseekV3Attention`, transformers 4.5x/5.x):

```
q       = (rms_norm(x Wq_a) Wq_b  if q_lora_rank else  x Wq)        [B, S, H, Dn + Dr]
q_nope, q_rope = split(q, [Dn, Dr])
c, k_rope = split(x Wkv_a, [Rkv, Dr])                              [B, S, Rkv], [B, S, Dr]
c       = rms_norm(c)                                              (the cached latent)
k_nope, v = split(c Wkv_b, [Dn, Dv])                               [B, S, H, Dn], [B, S, H, Dv]
q_rope, k_rope = rope(q_rope), rope(k_rope)        (k_rope one head, shared by all H)
out     = softmax([q_nope, q_rope] . [k_nope, k_rope] * scale, causal) v     [B, S, H, Dv]
y       = out Wo                                                   [B, S, D]
```

`scale = (Dn + Dr)**-0.5`, times `mscale**2` under yarn scaling with `mscale_all_dim`
(`0.1 * mscale_all_dim * ln(factor) + 1`), whose cos/sin carry yarn's attention factor too.
With `rope_interleave` (DeepSeek-V3's checkpoints) the rotary features are pairs `(2i, 2i+1)`:
they are reordered to halves (evens, then odds) and rotated as `apply_rope`'s halves, which is
transformers' `apply_rotary_pos_emb_interleave`; the same reordering of queries and keys leaves
their dot products those of the rotation of pairs.

Parameters (`init_lm_params`; logical axes in `moejax.models._sharding`): `wq [D, H, Dn+Dr]` or
`wq_a [D, Rq]`, `q_a_norm/scale [Rq]`, `wq_b [Rq, H, Dn+Dr]`; `wkv_a [D, Rkv+Dr]`,
`kv_a_norm/scale [Rkv]`, `wkv_b [Rkv, H, Dn+Dv]`, `wo [H, Dv, D]`.

The core is the XLA one (`masked_attention`, fp32 scores and softmax, under the named scope
`xla_attention_mla`), on every platform: jax's flash-attention kernels want one head dim for q,
k and v.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.models._attention import XLA_SCOPES, masked_attention
from moejax.models._layers import _yarn_mscale, apply_rope, rms_norm


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """The shapes of multi-head latent attention (module docstring). Frozen and validated.

    Args:
      kv_lora_rank: `Rkv`, the cached latent's width.
      qk_nope_head_dim: `Dn`, the per-head query/key features without rotary embedding.
      qk_rope_head_dim: `Dr`, the rotary features (one key head shared by all heads); even.
      v_head_dim: `Dv`, the per-head value width (may differ from `Dn + Dr`).
      q_lora_rank: `Rq`, the query latent's width; None: a full-rank query projection.
      rope_interleave: rotary pairs are adjacent features (DeepSeek-V3), not halves.
      latent_norm_eps: the epsilon of the query and key/value latents' RMSNorms; None: the
        model's `LMConfig.norm_eps`. Hugging Face's DeepSeek-V2/V3 and GLM-4.7-Flash modules
        leave these two at RMSNorm's default 1e-6 whatever `rms_norm_eps` says, so
        `lm_config_from_hf` sets 1e-6.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True
    latent_norm_eps: float | None = None

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        eps = self.latent_norm_eps
        if eps is not None and (
            isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1
        ):
            raise ValueError(f"MLAConfig.latent_norm_eps={eps!r}: must be None or in (0, 1)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MLAConfig.qk_rope_head_dim={self.qk_rope_head_dim}: must be even (RoPE pairs)"
            )

    @property
    def qk_head_dim(self) -> int:
        """`Dn + Dr`, the query/key head width."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def replace(self, **changes) -> MLAConfig:
        return dataclasses.replace(self, **changes)


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"MLAConfig.{name}={value!r}: must be a positive int")


def softmax_scale(cfg) -> float:
    """`(Dn + Dr)**-0.5`, times yarn's `mscale(factor, mscale_all_dim)**2` where given."""
    scale = cfg.mla.qk_head_dim**-0.5
    sc = cfg.rope_scaling
    if sc is not None and sc.kind == "yarn" and sc.mscale_all_dim:
        scale *= _yarn_mscale(sc.factor, sc.mscale_all_dim) ** 2
    return scale


def init_mla_params(cfg, key, normal, out_std_scale: float) -> dict:
    """One layer's MLA parameters (module docstring); `normal(key, shape, std, dtype)`."""
    m, d, h = cfg.mla, cfg.d_model, cfg.num_heads
    dtype = jnp.dtype(cfg.param_dtype)
    kq, kq2, kkv, kkv2, ko = jax.random.split(key, 5)
    p = {}
    if m.q_lora_rank is None:
        p["wq"] = normal(kq, (d, h, m.qk_head_dim), d**-0.5, dtype)
    else:
        r = m.q_lora_rank
        p["wq_a"] = normal(kq, (d, r), d**-0.5, dtype)
        p["q_a_norm"] = {"scale": jnp.ones((r,), dtype)}
        p["wq_b"] = normal(kq2, (r, h, m.qk_head_dim), r**-0.5, dtype)
    r = m.kv_lora_rank
    p["wkv_a"] = normal(kkv, (d, r + m.qk_rope_head_dim), d**-0.5, dtype)
    p["kv_a_norm"] = {"scale": jnp.ones((r,), dtype)}
    p["wkv_b"] = normal(kkv2, (r, h, m.qk_nope_head_dim + m.v_head_dim), r**-0.5, dtype)
    p["wo"] = normal(ko, (h, m.v_head_dim, d), (h * m.v_head_dim) ** -0.5 * out_std_scale, dtype)
    return p


def mla_logical_axes(cfg) -> dict:
    """Logical axes of one layer's MLA tree: `D` over FSDP, heads over `model`."""
    axes = {
        "wkv_a": ("D", None),
        "kv_a_norm": {"scale": (None,)},
        "wkv_b": (None, "H", None),
        "wo": ("H", None, "D"),
    }
    if cfg.mla.q_lora_rank is None:
        return axes | {"wq": ("D", "H", None)}
    return axes | {"wq_a": ("D", None), "q_a_norm": {"scale": (None,)}, "wq_b": (None, "H", None)}


def _interleaved_to_halves(x: jax.Array) -> jax.Array:
    """Features `(x0, x1, x2, x3, ...)` as `(x0, x2, ..., x1, x3, ...)`."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _queries(p, x, cfg):
    if "wq" in p:
        return jnp.einsum("bsd,dhk->bshk", x, p["wq"])
    a = rms_norm(x @ p["wq_a"], p["q_a_norm"]["scale"], _latent_eps(cfg))
    return jnp.einsum("bsr,rhk->bshk", a, p["wq_b"])


def _latent(p, x, cfg):
    """`(c [B, S, Rkv] normalised, k_rope [B, S, Dr] before RoPE)`."""
    kv = x @ p["wkv_a"]
    c, k_rope = kv[..., : cfg.mla.kv_lora_rank], kv[..., cfg.mla.kv_lora_rank :]
    return rms_norm(c, p["kv_a_norm"]["scale"], _latent_eps(cfg)), k_rope


def _latent_eps(cfg) -> float:
    eps = cfg.mla.latent_norm_eps
    return cfg.norm_eps if eps is None else eps


def _rotate(x, cos, sin, interleave: bool):
    """RoPE of `x [B, S, heads, Dr]`."""
    return apply_rope(_interleaved_to_halves(x) if interleave else x, cos, sin)


def _attend(p, q, c, k_rope, pos, cfg):
    """The core over latents `c [B, Smax, Rkv]` and rotated `k_rope [B, Smax, Dr]` (queries
    `q [B, T, H, Dn+Dr]` rotated) at positions `pos..`: `[B, T, D]`."""
    m, h = cfg.mla, cfg.num_heads
    kv = jnp.einsum("bsr,rhk->bshk", c, p["wkv_b"])
    k_nope, v = kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim :]
    k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (*k_rope.shape[:2], h, k_rope.shape[-1]))
    k = jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1)
    with jax.named_scope(XLA_SCOPES["mla"]):
        out = masked_attention(q, k, v, pos, scale=softmax_scale(cfg))
    return jnp.einsum("bshk,hkd->bsd", out, p["wo"])


def _project(p, x, cos, sin, cfg):
    """`(q rotated [B, S, H, Dn+Dr], c [B, S, Rkv], k_rope rotated [B, S, Dr])`."""
    m = cfg.mla
    q = _queries(p, x, cfg)
    q_nope, q_rope = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
    q = jnp.concatenate([q_nope, _rotate(q_rope, cos, sin, m.rope_interleave)], axis=-1)
    c, k_rope = _latent(p, x, cfg)
    k_rope = _rotate(k_rope[:, :, None, :], cos, sin, m.rope_interleave)[:, :, 0, :]
    return q, c, k_rope


def mla_attention(p, x, cos, sin, cfg) -> jax.Array:
    """Causal MLA of `x [B, S, D]` (normalised) with RoPE tables `cos, sin [S, Dr/2]`: `[B, S,
    D]`."""
    q, c, k_rope = _project(p, x, cos, sin, cfg)
    return _attend(p, q, c, k_rope, 0, cfg)


def init_cache(cfg, batch: int, length: int) -> dict:
    """One layer's empty MLA cache: the normalised latent and the rotated shared key head."""
    dtype = jnp.dtype(cfg.dtype)
    return {
        "latent": jnp.zeros((batch, length, cfg.mla.kv_lora_rank), dtype),
        "k_rope": jnp.zeros((batch, length, cfg.mla.qk_rope_head_dim), dtype),
    }


def cached_mla(p, x, cache, pos, cos, sin, cfg):
    """MLA of `x [B, T, D]` at positions `pos..pos+T-1` against the latent cache: `(out [B, T,
    D], the cache with this call's latents written)`; `cos, sin` cover every cache position."""
    t = x.shape[1]
    c_, s_ = (jax.lax.dynamic_slice_in_dim(a, pos, t) for a in (cos, sin))
    q, c, k_rope = _project(p, x, c_, s_, cfg)
    cache = {
        "latent": jax.lax.dynamic_update_slice_in_dim(
            cache["latent"], c.astype(cache["latent"].dtype), pos, 1
        ),
        "k_rope": jax.lax.dynamic_update_slice_in_dim(
            cache["k_rope"], k_rope.astype(cache["k_rope"].dtype), pos, 1
        ),
    }
    return _attend(p, q, cache["latent"], cache["k_rope"], pos, cfg), cache
