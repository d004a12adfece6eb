"""`upcycle`: start an MoE LM from a trained dense one (sparse upcycling, Komatsuzaki et al.
2023; granular upcycling as in Megatron-Core's `--moe-upcycling-granularity`).

A dense moejax LM is an `LMConfig` whose feed-forward layers are dense SwiGLU MLPs (`mlp`
layers) or one-expert MoE layers (`num_experts=1, top_k=1`, softmax router: the routing weight
is exactly 1, so the layer is its expert's SwiGLU MLP; `dense_lm_config` makes one, and
`experiments/train_lm.py` trains it like any model), or a model whose `mlp_layer_types` are all
`"dense"`: the Llama, Qwen2 and Qwen3 checkpoints `moejax.interop.hf.load_hf_model` reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax._config import MoEConfig
from moejax.models._config import LMConfig


def dense_lm_config(cfg: LMConfig, d_ff: int) -> LMConfig:
    """`cfg` made dense: every feed-forward layer a SwiGLU MLP of width `d_ff`, written as a
    one-expert MoE layer (softmax router, top-1, no shared experts: its weight is exactly 1)."""
    moe = MoEConfig(
        d_model=cfg.d_model, d_ff=d_ff, num_experts=1, top_k=1, router="softmax",
        block_size=cfg.moe.block_size,
    )  # fmt: skip
    return cfg.replace(moe=moe, moe_every=1, dense_d_ff=None)


def _dense_ffn(layer: dict, i: int) -> dict:
    """`{"w_gate" [D, F], "w_up" [D, F], "w_down" [F, D]}` of dense layer `i`."""
    if "mlp" in layer:
        return layer["mlp"]
    moe = layer.get("moe")
    ok = moe is not None and set(moe) == {"router", "experts"}
    ok = ok and set(moe["experts"]) == {"w_gate", "w_up", "w_down"}
    if not ok or moe["experts"]["w_up"].shape[0] != 1:
        raise ValueError(
            f"dense_params['layers'][{i}]: not a dense layer (need 'mlp', or 'moe' with one "
            "SwiGLU expert without biases or shared experts; see dense_lm_config)"
        )
    return {name: w[0] for name, w in moe["experts"].items()}


def upcycle(
    dense_params: dict,
    dense_cfg: LMConfig,
    moe_cfg: MoEConfig,
    granularity: int = 1,
    noise: float = 0.0,
    seed: int = 0,
    mlp_layer_types: tuple[str, ...] | None = None,
) -> tuple[dict, LMConfig]:
    """An MoE LM initialised from a dense one: each dense MLP copied into the experts.

    The result keeps the dense model's attention, norms and embeddings, and its layer pattern
    (`dense_cfg.moe_every` or `mlp_layer_types`) unless `mlp_layer_types` gives one: the layers
    that pattern makes MoE get `num_experts / granularity` copies of that layer's dense MLP,
    split `granularity` ways; the other layers keep their MLP. A dense model without MoE
    layers (every `mlp_layer_types` entry `"dense"`, as `load_hf_model` reads Llama, Qwen2 and
    Qwen3) becomes MoE in every layer. The router is fresh (normal, std `init_scale / sqrt(D)`, the
    bias and correction bias zero); expert biases are zero.

    Granularity `g`: expert `c * g + j` holds columns `j*F .. (j+1)*F` (`F = moe_cfg.d_ff`,
    dense width `g * F`) of `w_gate` and `w_up` and the matching rows of `w_down`, scaled by
    `g`; the router columns of the `g` experts of one copy are equal. What holds: the `g`
    shards of one copy sum to `g` times the dense MLP (SwiGLU acts per hidden unit), and their
    equal router columns tie, so a top-k that is a multiple of `g` takes whole copies. With
    `router="softmax"`, `norm_topk_prob`, `top_k % g == 0`, no shared experts, no expert
    biases and `noise=0`, each token's shards then weigh `(its copy's weight) / g` and the
    weights sum to 1, so every MoE layer outputs exactly the dense MLP's output and the logits
    equal the dense model's (to fp32 rounding). It does not hold once the router columns of a
    copy differ (training moves them apart: each shard gets its own gradient), with noise, or
    with `top_k % g != 0` (a token would take part of a copy).

    Args:
      dense_params: the dense model's parameter tree (`init_lm_params(dense_cfg)` layout).
      dense_cfg: the dense model's config (dense layers, or one-expert MoE layers).
      moe_cfg: the MoE layer to build (`d_model` the dense one's; `activation="swiglu"`;
        `d_ff * granularity` the dense MLP's width; `num_experts` a multiple of
        `granularity`).
      granularity: `g`, the shards each dense MLP is split into.
      noise: relative Gaussian noise on every expert weight, `w * (1 + noise * N(0, 1))`, drawn
        per expert to break their symmetry (0: exact copies).
      seed: the router's and the noise's PRNG seed.
      mlp_layer_types: the MoE model's FFN kind per layer (`"dense"` / `"moe"`, one per layer);
        None: the dense model's pattern, every layer MoE where that has no MoE layer.

    Returns:
      `(params, cfg)`: the MoE model's tree and its `LMConfig`.

    Raises:
      ValueError: naming the argument, for a `moe_cfg` or `granularity` that does not fit the
        dense model, or a dense layer that is not a SwiGLU MLP.
    """
    g = granularity
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"granularity={g!r}: must be a positive int")
    if not (isinstance(noise, int | float) and np.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise={noise!r}: must be a finite number >= 0")
    if moe_cfg.d_model != dense_cfg.d_model:
        raise ValueError(
            f"moe_cfg.d_model={moe_cfg.d_model}: must equal dense_cfg.d_model={dense_cfg.d_model}"
        )
    if moe_cfg.activation != "swiglu":
        raise ValueError(f"moe_cfg.activation={moe_cfg.activation!r}: the dense MLP is 'swiglu'")
    if moe_cfg.num_experts % g:
        raise ValueError(f"moe_cfg.num_experts={moe_cfg.num_experts}: not a multiple of {g=}")
    if moe_cfg.num_shared_experts:
        raise ValueError(
            f"moe_cfg.num_shared_experts={moe_cfg.num_shared_experts}: upcycle builds routed "
            "experts only"
        )
    dense_ffns = {i: _dense_ffn(layer, i) for i, layer in enumerate(dense_params["layers"])}
    widths = {ffn["w_up"].shape[1] for ffn in dense_ffns.values()}
    if len(widths) != 1:
        raise ValueError(f"dense_params: MLP widths {sorted(widths)} differ; need one width")
    (width,) = widths
    if moe_cfg.d_ff * g != width:
        raise ValueError(
            f"moe_cfg.d_ff={moe_cfg.d_ff}: times granularity={g} must equal the dense MLP "
            f"width {width}"
        )
    cfg = dense_cfg.replace(moe=moe_cfg, dense_d_ff=width)
    if mlp_layer_types is None and not cfg.moe_layers:  # an all-dense model: every layer MoE
        mlp_layer_types = ("moe",) * cfg.num_layers
    if mlp_layer_types is not None:
        cfg = cfg.replace(moe_every=1, mlp_layer_types=tuple(mlp_layer_types))
    dtype = jnp.dtype(cfg.param_dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 2 * cfg.num_layers))
    layers = []
    for i, layer in enumerate(dense_params["layers"]):
        out = {k: v for k, v in layer.items() if k not in ("mlp", "moe")}
        ffn = dense_ffns[i]
        k_router, k_noise = next(keys), next(keys)
        if cfg.is_moe(i):
            out["moe"] = _moe_layer(ffn, moe_cfg, g, noise, k_router, k_noise, dtype)
        else:
            out["mlp"] = dict(ffn)
        layers.append(out)
    return {**dense_params, "layers": layers}, cfg


def _moe_layer(ffn, cfg: MoEConfig, g, noise, k_router, k_noise, dtype) -> dict:
    e, f, d = cfg.num_experts, cfg.d_ff, cfg.d_model
    copies = e // g

    def shards(w, axis):  # [D, g*F] -> [g, D, F] along `axis` (1 for gate/up, 0 for down)
        return jnp.stack(jnp.split(w, g, axis=axis))

    experts = {
        "w_gate": jnp.tile(shards(ffn["w_gate"], 1), (copies, 1, 1)),
        "w_up": jnp.tile(shards(ffn["w_up"], 1), (copies, 1, 1)),
        "w_down": jnp.tile(shards(ffn["w_down"], 0) * g, (copies, 1, 1)),
    }
    if noise:
        noise_keys = jax.random.split(k_noise, 3)
        experts = {
            name: w * (1 + noise * jax.random.normal(k, w.shape, jnp.float32)).astype(w.dtype)
            for (name, w), k in zip(experts.items(), noise_keys, strict=True)
        }
    if cfg.expert_bias:
        experts |= {
            "b_gate": jnp.zeros((e, f)),
            "b_up": jnp.zeros((e, f)),
            "b_down": jnp.zeros((e, d)),
        }
    std = cfg.init_scale / np.sqrt(d)
    columns = jax.random.normal(k_router, (d, copies), jnp.float32) * std
    router = {"kernel": jnp.repeat(columns, g, axis=1)}  # the g shards of a copy tie
    if cfg.router_bias:
        router["bias"] = jnp.zeros((e,))
    if cfg.score_correction_bias:
        router["score_correction_bias"] = jnp.zeros((e,))
    layer = {"router": router, "experts": experts}
    return jax.tree.map(lambda a: a.astype(dtype), layer)
