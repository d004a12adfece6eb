"""`generate`: sample tokens from the LM with a KV cache, to check a converted or trained model.

Two jitted programs per shape: the prefill runs the prompt `[B, S0]` through every block, writing
each layer's keys and values for positions `0..S0-1` into a cache of `Smax = S0 + new` positions,
and returns the logits of the last position; the step runs one token `[B, 1]` at position `t`,
writes its keys and values at `t` and attends to positions `0..t`. Both are `jax.jit`s with the
model config, the mesh and the lengths static: a second prompt of the same shape reuses them.
Sampling (greedy, temperature, nucleus) happens on device in the same programs. Multi-head latent
attention caches its latent (`moejax.models._mla`); a sliding-window layer keeps a ring of its
last `window` positions.

The blocks are those of `lm_forward` (the same norms, FFNs and MoE layer; attention through
`cached_attention`), so the step's logits equal the full forward's at every position (up to
the order of floating-point sums): `tests/models/test_generate.py`. The MoE layers must route
each token on its own for that, as dropless dispatch does; with a capacity dispatcher, tokens a
full sequence would drop are not dropped one at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.models import _mla
from moejax.models._attention import masked_attention
from moejax.models._config import LMConfig
from moejax.models._layers import (
    _project,
    _qk_norm,
    apply_rope,
    rms_norm,
    rope_tables,
    unembed_logits,
)
from moejax.models._lm import _batch_constraint, _ffn_stage, _moe_ffn, cast_floating


def _rope(cfg: LMConfig, length: int):
    return rope_tables(length, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)


def init_cache(cfg: LMConfig, batch: int, length: int) -> list[dict]:
    """An empty cache of `length` positions for `batch` rows: one dict per layer, `{"k", "v":
    [B, Smax, Hkv, Dh]}` (multi-head latent attention: its normalised latent and rotated shared
    key head, `{"latent": [B, Smax, Rkv], "k_rope": [B, Smax, Dr]}`), in `cfg.dtype`."""
    if cfg.mla is not None:
        return [_mla.init_cache(cfg, batch, length) for _ in range(cfg.num_layers)]
    dtype = jnp.dtype(cfg.dtype)
    out = []
    for i in range(cfg.num_layers):
        shape = (batch, _cache_length(cfg, i, length), cfg.num_kv_heads, cfg.head_dim)
        out.append({"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)})
    return out


def _cache_length(cfg: LMConfig, layer: int, length: int) -> int:
    """A sliding-window layer keeps its last `window` positions (a ring: position `p` in slot
    `p % window`), every other layer all `length`."""
    window = cfg.window(layer)
    return length if window is None else min(window, length)


def cached_attention(p, x, cache, pos, cos, sin, cfg: LMConfig, window=None, prefill=False):
    """Causal GQA attention of `x [B, T, D]` at positions `pos..pos+T-1` against the cache:
    `(out [B, T, D], the cache with this call's keys and values written at pos..pos+T-1)`.

    The math of `moejax.models.attention` (projections, biases, q/k norms, RoPE, fp32 scores
    and softmax, probabilities cast back to the compute dtype), keys at positions past
    `pos + t` masked out for query `t`.

    Args:
      p: the layer's `attn` tree.
      x: `[B, T, D]` normalised hidden states.
      cache: `{"k", "v": [B, Smax, Hkv, Dh]}`.
      pos: int32 scalar, the position of `x[:, 0]`.
      cos, sin: `[Smax, Dh/2]` RoPE tables of every cache position.
      cfg: the model config.
      window: the layer's sliding window (None: its whole past). Where its cache is shorter
        than the sequence (`_cache_length`), it is a ring of the last `window` positions.
      prefill: `x` is the prompt from position 0 (`pos` 0): a ring-cached layer attends over
        the prompt's own keys, then keeps their last `window` in its ring.
    """
    if cfg.mla is not None:
        return _mla.cached_mla(p, x, cache, pos, cos, sin, cfg)
    b, t, _ = x.shape
    q, k, v = (_project(x, p, name, None) for name in "qkv")
    if cfg.qk_norm is not None:
        q = _qk_norm(q, p["q_norm"]["scale"], cfg.qk_norm, cfg.norm_eps)
        k = _qk_norm(k, p["k_norm"]["scale"], cfg.qk_norm, cfg.norm_eps)
    c, s = (jax.lax.dynamic_slice_in_dim(a, pos, t) for a in (cos, sin))
    q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    scale, sinks = cfg.head_dim**-0.5, p.get("sinks")
    if window is not None and cache["k"].shape[1] < cos.shape[0]:
        out, cache = _ring_attention(q, k, v, cache, pos, window, prefill, scale, sinks)
        out = jnp.einsum("bshk,hkd->bsd", out, p["wo"])
        return (out + p["bo"] if "bo" in p else out), cache
    cache = {
        "k": jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), pos, 1),
        "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), pos, 1),
    }
    out = masked_attention(
        q, cache["k"], cache["v"], pos, scale=cfg.head_dim**-0.5, window=window,
        sinks=p.get("sinks"),
    )  # fmt: skip
    out = jnp.einsum("bshk,hkd->bsd", out, p["wo"])
    return (out + p["bo"] if "bo" in p else out), cache


def _ring_attention(q, k, v, cache, pos, window, prefill, scale, sinks):
    """Sliding-window attention with a ring cache of `W = window` slots (`cached_attention`)."""
    w, t = cache["k"].shape[1], q.shape[1]
    if prefill:  # the prompt's own keys, then its last W positions into their slots
        out = masked_attention(q, k, v, 0, scale=scale, window=window, sinks=sinks)
        keep = min(t, w)
        slots = jnp.arange(t - keep, t) % w  # distinct: a permutation of `keep` slots
        cache = {
            name: cache[name].at[:, slots].set(new[:, t - keep :].astype(cache[name].dtype))
            for name, new in (("k", k), ("v", v))
        }
        return out, cache
    if t != 1:
        raise ValueError(f"a ring-cached layer steps one token at a time, got {t}")
    slot = pos % w
    cache = {
        name: jax.lax.dynamic_update_slice_in_dim(
            cache[name], new.astype(cache[name].dtype), slot, 1
        )
        for name, new in (("k", k), ("v", v))
    }
    # Slot s holds the newest position <= pos congruent to s (negative: never written).
    held = pos - (pos - jnp.arange(w)) % w
    out = masked_attention(
        q, cache["k"], cache["v"], pos, scale=scale, window=window, sinks=sinks,
        key_positions=held,
    )  # fmt: skip
    return out, cache


def _forward_cached(
    params, tokens, cache, pos, cfg: LMConfig, mesh, implementation, length, prefill=False
):
    """Logits `[B, T, V]` (fp32) of `tokens [B, T]` at positions `pos..`, and the new cache
    (`length`: the positions the RoPE tables cover)."""
    p = cast_floating(params, cfg.dtype)
    constrain = _batch_constraint(mesh)
    cos, sin = _rope(cfg, length)
    x = constrain(jnp.take(p["embed"]["embedding"], tokens, axis=0))
    moe = functools.partial(
        _moe_ffn, cfg=cfg, mesh=mesh, strategy="auto", implementation=implementation
    )
    new_cache = []
    for i, layer in enumerate(p["layers"]):
        h = rms_norm(x, layer["attn_norm"]["scale"], cfg.norm_eps)
        a, c = cached_attention(
            layer["attn"], h, cache[i], pos, cos, sin, cfg, cfg.window(i), prefill
        )
        new_cache.append(c)
        x = constrain(x + a)
        x, _, _, _ = _ffn_stage(
            layer, x, None, None, is_moe=cfg.is_moe(i), cfg=cfg, constrain=constrain, moe=moe
        )
    x = rms_norm(x, p["final_norm"]["scale"], cfg.norm_eps)
    unembed = p["embed"]["embedding"].T if cfg.tie_embeddings else p["unembed"]["kernel"]
    return unembed_logits(x, unembed), new_cache


def sample(logits: jax.Array, key, temperature: float, top_p: float) -> jax.Array:
    """Token ids `[B]` from `logits [B, V]`: the argmax at `temperature=0`, else a draw from
    `softmax(logits / temperature)` restricted to the smallest set of most likely tokens whose
    probability reaches `top_p` (nucleus sampling; the most likely token always stays)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        inverse = jnp.argsort(order, axis=-1)
        logits = jnp.take_along_axis(sorted_logits, inverse, axis=-1)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("cfg", "length", "mesh", "implementation", "temperature", "top_p")
)
def _prefill(params, prompt, key, *, cfg, length, mesh, implementation, temperature, top_p):
    cache = init_cache(cfg, prompt.shape[0], length)
    logits, cache = _forward_cached(
        params, prompt, cache, jnp.int32(0), cfg, mesh, implementation, length, prefill=True
    )
    return sample(logits[:, -1], key, temperature, top_p), logits[:, -1], cache


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "length", "mesh", "implementation", "temperature", "top_p"),
    donate_argnames=("cache",),
)
def _step(params, token, cache, pos, key, *, cfg, length, mesh, implementation, temperature, top_p):
    logits, cache = _forward_cached(
        params, token[:, None], cache, pos, cfg, mesh, implementation, length
    )
    return sample(logits[:, -1], key, temperature, top_p), logits[:, -1], cache


