"""`lm_forward`: the decoder-only MoE transformer as one pure function of (params, tokens)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import moejax
from moejax.models._config import LMConfig
from moejax.models._layers import attention, rms_norm, rope_tables, swiglu_mlp
from moejax.models._sharding import constrain as constrain_specs
from moejax.models._sharding import lm_compute_specs


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


Remat = Literal["none", "dots_saveable", "full"]
REMAT_POLICIES: tuple[str, ...] = Remat.__args__


def remat_policy(name: str):
    """The `jax.checkpoint` policy of a remat name, None for `"none"` (no rematerialisation).

    `"dots_saveable"` keeps every matmul output for the backward and recomputes the rest
    (norms, activations, softmax); `"full"` keeps only each block's input and recomputes the
    whole block.
    """
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat={name!r}: must be one of {REMAT_POLICIES}")
    return {
        "none": None,
        "dots_saveable": jax.checkpoint_policies.checkpoint_dots,
        "full": jax.checkpoint_policies.nothing_saveable,
    }[name]


def lm_forward(
    params: dict,
    tokens: jax.Array,
    cfg: LMConfig,
    *,
    mesh=None,
    strategy="auto",
    implementation: str = "auto",
    placements=None,
    remat: Remat = "none",
    scan_layers: bool = False,
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
        layers run under `moejax.parallel.moe_apply_sharded` (B split over the token axes
        `data`, `fsdp`, `expert`), everything else under the surrounding `jit`, activations
        constrained to the same batch split and each layer's weights to their compute layout
        (`moejax.models.lm_compute_specs`: gathered over `fsdp`, heads and widths over
        `model`) just before the layer uses them.
      strategy: the sharded MoE `Strategy` (or `"auto"`); ignored without a mesh.
      implementation: the grouped-matmul implementation (`moejax.moe_apply`).
      placements: None (experts in logical order `[E, ...]`), or one
        `moejax.parallel.SlotTable` per MoE layer (needs a mesh): that layer's `experts/*` are
        then physical `[P, ...]` slots with identical replicas (`moejax.parallel.placed`).
        Routing statistics stay per logical expert.
      remat: rematerialisation of each block in the backward (`remat_policy`).
      scan_layers: run the blocks as a `jax.lax.scan` over repeats of the `moe_every`-block
        unit (dense blocks then one MoE block), so the traced and compiled program holds one
        unit whatever the depth; the parameters are stacked for the scan in the forward (the
        stored tree stays one dict per layer). Leftover dense blocks run unscanned.

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
    policy = remat_policy(remat)
    p = cast_floating(params, cfg.dtype)
    compute = None if mesh is None else lm_compute_specs(cfg, mesh)
    constrain = _batch_constraint(mesh)
    cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta)
    embed = _gathered(p["embed"], compute and compute["embed"], mesh)
    x = constrain(jnp.take(embed["embedding"], tokens, axis=0))  # [B, S, D]
    block = functools.partial(
        _block,
        cfg=cfg,
        cos=cos,
        sin=sin,
        mesh=mesh,
        constrain=constrain,
        moe=functools.partial(
            _moe_ffn, cfg=cfg, mesh=mesh, strategy=strategy, implementation=implementation
        ),
        attn_impl=_attention_implementation(implementation),
    )
    tables = list(placements) if placements is not None else [None] * cfg.num_moe_layers
    if scan_layers:
        x, stats = _scanned_layers(p, x, cfg, compute, tables, block, policy)
    else:
        x, stats = _unscanned_layers(p, x, cfg, compute, tables, block, policy)
    x = rms_norm(x, p["final_norm"]["scale"], cfg.norm_eps)
    if cfg.tie_embeddings:
        unembed = embed["embedding"].T
    else:
        unembed = _gathered(p["unembed"], compute and compute["unembed"], mesh)["kernel"]
    logits = jnp.einsum("bsd,dv->bsv", x, unembed, preferred_element_type=jnp.float32)
    aux = LMAux(
        expert_counts=stats.expert_counts,
        dropped_fraction=stats.dropped_fraction,
        load_balance_loss=stats.load_balance_loss,
        z_loss=stats.z_loss,
        router_entropy=stats.router_entropy,
    )
    return logits, aux


def _gathered(tree, specs, mesh):
    """`tree` constrained to its compute layout (the FSDP all-gather point); identity without a
    mesh."""
    return tree if mesh is None else constrain_specs(tree, specs, mesh)


def _layer_stats(aux) -> LMAux:
    """The per-layer statistics `LMAux` keeps, from one layer's `MoEAux`."""
    return LMAux(
        expert_counts=aux.expert_counts,
        dropped_fraction=aux.dropped_fraction,
        load_balance_loss=aux.load_balance_loss,
        z_loss=aux.z_loss,
        router_entropy=_router_entropy(aux.router_logits),
    )


