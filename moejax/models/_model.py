"""`lm_forward`: the decoder-only MoE transformer as one pure function of (params, tokens)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import moejax
from moejax.models._config import LMConfig
from moejax.models._layers import attention, rms_norm, rope_tables, swiglu_mlp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LMAux:
    """Routing statistics and auxiliary losses of every MoE layer of one forward pass.

    Layer axis `Lm`: the MoE layers in order (`LMConfig.moe_layers`). Statistics are over all
    tokens of the (global) batch.
    """

    expert_counts: jax.Array  # [Lm, E] int32 assignments routed to each expert
    dropped_fraction: jax.Array  # [Lm] fp32 dropped / routed assignments (0 when dropless)
    load_balance_loss: jax.Array  # [Lm] fp32 Switch/GShard loss per layer (1.0 = balanced)
    z_loss: jax.Array  # [Lm] fp32 router z-loss per layer
    router_entropy: jax.Array  # [Lm] fp32 mean over tokens of the entropy (nats) of
    #                            softmax(router logits)


def cast_floating(tree, dtype):
    """Cast the floating leaves of `tree` to `dtype` (integer leaves untouched)."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


def _router_entropy(logits: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.sum(jnp.exp(logp) * logp, axis=-1))


def _moe_ffn(p, h, cfg: LMConfig, mesh, strategy, implementation, placement):
    if mesh is None:
        return moejax.moe_apply(p, h, cfg.moe, implementation=implementation)
    from moejax import parallel

    return parallel.moe_apply_sharded(
        p, h, cfg.moe, mesh, strategy=strategy, implementation=implementation, placement=placement
    )


def lm_forward(
    params: dict,
    tokens: jax.Array,
    cfg: LMConfig,
    *,
    mesh=None,
    strategy="auto",
    implementation: str = "auto",
    placements=None,
) -> tuple[jax.Array, LMAux]:
    """Logits of every position of `tokens`, and the MoE layers' routing statistics.

    Mixed precision: the floating parameters are cast to `cfg.dtype` on entry (gradients flow
    back to the stored `param_dtype` through the cast); RMSNorm statistics, attention softmax,
    the router and the returned logits are fp32.

    Args:
      params: the tree of `init_lm_params`.
      tokens: `[B, S]` int token ids, `S <= cfg.max_seq_len`.
      cfg: the model config.
      mesh: None for one device (`moejax.moe_apply`); otherwise a `moejax.parallel` mesh: the MoE
        layers run under `moejax.parallel.moe_apply_sharded` (B split over `("data", "expert")`),
        everything else under the surrounding `jit`, with the activations constrained to the same
        batch sharding.
      strategy: the sharded MoE `Strategy` (or `"auto"`); ignored without a mesh.
      implementation: the grouped-matmul implementation (`moejax.moe_apply`).
      placements: None (experts in logical order `[E, ...]`), or one
        `moejax.parallel.SlotTable` per MoE layer (needs a mesh): that layer's `experts/*` are
        then physical `[P, ...]` slots with identical replicas (`moejax.parallel.placed`).
        Routing statistics stay per logical expert.

    Returns:
      `(logits [B, S, V] fp32, LMAux)`.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens.shape={tokens.shape}: need [B, S]")
    if tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(f"tokens.shape[1]={tokens.shape[1]} > max_seq_len={cfg.max_seq_len}")
    if placements is not None:
        if mesh is None:
            raise ValueError("placements need a mesh (expert placement is across devices)")
        if len(placements) != len(cfg.moe_layers):
            raise ValueError(
                f"len(placements)={len(placements)}: need one per MoE layer ({len(cfg.moe_layers)})"
            )
    placement_of = dict(
        zip(cfg.moe_layers, placements or (None,) * len(cfg.moe_layers), strict=True)
    )
    p = cast_floating(params, cfg.dtype)
    constrain = _batch_constraint(mesh)
    cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta)
    x = constrain(jnp.take(p["embed"]["embedding"], tokens, axis=0))  # [B, S, D]
    moe = lambda i, h: _moe_ffn(
        p["layers"][i]["moe"], h, cfg, mesh, strategy, implementation, placement_of[i]
    )
    x, stats, _ = _decoder_layers(p, x, cfg, cos, sin, moe, constrain)
    x = rms_norm(x, p["final_norm"]["scale"], cfg.norm_eps)
    unembed = p["embed"]["embedding"].T if cfg.tie_embeddings else p["unembed"]["kernel"]
    logits = jnp.einsum("bsd,dv->bsv", x, unembed, preferred_element_type=jnp.float32)
    aux = LMAux(
        expert_counts=jnp.stack([a.expert_counts for a in stats]),
        dropped_fraction=jnp.stack([a.dropped_fraction for a in stats]),
        load_balance_loss=jnp.stack([a.load_balance_loss for a in stats]),
        z_loss=jnp.stack([a.z_loss for a in stats]),
        router_entropy=jnp.stack([_router_entropy(a.router_logits) for a in stats]),
    )
    return logits, aux


def _decoder_layers(p, x, cfg: LMConfig, cos, sin, moe, constrain):
    """The decoder stack: `(x [B, S, D], [MoEAux] per MoE layer, [MoE-layer inputs [B, S, D]])`;
    `moe(i, h) -> (y, aux)` runs MoE layer `i`."""
    stats, inputs = [], []
    for i, layer in enumerate(p["layers"]):
        with jax.named_scope(f"layer_{i}"):
            with jax.named_scope("attention"):
                h = rms_norm(x, layer["attn_norm"]["scale"], cfg.norm_eps)
                x = constrain(x + attention(layer["attn"], h, cos, sin))
            h = rms_norm(x, layer["ffn_norm"]["scale"], cfg.norm_eps)
            if cfg.is_moe(i):
                inputs.append(h)
                with jax.named_scope("moe"):
                    y, aux = moe(i, h)
                stats.append(aux)
            else:
                with jax.named_scope("mlp"):
                    y = swiglu_mlp(layer["mlp"], h)
            x = constrain(x + y)
    return x, stats, inputs


def moe_layer_inputs(params: dict, tokens: jax.Array, cfg: LMConfig) -> list[jax.Array]:
    """What each MoE layer receives (its normalised hidden states) for `tokens`, on one device:
    the real activations to study routing or benchmark a layer with.

    Args:
      params: the tree of `init_lm_params` (experts in logical order).
      tokens: `[B, S]` int token ids.
      cfg: the model config.

    Returns:
      `Lm` arrays `[B, S, D]` in `cfg.dtype`, in the order of `cfg.moe_layers`.
    """
    p = cast_floating(params, cfg.dtype)
    cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta)
    x = jnp.take(p["embed"]["embedding"], tokens, axis=0)
    moe = lambda i, h: moejax.moe_apply(p["layers"][i]["moe"], h, cfg.moe)
    return _decoder_layers(p, x, cfg, cos, sin, moe, lambda v: v)[2]


def _batch_constraint(mesh):
    """Keep activations' batch axis split over the token axes (a no-op without a mesh)."""
    if mesh is None:
        return lambda x: x
    from moejax import parallel

    def constrain(x):
        spec = parallel.activation_spec(mesh, x.ndim)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return constrain
