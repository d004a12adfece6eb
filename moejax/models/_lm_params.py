"""The LM parameter tree: initialisation, mesh partition specs and parameter counts.

```
embed/embedding                [V, D]
layers[i]/attn_norm/scale      [D]
layers[i]/attn/wq              [D, H, Dh]
layers[i]/attn/wk, wv          [D, Hkv, Dh]
layers[i]/attn/wo              [H, Dh, D]
layers[i]/attn/bq              [H, Dh]     (attention_bias; bk, bv [Hkv, Dh])
layers[i]/attn/bo              [D]         (attention_out_bias)
layers[i]/attn/sinks           [H]         (attention_sinks)
layers[i]/attn/q_norm/scale    [Dh] or [H, Dh]     (qk_norm "head" or "full"; k_norm: Hkv)
layers[i]/attn/...             with `mla`: multi-head latent attention's (`moejax.models._mla`)
layers[i]/ffn_norm/scale       [D]
layers[i]/moe/...              the moejax MoE layer tree (router, experts, shared)  MoE layers
layers[i]/mlp/w_gate, w_up     [D, F]                                               dense layers
layers[i]/mlp/w_down           [F, D]
final_norm/scale               [D]
unembed/kernel                 [D, V]   (absent with tie_embeddings)
mtp[k]/...                     multi-token-prediction blocks (mtp_layers; `moejax.models._mtp`)
```

`layers` is a list (one dict per block) so that dense and MoE blocks can differ and a block's
experts can be re-placed on their own; `lm_forward(scan_layers=True)` stacks the repeats of a
unit of blocks for a scan in the forward. Sharding: `moejax.models._sharding` (one rule table
from each dimension's logical axis to mesh axes: `D` over `fsdp`, experts over `expert`, heads
and widths over `model`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

import moejax
from moejax.models._config import LMConfig
from moejax.models._mla import init_mla_params


def _normal(key, shape, std, dtype):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _attention_params(cfg: LMConfig, key, out_std_scale: float) -> dict:
    if cfg.mla is not None:
        return init_mla_params(cfg, key, _normal, out_std_scale)
    d, h, hkv, dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dtype = jnp.dtype(cfg.param_dtype)
    kq, kk, kv, ko = jax.random.split(key, 4)
    p = {
        "wq": _normal(kq, (d, h, dh), d**-0.5, dtype),
        "wk": _normal(kk, (d, hkv, dh), d**-0.5, dtype),
        "wv": _normal(kv, (d, hkv, dh), d**-0.5, dtype),
        "wo": _normal(ko, (h, dh, d), (h * dh) ** -0.5 * out_std_scale, dtype),
    }
    if cfg.attention_bias:
        p |= {"bq": jnp.zeros((h, dh), dtype), "bk": jnp.zeros((hkv, dh), dtype)}
        p["bv"] = jnp.zeros((hkv, dh), dtype)
    if cfg.attention_out_bias:
        p["bo"] = jnp.zeros((d,), dtype)
    if cfg.attention_sinks:
        p["sinks"] = jnp.zeros((h,), dtype)
    if cfg.qk_norm is not None:
        q_shape, k_shape = ((dh,), (dh,)) if cfg.qk_norm == "head" else ((h, dh), (hkv, dh))
        p["q_norm"] = {"scale": jnp.ones(q_shape, dtype)}
        p["k_norm"] = {"scale": jnp.ones(k_shape, dtype)}
    return p


def _mlp_params(cfg: LMConfig, key, out_std_scale: float) -> dict:
    d, f = cfg.d_model, cfg.mlp_d_ff
    dtype = jnp.dtype(cfg.param_dtype)
    kg, ku, kd = jax.random.split(key, 3)
    return {
        "w_gate": _normal(kg, (d, f), d**-0.5, dtype),
        "w_up": _normal(ku, (d, f), d**-0.5, dtype),
        "w_down": _normal(kd, (f, d), f**-0.5 * out_std_scale, dtype),
    }


def init_lm_params(cfg: LMConfig, key: jax.Array) -> dict:
    """Initialise the LM parameters (tree in the module docstring).

    Projections are Normal(0, 1/sqrt(fan_in)); the block output projections (`wo`, `w_down` of
    the dense MLP and of the experts) are further scaled by `1/sqrt(2 L)` (GPT-2) so that the
    residual stream's variance does not grow with depth at initialisation. Norm scales are 1, the
    embedding is Normal(0, `embed_init_std`).

    Args:
      cfg: the model config.
      key: a PRNG key.

    Returns:
      The nested parameter dict.

    >>> import jax
    >>> from moejax.models import presets, init_lm_params
    >>> params = init_lm_params(presets.get("micro"), jax.random.key(0))
    >>> params["layers"][0]["attn"]["wq"].shape
    (32, 4, 8)
    """
    dtype = jnp.dtype(cfg.param_dtype)
    out_scale = (2 * cfg.num_layers) ** -0.5
    k_embed, k_unembed, *k_layers = jax.random.split(key, 2 + cfg.num_layers)
    moe_cfg = cfg.moe.replace(param_dtype=cfg.param_dtype)
    layers = [
        _block_params(cfg, k, out_scale, cfg.is_moe(i), moe_cfg) for i, k in enumerate(k_layers)
    ]
    if cfg.mtp_layers:  # keys folded in apart: the main model's parameters stay as without MTP
        params_mtp = [_mtp_params(cfg, jax.random.fold_in(key, 1_000_003 + k), out_scale, moe_cfg)
                      for k in range(cfg.mtp_layers)]  # fmt: skip
    params = {
        "embed": {
            "embedding": _normal(k_embed, (cfg.vocab_size, cfg.d_model), cfg.embed_init_std, dtype)
        },
        "layers": layers,
        "final_norm": {"scale": jnp.ones((cfg.d_model,), dtype)},
    }
    if not cfg.tie_embeddings:
        params["unembed"] = {
            "kernel": _normal(k_unembed, (cfg.d_model, cfg.vocab_size), cfg.d_model**-0.5, dtype)
        }
    if cfg.mtp_layers:
        params["mtp"] = params_mtp
    return params


def _block_params(cfg: LMConfig, key, out_scale: float, is_moe: bool, moe_cfg) -> dict:
    dtype = jnp.dtype(cfg.param_dtype)
    k_attn, k_ffn = jax.random.split(key)
    layer = {
        "attn_norm": {"scale": jnp.ones((cfg.d_model,), dtype)},
        "attn": _attention_params(cfg, k_attn, out_scale),
        "ffn_norm": {"scale": jnp.ones((cfg.d_model,), dtype)},
    }
    if is_moe:
        moe = moejax.init_moe_params(moe_cfg, k_ffn)
        moe["experts"]["w_down"] = moe["experts"]["w_down"] * jnp.asarray(out_scale, dtype)
        layer["moe"] = moe
    else:
        layer["mlp"] = _mlp_params(cfg, k_ffn, out_scale)
    return layer


def _mtp_params(cfg: LMConfig, key, out_scale: float, moe_cfg) -> dict:
    """One multi-token-prediction block (`moejax.models._mtp`)."""
    dtype = jnp.dtype(cfg.param_dtype)
    d = cfg.d_model
    k_proj, k_block = jax.random.split(key)
    ones = lambda: {"scale": jnp.ones((d,), dtype)}  # noqa: E731
    return {
        "enorm": ones(),
        "hnorm": ones(),
        "eh_proj": {"kernel": _normal(k_proj, (2 * d, d), (2 * d) ** -0.5, dtype)},
        "block": _block_params(cfg, k_block, out_scale, cfg.mtp_is_moe, moe_cfg),
        "norm": ones(),
    }


def abstract_params(cfg: LMConfig) -> dict:
    """The parameter tree as `jax.ShapeDtypeStruct`s (nothing is allocated)."""
    return jax.eval_shape(functools.partial(init_lm_params, cfg), jax.random.key(0))


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a config.

    Attributes:
      total: every stored parameter.
      active: parameters that multiply one token in the forward pass: attention projections,
        dense MLPs, the router, `K` routed experts and the shared experts of every MoE layer,
        and the unembedding (the embedding lookup is not a matmul). `6 * active` is the training
        FLOPs per token of the matmuls (forward 2, backward 4), without attention scores.
      embedding: the `[V, D]` embedding lookup table.
    """

    total: int
    active: int
    embedding: int


def param_counts(cfg: LMConfig) -> ParamCounts:
    """Count parameters from the shapes of `init_lm_params` (no arrays are materialised).

    >>> from moejax.models import presets, param_counts
    >>> c = param_counts(presets.get("mixtral_8x7b"))
    >>> round(c.total / 1e9, 1), round(c.active / 1e9, 1)
    (46.7, 12.7)
    """
    abstract = abstract_params(cfg)
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
    embedding = cfg.vocab_size * cfg.d_model
    active = total - embedding
    blocks = [abstract["layers"][i] for i in cfg.moe_layers]
    if cfg.mtp_is_moe:  # training-only blocks: their experts are counted as the main model's
        blocks += [m["block"] for m in abstract.get("mtp", [])]
    for block in blocks:
        experts = block["moe"]["experts"]
        routed = sum(math.prod(x.shape) for x in jax.tree.leaves(experts))
        active -= routed - routed // cfg.moe.num_experts * cfg.moe.top_k
    # Norm scales and biases are not matmul weights, but they are ~1e-4 of the count: kept.
    if cfg.tie_embeddings:
        active += embedding  # the tied table is also the unembedding matmul
    return ParamCounts(total=total, active=active, embedding=embedding)