def generate(
    params: dict,
    cfg: LMConfig,
    prompt_ids,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    *,
    mesh=None,
    implementation: str = "auto",
    on_token: Callable[[int, np.ndarray], None] | None = None,
    return_logits: bool = False,
):
    """Continue `prompt_ids` by `max_new_tokens` tokens with a KV cache (module docstring).

    Args:
      params: the tree of `init_lm_params` (experts in logical order), on one device or laid
        out on `mesh` (`lm_partition_specs`).
      cfg: the model config.
      prompt_ids: `[B, S0]` or `[S0]` int token ids (`S0 >= 1`).
      max_new_tokens: how many tokens to add; `S0 + max_new_tokens <= cfg.max_seq_len`.
      temperature: 0 for greedy decoding (argmax), else the softmax temperature.
      top_p: nucleus sampling's probability mass (1: the whole vocabulary).
      seed: the sampling PRNG seed (draw `i` uses `fold_in(key(seed), i)`).
      mesh: None for one device, or a `moejax.parallel` mesh: the MoE layers run under
        `moe_apply_sharded` and the batch is split over the token axes (rows are repeated up
        to a multiple of their devices, and dropped again).
      implementation: the grouped-matmul implementation (`moejax.moe_apply`).
      on_token: called after each generated token with `(i, tokens [B])` (a progress bar).
      return_logits: also return the logits `[B, max_new_tokens, V]` each token was drawn from.

    Returns:
      `[B, S0 + max_new_tokens]` int32 token ids (`[S0 + max_new_tokens]` for a 1-D prompt),
      as a numpy array; with `return_logits`, `(ids, logits)`.
    """
    prompt = np.asarray(prompt_ids)
    flat = prompt.ndim == 1
    prompt = prompt[None] if flat else prompt
    if prompt.ndim != 2 or prompt.shape[1] < 1 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt_ids: need [B, S0] or [S0] int ids, S0 >= 1; got {prompt.shape}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1")
    if (prompt < 0).any() or (prompt >= cfg.vocab_size).any():
        raise ValueError(f"prompt_ids: ids must lie in [0, vocab_size={cfg.vocab_size})")
    length = prompt.shape[1] + max_new_tokens
    if length > cfg.max_seq_len:
        raise ValueError(
            f"prompt of {prompt.shape[1]} + max_new_tokens={max_new_tokens} = {length} tokens: "
            f"over the model's max_seq_len={cfg.max_seq_len}"
        )
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise ValueError(f"temperature={temperature!r}: must be a finite number >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: must be in (0, 1]")
    rows = prompt.shape[0]
    if mesh is not None:  # every token shard needs rows: repeat the last row up to a multiple
        from moejax.parallel.mesh import token_shards

        pad = -rows % token_shards(mesh)
        prompt = np.concatenate([prompt, np.repeat(prompt[-1:], pad, axis=0)])
    static = dict(
        cfg=cfg, mesh=mesh, implementation=implementation,
        temperature=float(temperature), top_p=float(top_p),
    )  # fmt: skip
    key = jax.random.key(seed)
    token, logits, cache = _prefill(
        params, jnp.asarray(prompt, jnp.int32), jax.random.fold_in(key, 0), length=length, **static
    )
    out, all_logits = [token], [logits]
    if on_token is not None:
        on_token(0, np.asarray(token)[:rows])
    for i in range(1, max_new_tokens):
        pos = jnp.int32(prompt.shape[1] + i - 1)
        token, logits, cache = _step(
            params, token, cache, pos, jax.random.fold_in(key, i), length=length, **static
        )
        out.append(token)
        if return_logits:
            all_logits.append(logits)
        if on_token is not None:
            on_token(i, np.asarray(token)[:rows])
    ids = np.concatenate([prompt, np.stack([np.asarray(t) for t in out], axis=1)], axis=1)[:rows]
    ids = ids.astype(np.int32)
    if flat:
        ids = ids[0]
    if not return_logits:
        return ids
    logits = np.stack([np.asarray(a) for a in all_logits], axis=1)[:rows]
    return ids, (logits[0] if flat else logits)
