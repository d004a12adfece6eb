"""`lm_forward`: the decoder-only MoE transformer as one pure function of (params, tokens)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import moejax
from moejax import _routing, _wgrad
from moejax.models import _mtp
from moejax.models._attention import note_xla_fallback
from moejax.models._config import LMConfig
from moejax.models._layer_runs import scanned_layers, unscanned_layers
from moejax.models._layers import attention, rms_norm, rope_tables, swiglu_mlp, unembed_logits
from moejax.models._mla import mla_attention
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
    routed_fraction: jax.Array  # [Lm, E] fp32 f: fraction of the assignments to each expert
    mean_probs: jax.Array  # [Lm, E] fp32 P: mean router probability of each expert
    sequence_balance_loss: jax.Array  # [Lm] fp32 DeepSeek-V3 sequence-wise balance loss per
    #                                   layer (mean over sequences; 1.0 = balanced)
    expert_index: jax.Array | None = None  # [Lm, B, S, K] int32 logical experts every token
    #                                        chose, only with `lm_forward(return_experts=True)`


def cast_floating(tree, dtype):
    """Cast the floating leaves of `tree` to `dtype` (integer leaves untouched)."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


def _router_entropy(logits: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.sum(jnp.exp(logp) * logp, axis=-1))


def _moe_ffn(
    p, h, cfg: LMConfig, mesh, strategy, implementation, slot_table, wgrad=None, replay=None
):
    """`(y, MoEAux, slots)`: the MoE layer (with `replay`, `[B, S, K]` recorded experts, router
    replay), and with `wgrad` (a `_wgrad.Delayed`) the slots of the weight gradients it computes
    in its backward (None without)."""
    if mesh is None:  # no exchange to bound the delayed weight gradients by
        return _wgrad.beside(
            lambda h: moejax.moe_apply(
                p, h, cfg.moe, implementation=implementation, replay_experts=replay
            ),
            h,
            wgrad,
        )
    from moejax import parallel

    out = parallel.moe_apply_sharded(
        p, h, cfg.moe, mesh, strategy=strategy, implementation=implementation,
        slot_table=slot_table, wgrad=wgrad, replay_experts=replay,
    )  # fmt: skip
    return out if wgrad is not None else (*out, None)


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
    slot_tables=None,
    remat: Remat = "none",
    scan_layers: bool = False,
    batch_split: int = 1,
    delay_wgrad: bool | None = None,
    replay_experts: jax.Array | None = None,
    return_experts: bool = False,
    mtp_tokens: jax.Array | None = None,
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
      slot_tables: None (experts in logical order `[E, ...]`), or one
        `moejax.parallel.SlotTable` per MoE layer (needs a mesh): that layer's `experts/*` are
        then physical `[P, ...]` slots with identical replicas (`moejax.parallel.slots`).
        Routing statistics stay per logical expert.
      remat: rematerialisation of each block in the backward (`remat_policy`).
      scan_layers: run the blocks as `jax.lax.scan`s over runs of a repeated unit of blocks
        (`moejax.models._layer_runs.layer_runs`: the `moe_every`-block unit, dense blocks then
        one MoE block, from layer 0; with `mlp_layer_types`, the runs
        `moejax.models._patterns.scan_runs` finds, e.g. DeepSeek-V3's dense first layers and
        its MoE layers), so the traced and compiled program holds one unit per run whatever the
        depth; the parameters are stacked for the scan in the forward (the stored tree stays
        one dict per layer). Blocks outside every run go unscanned.
      batch_split: split each device's rows into this many micro-batches that go through
        every block side by side, one stage behind the other (`split_block`): while one
        micro-batch's tokens are in an MoE layer's all-to-all, the other's attention (or dense
        MLP, or shared experts) can run. Per-token results are those of the whole batch; the
        statistics are combined exactly (`merge_stats`). The local batch (`B` over the token
        shards) must divide by it.
      delay_wgrad: compute each attention's weight gradients in the backward of the MoE layer
        of the block before, while that layer's all-to-alls are in flight
        (`moejax.models._wgrad`; Megatron-Core's `--delay-wgrad-compute`). Gradients are
        unchanged. Memory: one block's attention input and output gradients live until the
        MoE layer before it runs its backward; with `scan_layers` the slots they travel in are
        also loop carries in the forward and the backward (measured: +4.6 GiB per device for
        Mixtral-8x7B on 64 TPU v5p chips, 1.15 GiB per carry). None (the default): on where
        the mesh has an `expert` axis of more than one device and the layers are not scanned.
      replay_experts: router replay (RL: route the training step as the rollout was routed):
        None, or `[Lm, B, S, K]` int logical expert ids per MoE layer, e.g. the `expert_index`
        of an earlier `return_experts=True` forward. Each MoE layer uses them instead of its
        top-k, with weights from its current router (`moejax.moe_apply`'s `replay_experts`);
        counts and balance losses follow them. Not with `router="expert_choice"`.
      return_experts: also return the experts every token chose, `LMAux.expert_index
        [Lm, B, S, K]` (otherwise None, and nothing is computed for it).
      mtp_tokens: None, or `[B, S + j]` ids (`j >= 1`: the inputs and what follows them, e.g.
        the training window) for the multi-token-prediction blocks (`cfg.mtp_layers`,
        `moejax.models._mtp`), which then run after the main model.

    Returns:
      `(logits [B, S, V] fp32, LMAux)`; with `mtp_tokens`, `(logits, LMAux, mtp_logits [M, B,
      S, V] fp32)`.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens.shape={tokens.shape}: need [B, S]")
    if tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(f"tokens.shape[1]={tokens.shape[1]} > max_seq_len={cfg.max_seq_len}")
    if mtp_tokens is not None:
        if not cfg.mtp_layers:
            raise ValueError("mtp_tokens given, but the model has no MTP blocks (mtp_layers=0)")
        if mtp_tokens.ndim != 2 or mtp_tokens.shape[0] != tokens.shape[0]:
            raise ValueError(f"mtp_tokens.shape={mtp_tokens.shape}: need [B, S + j]")
        if mtp_tokens.shape[1] <= tokens.shape[1]:
            raise ValueError(
                f"mtp_tokens.shape={mtp_tokens.shape}: need more than the {tokens.shape[1]} "
                "input positions (the inputs and at least the next token)"
            )
    if slot_tables is not None:
        if mesh is None:
            raise ValueError("slot_tables need a mesh (expert placement is across devices)")
        if len(slot_tables) != len(cfg.moe_layers):
            raise ValueError(
                f"len(slot_tables)={len(slot_tables)}: need one per MoE layer "
                f"({len(cfg.moe_layers)})"
            )
    if delay_wgrad and cfg.mla is not None:
        raise ValueError("delay_wgrad=True: not implemented for multi-head latent attention")
    if delay_wgrad is None:  # where the MoE layers exchange tokens, unscanned (see docstring)
        delay_wgrad = mesh is not None and dict(mesh.shape).get("expert", 1) > 1
        delay_wgrad = delay_wgrad and not scan_layers and cfg.mla is None
    if (replay_experts is not None or return_experts) and cfg.moe.router == "expert_choice":
        raise ValueError("router replay: router='expert_choice' has no per-token choice")
    if replay_experts is not None:
        lead = (cfg.num_moe_layers, *tokens.shape)
        _routing.check_replay(replay_experts, lead, cfg.moe, "replay_experts")
    policy = remat_policy(remat)
    shards = 1 if mesh is None else _token_shards(mesh)
    if isinstance(batch_split, bool) or not isinstance(batch_split, int) or batch_split < 1:
        raise ValueError(f"batch_split={batch_split!r}: must be a positive int")
    if tokens.shape[0] % (shards * batch_split):
        raise ValueError(
            f"batch_split={batch_split}: the batch of {tokens.shape[0]} sequences does not "
            f"split into {batch_split} micro-batches on each of {shards} token shards"
        )
    p = cast_floating(params, cfg.dtype)
    compute = None if mesh is None else lm_compute_specs(cfg, mesh)
    constrain = _batch_constraint(mesh)
    cos, sin = rope_tables(tokens.shape[1], cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    embed = _gathered(p["embed"], compute and compute["embed"], mesh)
    x = constrain(jnp.take(embed["embedding"], tokens, axis=0))  # [B, S, D]
    xs = tuple(constrain(m) for m in split_rows(x, batch_split))  # k x [B / k, S, D]
    block = functools.partial(
        split_block,
        cfg=cfg,
        cos=cos,
        sin=sin,
        mesh=mesh,
        constrain=constrain,
        moe=functools.partial(
            _moe_ffn, cfg=cfg, mesh=mesh, strategy=strategy, implementation=implementation
        ),
        attn_impl=_attention_implementation(implementation),
        return_experts=return_experts,
    )
    tables = list(slot_tables) if slot_tables is not None else [None] * cfg.num_moe_layers
    replays = None  # per micro-batch [Lm, B / k, S, K]
    if replay_experts is not None:
        rows = split_rows(jnp.swapaxes(replay_experts, 0, 1), batch_split)
        replays = tuple(jnp.swapaxes(r, 0, 1) for r in rows)
    if scan_layers:
        xs, stats = scanned_layers(
            p, xs, cfg, compute, tables, block, policy, mesh=mesh, delay_wgrad=delay_wgrad,
            replays=replays,
        )  # fmt: skip
    else:
        xs, stats = unscanned_layers(
            p, xs, cfg, compute, tables, block, policy, delay_wgrad=delay_wgrad, replays=replays
        )
    h = constrain(merge_rows(xs))
    x = rms_norm(h, p["final_norm"]["scale"], cfg.norm_eps)
    if cfg.tie_embeddings:
        unembed = embed["embedding"].T
    else:
        unembed = _gathered(p["unembed"], compute and compute["unembed"], mesh)["kernel"]
    logits = unembed_logits(x, unembed)
    if mtp_tokens is None:
        return logits, stats
    mtp = _gathered(p["mtp"], compute and compute["mtp"], mesh)
    block_compute = compute and compute["mtp"][0]["block"]  # the same for every MTP block

    def mtp_block(layer, z):
        (y,), _, _, _ = block(
            layer, (constrain(z),), None, is_moe=cfg.mtp_is_moe, compute=block_compute
        )
        return y

    h0 = _mtp.main_state(h, x, cfg)
    mtp_logits = _mtp.mtp_logits(mtp, h0, mtp_tokens, embed["embedding"], unembed, cfg, mtp_block)
    return logits, stats, mtp_logits


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
        routed_fraction=aux.routed_fraction,
        mean_probs=aux.mean_probs,
        sequence_balance_loss=aux.sequence_balance_loss,
    )


def _attention_implementation(implementation: str) -> str:
    """The attention core that goes with a grouped-matmul `implementation`: the Pallas kernels
    with `"pallas"`, by compile target with `"auto"`, the XLA reference with the XLA paths."""
    return implementation if implementation in ("auto", "pallas") else "xla"


def _attention_stage(layer, x, slots, *, cfg, cos, sin, mesh, constrain, attn_impl, window=None):
    """The first half of a pre-norm block: `x + attention(norm(x))`."""
    with jax.named_scope("attention"):
        h = rms_norm(x, layer["attn_norm"]["scale"], cfg.norm_eps)
        if cfg.mla is not None:
            note_xla_fallback("mla", attn_impl)
            return constrain(x + mla_attention(layer["attn"], h, cos, sin, cfg))
        a = attention(
            layer["attn"], h, cos, sin, mesh=mesh, implementation=attn_impl,
            qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps, wgrad_slots=slots, window=window,
        )  # fmt: skip
        return constrain(x + a)


def _ffn_stage(layer, x, table, next_attn, replay=None, *, is_moe, cfg, constrain, moe):
    """The second half: `(x + ffn(norm(x)), MoEAux or None, the FFN input, the next block's
    attention weight-gradient slots or None)`; `replay`: recorded experts `[B, S, K]`."""
    h = rms_norm(x, layer["ffn_norm"]["scale"], cfg.norm_eps)
    slots = None
    if is_moe:
        with jax.named_scope("moe"):
            side = None if next_attn is None else _wgrad.attention_side(h, next_attn)
            y, aux, slots = moe(layer["moe"], h, slot_table=table, wgrad=side, replay=replay)
    else:
        with jax.named_scope("mlp"):
            y, aux = swiglu_mlp(layer["mlp"], h), None
    return constrain(x + y), aux, h, slots


def split_block(
    layer, xs, table, slots=None, next_attn=None, replay=None, *,
    is_moe, compute, cfg, cos, sin, mesh, constrain, moe, attn_impl, next_compute=None,
    return_experts=False, window=None,
):  # fmt: skip
    """One block over micro-batches `xs` (a tuple), staggered stage by stage.

    Micro-batch `j`'s input to each stage (attention, then the MoE or dense FFN) is paired
    with micro-batch `j - 1`'s output of the same stage in an `optimization_barrier` (the
    batch-split schedule of MaxText's DeepSeek layers). That is the only ordering added: it
    keeps XLA's DotMerger from re-merging the micro-batches' matmuls (they share the weights),
    which would make every micro-batch wait for all of them, and leaves micro-batch `j`'s
    attention free to run while micro-batch `j - 1`'s tokens are in the MoE layer's
    all-to-alls (and micro-batch `j`'s MoE while the next block's attention of `j - 1` runs).
    The barrier is the identity, so is its transpose: the backward is staggered the same way.

    Delayed weight gradients (`moejax.models._wgrad`): `slots` (one per micro-batch, from the
    previous block) make this block's attention leave its weight gradients to the previous
    block's MoE backward; `next_attn` (the next block's attention weights, raw, laid out by
    `next_compute`) makes this block's MoE layer compute the next block's in its backward.

    Router replay: `replay` (one `[B / k, S, K]` per micro-batch, or None) are the MoE layer's
    experts; with `return_experts` its `LMAux` carries the experts chosen (`expert_index`).

    Returns:
      `(xs, LMAux of this layer (merged over micro-batches) or None, the FFN inputs, the next
      block's slots (one per micro-batch) or None)`.
    """
    layer = _gathered(layer, compute, mesh)
    if next_attn is not None:
        next_attn = _gathered(next_attn, next_compute, mesh)
        next_attn = {name: next_attn[name] for name in _wgrad.ATTENTION_SPECS}
    slots = slots if slots is not None else (None,) * len(xs)
    attend = functools.partial(
        _attention_stage,
        cfg=cfg, cos=cos, sin=sin, mesh=mesh, constrain=constrain, attn_impl=attn_impl,
        window=window,
    )  # fmt: skip
    ffn = functools.partial(_ffn_stage, is_moe=is_moe, cfg=cfg, constrain=constrain, moe=moe)
    replay = tuple(map(constrain, replay)) if replay is not None else (None,) * len(xs)
    mid = _staggered(lambda x, s: (attend(layer, x, s), None), list(zip(xs, slots, strict=True)))
    outs = _staggered(
        lambda x, r: _split_ffn_out(ffn(layer, x, table, next_attn, r)),
        [(m, r) for (m, _), r in zip(mid, replay, strict=True)],
    )
    ys = tuple(y for y, _ in outs)
    auxes, hs, next_slots = zip(*(rest for _, rest in outs), strict=True)
    stats = None if auxes[0] is None else merge_stats([_layer_stats(a) for a in auxes])
    if stats is not None and return_experts:
        chosen = [a.topk_indices.reshape(*h.shape[:-1], -1) for a, h in zip(auxes, hs, strict=True)]
        stats = dataclasses.replace(stats, expert_index=constrain(merge_rows(chosen)))
    return ys, stats, hs, (None if next_slots[0] is None else next_slots)


def _split_ffn_out(out):
    y, aux, h, slots = out
    return y, (aux, h, slots)


def _staggered(stage, inputs):
    """`[stage(x, extra) for x, extra in inputs]` (each returning `(array, extra)`),
    micro-batch j's input array fenced on micro-batch j-1's output array."""
    outs = []
    for j, (x, extra) in enumerate(inputs):
        if outs:
            prev, prev_extra = outs[-1]
            x, prev = jax.lax.optimization_barrier((x, prev))
            outs[-1] = (prev, prev_extra)
        with jax.named_scope(f"micro{j}") if len(inputs) > 1 else contextlib.nullcontext():
            outs.append(stage(x, extra))
    return outs


def split_rows(x: jax.Array, k: int) -> tuple[jax.Array, ...]:
    """`k` micro-batches of `x [B, ...]`: micro-batch `j` takes rows `j, j + k, j + 2k, ...`,
    so every device keeps its own rows (the batch is split over the token axes in contiguous
    blocks whose size `k` divides)."""
    if k == 1:
        return (x,)
    grouped = x.reshape(x.shape[0] // k, k, *x.shape[1:])
    return tuple(grouped[:, j] for j in range(k))


def merge_rows(xs) -> jax.Array:
    """The inverse of `split_rows`."""
    if len(xs) == 1:
        return xs[0]
    stacked = jnp.stack(xs, axis=1)
    return stacked.reshape(-1, *stacked.shape[2:])


def merge_stats(stats: list[LMAux]) -> LMAux:
    """One layer's statistics over equal-sized micro-batches, as over their union: counts add,
    per-token means average, and the load-balance loss is re-formed from the averaged `f` and
    `P` (it is a product of two means, not a mean)."""
    if len(stats) == 1:
        return stats[0]
    mean = lambda *a: sum(a) / len(a)  # noqa: E731
    merged = jax.tree.map(mean, *stats)
    e = stats[0].routed_fraction.shape[-1]
    return dataclasses.replace(
        merged,
        expert_counts=sum(s.expert_counts for s in stats),
        load_balance_loss=e * jnp.sum(merged.routed_fraction * merged.mean_probs, axis=-1),
    )


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
    cos, sin = rope_tables(tokens.shape[1], cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    x = jnp.take(p["embed"]["embedding"], tokens, axis=0)

    def moe(layer_params, h, slot_table, wgrad, replay=None):
        return (*moejax.moe_apply(layer_params, h, cfg.moe), None)

    inputs = []
    for i, layer in enumerate(p["layers"]):
        (x,), _, (h,), _ = split_block(
            layer, (x,), None, is_moe=cfg.is_moe(i), compute=None, cfg=cfg, cos=cos, sin=sin,
            mesh=None, constrain=lambda v: v, moe=moe, attn_impl="xla", window=cfg.window(i),
        )  # fmt: skip
        if cfg.is_moe(i):
            inputs.append(h)
    return inputs


def _token_shards(mesh) -> int:
    from moejax.parallel.mesh import token_shards

    return token_shards(mesh)


def _batch_constraint(mesh):
    """Keep activations' batch axis split over the token axes (a no-op without a mesh)."""
    if mesh is None:
        return lambda x: x
    from moejax import parallel

    def constrain(x):
        spec = parallel.activation_spec(mesh, x.ndim)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return constrain
