"""`moe_apply_sharded`: the MoE layer under `jax.shard_map` on a `data`/`expert`/`model` mesh.

Per device: route the local tokens (router replicated), apply capacity per sequence (exactly as
on one device), build the expert-parameter view of the chosen mode, run dispatch -> experts ->
combine on `chunks` token chunks, add the shared experts, `psum` the F-slice partial sums over
`model`, and form the global aux (`psum` over the token axes).

>>> import jax, jax.numpy as jnp, moejax
>>> from moejax import parallel
>>> cfg = moejax.MoEConfig(d_model=16, d_ff=32, num_experts=8, top_k=2, block_size=8)
>>> mesh = parallel.make_mesh((2, 4), ("data", "expert"))
>>> params = parallel.shard_params(moejax.init_moe_params(cfg, jax.random.key(0)), cfg, mesh)
>>> x = parallel.shard_activations(jnp.ones((8, 4, 16)), mesh)
>>> strategy = parallel.Strategy(mode="expert", dispatcher="dropless", chunks=2)
>>> y, aux = jax.jit(parallel.moe_apply_sharded, static_argnums=(2, 3), static_argnames="strategy")(
...     params, x, cfg, mesh, strategy=strategy)
>>> y.shape, int(aux.expert_counts.sum()), float(aux.dropped_fraction)
((8, 4, 16), 64, 0.0)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax import _routing, _wgrad
from moejax._config import MoEConfig
from moejax._experts import shared_mlp
from moejax._layer import empty_outputs, is_traced, resolve_implementation
from moejax._types import MoEAux
from moejax._validate import check_params, check_x, is_empty
from moejax.parallel import _collectives as col
from moejax.parallel import mesh as mesh_lib
from moejax.parallel._aux import sharded_aux
from moejax.parallel._local import local_moe
from moejax.parallel.dispatch_allgather import allgather_reduce_scatter
from moejax.parallel.dispatch_capacity import CapacityStages, capacity_all_to_all, slot_bound
from moejax.parallel.dispatch_dropless import (
    DroplessStages,
    default_bucket,
    dropless_all_to_all,
)
from moejax.parallel.modes import experts_view
from moejax.parallel.pipeline import chunk_slices, pipelined, staged
from moejax.parallel.slots import SlotTable, assign_slots
from moejax.parallel.strategy import Strategy, resolve_strategy


def moe_apply_sharded(
    params: dict,
    x: jax.Array,
    config: MoEConfig,
    mesh,
    *,
    strategy: Strategy | str = "auto",
    implementation: str = "auto",
    stagger: bool = False,
    slot_table: SlotTable | None = None,
    wgrad: _wgrad.Delayed | None = None,
    replay_experts: jax.Array | None = None,
):
    """Apply one MoE layer sharded over `mesh`; the same function as `moejax.moe_apply`.

    Args:
      params: the layer's parameter tree (any placement; `shard_params` puts it in the stored
        layout, see `moejax.parallel.mesh`).
      x: `[B, ..., D]` or `[T, D]` tokens; the leading axis is split over `("data", "expert")`.
        With capacity routing or expert choice, capacity is per sequence (second-to-last axis),
        so each sequence must sit on one device: x needs a sequence axis unless unsharded.
      config: the layer config.
      mesh: a mesh with any subset of the axes `data`, `expert`, `model` (`make_mesh`).
      strategy: a `Strategy` (mode, dispatcher, pipeline degree, bucket) or `"auto"`.
      implementation: grouped matmul, as in `moejax.moe_apply` (not `"reference"`); `"auto"`
        is decided by the platform the program is compiled for (the mesh's devices), so
        compiling for a GPU or TPU mesh runs the Pallas kernels whatever the host.
      stagger: also stagger the pipeline (the same as `Strategy.stagger=True`, which it
        overrides only to turn staggering on).
      slot_table: an expert placement as device arrays (`moejax.parallel.slot_table` of a
        `moejax.placement.Placement`). Then `params["experts"]` are physical, `[P, ...]` with
        identical replicas (`moejax.parallel.slots.to_physical`); each expert's rows are split
        over its replicas. None: the logical `[E, ...]` layout.
      wgrad: weight gradients of a later block for this layer to compute in its backward
        (`moejax._wgrad.Delayed`; what `lm_forward`'s `delay_wgrad` passes): inside the window
        of the return all-to-all's transpose where the layer has one (`mode="expert"` with the
        capacity or dropless dispatcher, `expert` axis over 1 device, no `model` split; the
        last chunk's), otherwise bounded by the whole layer's backward. The layer then also
        returns the slots the later block's projections take (`moejax._wgrad.project`).
      replay_experts: router replay, as in `moejax.moe_apply`: `[..., K]` logical expert ids
        (x's token axes), split over the devices like x. With a placement they are mapped to
        slots like the router's own choice.

    Returns:
      `(y, aux)`: `y` like `x`; `aux` the single-device `MoEAux` over all tokens (per-token fields
      sharded like the tokens, counts and losses global). An empty batch gives what `moe_apply`
      gives (an empty `y`, zero aux). With `wgrad`: `(y, aux, slots)`.

    Raises:
      TypeError, ValueError: before tracing, for the mistakes `moejax.moe_apply` names (params
        tree against the config, the experts' against the placement's `[P, ...]`; x's dtype,
        rank and `D`) and for a mesh or strategy that does not fit x and the config.

    Called eagerly (concrete arrays), it compiles the layer once per shape, config, mesh and
    strategy (`jax.jit` inside); called under the caller's `jit` or `grad` it is traced inline.
    """
    strategy = resolve_strategy(strategy, config)
    resolve_implementation(implementation)  # validates; "auto" is left to the compile target
    if implementation == "reference":
        raise ValueError("implementation='reference': not supported sharded; use another one")
    check_x(x, config)
    if replay_experts is not None:
        _routing.check_replay(replay_experts, x.shape[:-1], config, "replay_experts")
    axes = col.MeshAxes.of(mesh)
    if slot_table is not None and strategy.mode == "expert" and strategy.dispatcher == "capacity":
        raise ValueError(
            "Strategy.dispatcher='capacity' with a placement: capacity buffers are per logical "
            "expert; use dispatcher 'dropless' or 'allgather', or mode 'data'/'tensor'"
        )
    expert_config = config if slot_table is None else physical_config(config, slot_table)
    check_params(params, config, experts_config=expert_config)
    if wgrad is not None and (is_empty(x) or not _window_inside(strategy, axes)):
        layer = functools.partial(
            moe_apply_sharded, params, config=config, mesh=mesh, strategy=strategy,
            implementation=implementation, stagger=stagger, slot_table=slot_table,
            replay_experts=replay_experts,
        )  # fmt: skip
        return _wgrad.beside(layer, x, wgrad)  # no exchange to bound them by
    if is_empty(x):
        return empty_outputs(params["router"], x, config)
    _check(x, config, strategy, axes, mesh)
    static = dict(
        config=config,
        expert_config=expert_config,
        mesh=mesh,
        strategy=strategy,
        implementation=implementation,
        stagger=stagger or strategy.stagger,
    )
    if is_traced(params, x, slot_table, wgrad, replay_experts):  # inside the caller's jit or grad
        return _sharded(params, x, slot_table, wgrad, replay_experts, **static)
    # Called eagerly (as documented): one compiled program per shape, not an op-by-op run of
    # the shard_map body (hundreds of small compilations, ~26 s a call for the README's layer).
    return _sharded_jit(params, x, slot_table, wgrad, replay_experts, **static)


def _window_inside(strategy: Strategy, axes: col.MeshAxes) -> bool:
    """Whether delayed weight gradients go inside the layer: it has a return all-to-all, and
    the gradients' parts vary over the same mesh axes as the rows it carries."""
    exchanges = strategy.mode == "expert" and strategy.dispatcher in ("capacity", "dropless")
    return exchanges and axes.n > 1 and axes.m == 1


def _sharded(
    params, x, slot_table, wgrad, replay=None, *,
    config, expert_config, mesh, strategy, implementation, stagger,
):  # fmt: skip
    """The layer under `jax.shard_map` (arguments checked by `moe_apply_sharded`).

    A `wgrad`'s weights enter broadcast over the token shards, so that each device computes
    its own tokens' part of their gradients; the broadcast's transpose outside sums the parts."""
    axes = col.MeshAxes.of(mesh)
    pspecs = mesh_lib.param_partition_specs(expert_config, mesh)
    xspec = mesh_lib.activation_spec(mesh, x.ndim)
    tspec = P(axes.token or None)
    aux_spec = MoEAux(tspec, tspec, tspec, tspec, *[P()] * 8)
    body = functools.partial(
        _body,
        config=config,
        expert_config=expert_config,
        strategy=strategy,
        axes=axes,
        implementation=implementation,
        stagger=stagger,
        templates=None if wgrad is None else wgrad.templates,
    )
    table_spec = None if slot_table is None else jax.tree.map(lambda _: P(), slot_table)
    replay_spec = None if replay is None else mesh_lib.activation_spec(mesh, replay.ndim)
    in_specs, out_specs = (pspecs, xspec, table_spec, replay_spec), (xspec, aux_spec)
    stacked = None
    if wgrad is not None:
        shards = axes.token_shards
        stacked = {n: jnp.broadcast_to(w, (shards, *w.shape)) for n, w in wgrad.weights.items()}
        in_specs += ({n: mesh_lib.activation_spec(mesh, w.ndim) for n, w in stacked.items()},)
        spec = lambda shape: mesh_lib.activation_spec(mesh, len(shape))  # noqa: E731
        shapes = _wgrad.slot_shapes(wgrad.templates)
        out_specs += (jax.tree.map(lambda sd: spec(sd[0]), shapes, is_leaf=_wgrad.is_shape),)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)(
        params, x, slot_table, replay, *(() if wgrad is None else (stacked,))
    )


_sharded_jit = jax.jit(
    _sharded,
    static_argnames=("config", "expert_config", "mesh", "strategy", "implementation", "stagger"),
)


def physical_config(config: MoEConfig, slot_table: SlotTable) -> MoEConfig:
    """The config the expert phases see under a placement: `P` slots in place of `E` experts
    (routing, with its expert groups, stays logical and uses `config`)."""
    if slot_table.num_experts != config.num_experts:
        raise ValueError(
            f"slot_table has E={slot_table.num_experts} experts, config.num_experts="
            f"{config.num_experts}"
        )
    return config.replace(num_experts=slot_table.num_slots, num_groups=1, topk_groups=1)


def _check(x, config: MoEConfig, strategy: Strategy, axes: col.MeshAxes, mesh) -> None:
    """Sharding constraints on a non-empty `x` (its dtype, rank and `D` are checked first)."""
    mesh_lib.check_batch(x.shape, mesh)
    per_sequence = config.drop_policy == "capacity" or config.router == "expert_choice"
    if per_sequence and x.ndim == 2 and axes.token_shards > 1:
        raise ValueError(
            f"x.shape={x.shape}: capacity is per sequence; give x a sequence axis [B, S, D] so "
            "that no capacity group straddles devices"
        )
    if strategy.mode == "tensor" and (config.d_ff // axes.m) % axes.n:
        raise ValueError(
            f"Strategy.mode='tensor': d_ff/model={config.d_ff // axes.m} not divisible by expert="
            f"{axes.n}"
        )


def _body(
    params, x, slot_table, replay, stacked=None, *,
    config, expert_config, strategy, axes, implementation, stagger, templates,
):  # fmt: skip
    side = None
    if stacked is not None:  # this device's block of the broadcast weights
        shards = axes.token_shards
        local = tuple(t.local(shards) for t in templates)
        side = _wgrad.Delayed({n: w[0] for n, w in stacked.items()}, local)
    shape = x.shape
    seqs = math.prod(shape[:-2]) if x.ndim >= 3 else 1
    xt = x.reshape(-1, config.d_model)
    with jax.named_scope("route"):
        replay = None if replay is None else replay.reshape(-1, replay.shape[-1])
        routing = _routing.route(params["router"], xt, config, num_sequences=seqs, replay=replay)
        if config.drop_policy == "capacity" and config.router != "expert_choice":
            routing = _routing.apply_capacity(routing, config, seqs)
    aux = sharded_aux(routing, config, axes, seqs if x.ndim >= 3 else None)
    if slot_table is not None:
        with jax.named_scope("assign_slots"):
            slots = assign_slots(routing.expert_index, routing.kept, slot_table, _shard(axes))
            routing = dataclasses.replace(routing, expert_index=slots)
        config = expert_config
    experts = experts_view(params["experts"], strategy.mode, axes)
    chunk_tokens = xt.shape[0] // strategy.chunks
    chunk_slices(xt.shape[0], strategy.chunks)  # validates divisibility
    routed = functools.partial(
        _routed,
        experts=experts,
        config=config,
        strategy=strategy,
        axes=axes,
        implementation=implementation,
        sizes=(chunk_tokens, xt.shape[0] // seqs, seqs),
    )
    if stagger and strategy.mode == "expert" and strategy.dispatcher == "capacity":
        slots = slot_bound(config, chunk_tokens, xt.shape[0] // seqs, seqs)
        stages = CapacityStages(experts, config, implementation, axes, slots)
        y, slots = staged(stages, xt, routing, strategy.chunks, side=side)
    elif stagger and strategy.mode == "expert" and strategy.dispatcher == "dropless":
        bucket = _bucket(strategy, chunk_tokens, routing.expert_index.shape[1], axes)
        stages = DroplessStages(experts, config, implementation, axes, bucket, strategy.exchange)
        y, slots = staged(stages, xt, routing, strategy.chunks, side=side)
    else:
        y, slots = pipelined(routed, xt, routing, strategy.chunks, stagger=stagger, side=side)
    if config.shared_width:
        with jax.named_scope("shared_experts"):
            y = y + shared_mlp(params["shared"], xt, config)
    y = col.psum(y, axes.model)
    return (y.reshape(shape), aux) if side is None else (y.reshape(shape), aux, slots)


def _shard(axes: col.MeshAxes):
    """This device's index over the token axes (`data` major)."""
    index = 0
    for name in axes.token:
        index = index * jax.lax.axis_size(name) + jax.lax.axis_index(name)
    return index


def _routed(xc, rc, side, *, experts, config, strategy, axes, implementation, sizes):
    """`(routed output of one chunk [Tc, D] (partial over model), side's slots or None)`;
    `side` only where `_window_inside`."""
    chunk_tokens, seq_len, seqs = sizes
    if strategy.mode == "data":
        with jax.named_scope("experts"):
            args = (rc.expert_index, rc.weight, rc.kept)
            return local_moe(xc, *args, experts, config, implementation), None
    if strategy.mode == "tensor" or strategy.dispatcher == "allgather":
        return allgather_reduce_scatter(xc, rc, experts, config, implementation, axes), None
    if strategy.dispatcher == "capacity":
        slots = slot_bound(config, chunk_tokens, seq_len, seqs)
        return capacity_all_to_all(xc, rc, experts, config, implementation, axes, slots, side)
    bucket = _bucket(strategy, chunk_tokens, rc.expert_index.shape[1], axes)
    return dropless_all_to_all(
        xc, rc, experts, config, implementation, axes, bucket, strategy.exchange, side
    )


def _bucket(strategy, chunk_tokens, k, axes):
    """Dropless rows per (source, destination) pair and round, for one chunk."""
    if strategy.bucket is None:
        return default_bucket(chunk_tokens, k, axes.n)
    return -(-strategy.bucket // strategy.chunks)