def _attention_implementation(implementation: str) -> str:
    """The attention core that goes with a grouped-matmul `implementation`: the Pallas kernels
    with `"pallas"`, by compile target with `"auto"`, the XLA reference with the XLA paths."""
    return implementation if implementation in ("auto", "pallas") else "xla"


def _block(layer, x, table, *, is_moe, compute, cfg, cos, sin, mesh, constrain, moe, attn_impl):
    """One pre-norm block: `(x, LMAux of this layer or None, the FFN input)`."""
    layer = _gathered(layer, compute, mesh)
    with jax.named_scope("attention"):
        h = rms_norm(x, layer["attn_norm"]["scale"], cfg.norm_eps)
        a = attention(layer["attn"], h, cos, sin, mesh=mesh, implementation=attn_impl)
        x = constrain(x + a)
    h = rms_norm(x, layer["ffn_norm"]["scale"], cfg.norm_eps)
    if is_moe:
        with jax.named_scope("moe"):
            y, aux = moe(layer["moe"], h, placement=table)
        stats = _layer_stats(aux)
    else:
        with jax.named_scope("mlp"):
            y = swiglu_mlp(layer["mlp"], h)
        stats = None
    return constrain(x + y), stats, h


def _unscanned_layers(p, x, cfg, compute, tables, block, policy, start=0):
    """Blocks `[start, L)` one after the other: `(x, LMAux stacked over their MoE layers)`."""
    stats, tables = [], iter(tables)
    for i in range(start, cfg.num_layers):
        fn = functools.partial(
            block, is_moe=cfg.is_moe(i), compute=compute and compute["layers"][i]
        )
        if policy is not None:
            fn = jax.checkpoint(fn, policy=policy)
        with jax.named_scope(f"layer_{i}"):
            x, s, _ = fn(p["layers"][i], x, next(tables) if cfg.is_moe(i) else None)
        if s is not None:
            stats.append(s)
    return x, (jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats else None)


def _scanned_layers(p, x, cfg, compute, tables, block, policy):
    """Blocks `[0, R * u)` as a scan over R units of `u = moe_every` blocks (the last one MoE),
    then the leftover (dense) blocks unscanned."""
    u = cfg.moe_every
    repeats = cfg.num_layers // u
    units = [p["layers"][k * u : (k + 1) * u] for k in range(repeats)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *units)  # [R, ...] per unit position
    unit_compute = compute and compute["layers"][:u]
    xs = (stacked, None if tables[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *tables))

    def unit(x, xs):
        layers, table = xs
        for j in range(u):
            fn = functools.partial(
                block, is_moe=cfg.is_moe(j), compute=unit_compute and unit_compute[j]
            )
            x, s, _ = fn(layers[j], x, table if cfg.is_moe(j) else None)
        return x, s

    if policy is not None:
        unit = jax.checkpoint(unit, policy=policy)
    x, stats = jax.lax.scan(unit, x, xs)
    x, _ = _unscanned_layers(p, x, cfg, compute, [], block, policy, start=repeats * u)
    return x, stats


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

    def moe(layer_params, h, placement):
        return moejax.moe_apply(layer_params, h, cfg.moe)

    inputs = []
    for i, layer in enumerate(p["layers"]):
        x, _, h = _block(
            layer, x, None, is_moe=cfg.is_moe(i), compute=None, cfg=cfg, cos=cos, sin=sin,
            mesh=None, constrain=lambda v: v, moe=moe, attn_impl="xla",
        )  # fmt: skip
        if cfg.is_moe(i):
            inputs.append(h)
    return inputs


def _batch_constraint(mesh):
    """Keep activations' batch axis split over the token axes (a no-op without a mesh)."""
    if mesh is None:
        return lambda x: x
    from moejax import parallel

    def constrain(x):
        spec = parallel.activation_spec(mesh, x.ndim)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return constrain
