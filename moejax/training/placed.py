"""Expert placement in training: physical expert state, replica gradients, migrations.

With `TrainConfig.expert_slots_per_device = S > 0` every MoE layer's experts live in
`P = N·S` physical slots (`N` = the mesh's `expert` axis): the in-memory `TrainState` holds
`experts/* [P, ...]` in its parameters and in its optimizer moments, hot experts as several
identical replicas (`moejax.parallel.slots`). Checkpoints hold the logical `[E, ...]` form, so
they restore onto any placement and any mesh.

The math is the unreplicated model's (docs/design.md, invariant "placement never changes what is
computed"):

1. the forward splits each expert's rows over its replicas (`moejax.parallel.moe_apply_sharded`);
2. the replica gradients of an expert are summed and the sum handed to every replica
   (`combine_grads`): each replica sees the logical gradient; only experts held on several
   devices communicate (one packed all-reduce per layer, sized by how many there are);
3. the clipping norm is the logical one: a slot of an expert with `r` replicas counts `1/r`
   (`logical_norm`), so clipping scales exactly as without placement;
4. AdamW is elementwise: identical replicas with identical gradients and moments stay identical
   bit for bit, and each follows the unreplicated update.

A re-placement of layer `j` gathers its new slots from the old ones (`migrate_fn(..., j)` with
`moejax.placement.migration_sources`), parameters and Adam moments alike, in place (the state is
donated: no other leaf is copied). The slot tables are an argument of the jitted step, not
constants compiled into it: a new placement reuses the compiled step and the compiled gather,
so re-placing costs one gather per moved layer and no compilation.

The controller the loop runs (`controller_factory`) prices with this run's layer shapes and
either datasheet figures or this mesh's own, timed by `measure_hardware`;
`moejax.training.placement_runtime` drives it step by step.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec
from optax.transforms import MaskedNode

from moejax.models import LMConfig
from moejax.parallel import mesh as mesh_lib
from moejax.parallel import slots
from moejax.placement import (
    H100_NVLINK,
    TPU_V5P_ICI,
    ControllerConfig,
    HardwareModel,
    Placement,
    PlacementController,
    Workload,
)
from moejax.training._config import TrainConfig
from moejax.training.agree import from_process_0
from moejax.training.optimizer import make_optimizer


def initial_placements(model_cfg: LMConfig, train_cfg: TrainConfig, mesh) -> list[Placement]:
    """The static placement of every MoE layer on `mesh`.

    Expert `e` on device `e // G` (`G = E / N`); with `S > G` slots per device the spare slots
    hold local duplicates (they move no token and change no load) until the controller uses them.
    Without placement (`S = 0`) the layout is the logical one, `S = G`.
    """
    n = 1 if mesh is None else mesh_lib.axis_size(mesh, "expert")
    e = model_cfg.moe.num_experts
    s = train_cfg.expert_slots_per_device or e // n
    return [Placement.identity(e, n, s) for _ in model_cfg.moe_layers]


def slot_tables(placements) -> tuple[slots.SlotTable, ...]:
    """The device form of each layer's placement (the step's `slot_tables` argument)."""
    return tuple(slots.slot_table(p) for p in placements)


def map_experts(tree: dict, model_cfg: LMConfig, fn) -> dict:
    """`tree` (parameter-shaped) with each MoE layer's `experts` subtree replaced by
    `fn(j, experts)`, `j` the MoE-layer index in `[0, Lm)`."""
    layers = list(tree["layers"])
    for j, i in enumerate(model_cfg.moe_layers):
        moe = layers[i]["moe"]
        layers[i] = {**layers[i], "moe": {**moe, "experts": fn(j, moe["experts"])}}
    return {**tree, "layers": layers}


def combine_grads(grads: dict, slot_tables, model_cfg: LMConfig, mesh=None) -> dict:
    """Every replica receives the sum of its expert's replica gradients (module docstring, 2).

    On `mesh`, only the experts held on several devices exchange gradients, in one packed
    all-reduce per layer over `expert` (`moejax.parallel.slots.combine_replica_grads`); the
    gradients keep their stored layout (`lm_partition_specs`)."""
    if mesh is None:
        specs = [None] * len(model_cfg.moe_layers)
    else:
        from moejax.models import lm_partition_specs

        tree = lm_partition_specs(model_cfg, mesh)["layers"]
        specs = [tree[i]["moe"]["experts"] for i in model_cfg.moe_layers]
    return map_experts(
        grads,
        model_cfg,
        lambda j, g: slots.combine_replica_grads(g, slot_tables[j], mesh, specs[j]),
    )


def logical_norm(grads: dict, slot_tables, model_cfg: LMConfig) -> jax.Array:
    """The global norm the unreplicated gradient has, from combined physical gradients.

    A slot of an expert with `r` replicas holds that expert's whole gradient, so its square
    counts `1/r`: the sum over slots is the sum over experts.
    """

    def scaled(j, experts):
        t = slot_tables[j]
        w = jax.lax.rsqrt(t.replica_count[t.slot_to_expert].astype(jnp.float32))  # [P]
        return jax.tree.map(lambda g: g * w.reshape((-1,) + (1,) * (g.ndim - 1)), experts)

    return optax.tree.norm(map_experts(grads, model_cfg, scaled))


def clip_by_norm(grads, norm: jax.Array, max_norm: float):
    """`optax.clip_by_global_norm`'s formula with the norm given (the logical one)."""
    return jax.tree.map(
        lambda t: jax.lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm), grads
    )


def _gather(state, index: jax.Array, model_cfg: LMConfig, train_cfg: TrainConfig, layers):
    """`state` with every expert leaf (parameters and moments) of MoE layer `layers[n]` gathered
    along its slot axis by `index[n]`; the other leaves are returned as they are."""
    row = {j: n for n, j in enumerate(layers)}
    take = lambda j, x: x if j not in row else jnp.take(x, index[row[j]], axis=0)
    params = map_experts(
        state.params, model_cfg, lambda j, ex: jax.tree.map(functools.partial(take, j), ex)
    )
    # A parameter-shaped tree of MoE-layer indices (-1: not an expert leaf) lets
    # `optax.tree_map_params` find the moments of each expert leaf.
    labels = map_experts(
        jax.tree.map(lambda _: -1, state.params),
        model_cfg,
        lambda j, ex: jax.tree.map(lambda _: j, ex),
    )
    masked = lambda x: isinstance(x, MaskedNode)
    opt_state = optax.tree_map_params(
        make_optimizer(train_cfg),
        lambda x, j: x if isinstance(x, MaskedNode) else take(j, x),
        state.opt_state,
        labels,
        is_leaf=masked,
    )
    return dataclasses.replace(state, params=params, opt_state=opt_state)


@functools.lru_cache(maxsize=32)
def gather_fn(
    model_cfg: LMConfig, train_cfg: TrainConfig, mesh, layers: tuple[int, ...], donate: bool
):
    """`_gather` of MoE layers `layers`, jitted (output sharded like the state), cached.

    With `donate`, the input state is donated: the leaves of the other layers and every
    non-expert leaf alias their input buffers, so a migration only writes the moved layers.
    """
    gather = functools.partial(_gather, model_cfg=model_cfg, train_cfg=train_cfg, layers=layers)
    kw = dict(donate_argnums=0) if donate else {}
    if mesh is None:
        return jax.jit(gather, **kw)
    from moejax.training.state import state_shardings

    return jax.jit(gather, out_shardings=state_shardings(model_cfg, train_cfg, mesh), **kw)


def gather_experts(state, index, model_cfg: LMConfig, train_cfg: TrainConfig, mesh=None):
    """Every MoE layer's expert leaves gathered, jitted (output sharded like the state;
    compiled once per `index` shape; `state` is not donated).

    Args:
      state: a `TrainState` whose expert leaves have `X` slots.
      index: `[Lm, Y]` int: slot `y` of layer `j` takes old slot `index[j, y]`.
      model_cfg, train_cfg, mesh: as for the step.

    Returns:
      The state with `Y` slots per expert leaf. Uses: `to_physical` (`index` = each placement's
      `slot_to_expert`, `X = E`, `Y = P`) and `to_logical` (each expert's first replica,
      `Y = E`). Migrations use `migrate_fn` (one layer, donated).
    """
    index = jnp.asarray(np.asarray(index), jnp.int32)
    layers = tuple(range(len(model_cfg.moe_layers)))
    return gather_fn(model_cfg, train_cfg, mesh, layers, False)(state, index)


def migrate_fn(model_cfg: LMConfig, train_cfg: TrainConfig, mesh, layer: int):
    """Jitted, donating `(state, sources [1, P]) -> state` that re-places MoE layer `layer`:
    new slot `p` takes old slot `sources[0, p]` (`moejax.placement.migration_sources`), for the
    parameters and the Adam moments; nothing else is copied."""
    return gather_fn(model_cfg, train_cfg, mesh, (layer,), True)


def to_physical(state, placements, model_cfg, train_cfg, mesh=None):
    """Logical state (`[E, ...]` experts) -> physical (`[P, ...]`) under `placements`."""
    index = np.stack([p.slot_to_expert for p in placements])
    return gather_experts(state, index, model_cfg, train_cfg, mesh)


def to_logical(state, placements, model_cfg, train_cfg, mesh=None):
    """Physical state -> logical, reading each expert from its first replica (replicas are
    identical, so nothing is lost)."""
    index = np.stack([[p.replicas_of(e)[0] for e in range(p.num_experts)] for p in placements])
    return gather_experts(state, index, model_cfg, train_cfg, mesh)


# The controller the training loop runs by default: `ControllerConfig()` with a warm-up. The
# router is untrained at step 0 and its routing moves fastest in the first steps; on the tiny LM
# a re-placement decided on the first two steps' counts measured a rise of the imbalance, and
# the first ones, forecast before any candidate was measured, measured falls far below their
# forecasts. Replayed on three tiny-LM traces with the CPU figures measured for one of them, the
# modeled MoE time (replica sync and migrations included) was 1.8-2.2% below the same controller
# without the warm-up (BENCHMARKS.md, "Placement in training").
TRAINING_CONTROLLER = ControllerConfig(warmup_steps=10, min_calibration=1)

# The datasheet figures `hardware="auto"` prices with on each accelerator platform.
DATASHEET = {"gpu": H100_NVLINK, "tpu": TPU_V5P_ICI}


def controller_factory(
    model_cfg: LMConfig,
    train_cfg: TrainConfig,
    mesh,
    seq_len: int,
    config=None,
    hardware="auto",
):
    """A factory `placements -> moejax.placement.PlacementController` for `train(controller=)`.

    The cost model gets this run's layer shapes (`Workload`: tokens per device per step, top-k,
    `D`, `F`, bytes per element of the parameter dtype, Adam's two moments) and `hardware`: a
    `moejax.placement.HardwareModel`, `"measured"`: this mesh's own figures
    (`measure_hardware`, timed once, here), or `"auto"` (the default):
    measured on a CPU mesh, whose figures are nothing like an accelerator's (a migration priced
    with H100 figures there is 10^4x below what it takes), else the datasheet figures of the
    platform (`DATASHEET`: H100 on GPU, TPU v5p on TPU). A CPU mesh without an `expert` axis of
    2 devices or more has nothing to measure and gets H100's.

    Replica gradient sync is charged as this step runs it (`Workload(replica_sync="packed")`,
    nothing assumed hidden): a placement whose experts each sit on one device (local duplicates
    included) costs none; one with `m` experts held on two devices or more pays a ring
    all-reduce over the `expert` axis of `B` expert gradients (`B >= m`, the packed buffer of
    `moejax.parallel.slots.combine_replica_grads`; `moejax.placement.cost_model.
    packed_sync_gradients`), so the controller replicates across devices only where the
    balance gained outweighs that all-reduce.

    Args:
      config: the controller's `ControllerConfig` (default `TRAINING_CONTROLLER`).
    """
    moe = model_cfg.moe
    shards = 1 if mesh is None else mesh_lib.token_shards(mesh)
    param_bytes = jnp.dtype(model_cfg.param_dtype).itemsize
    moment_bytes = jnp.dtype(train_cfg.moment_dtype or model_cfg.param_dtype).itemsize
    workload = Workload(
        tokens_per_device=max(1, train_cfg.batch_size * seq_len // shards),
        top_k=moe.top_k,
        d_model=moe.d_model,
        d_ff=moe.d_ff,
        matmuls_per_expert=3 if moe.gated else 2,
        activation_bytes=jnp.dtype(model_cfg.dtype).itemsize,
        param_bytes=param_bytes,
        state_bytes_per_param=param_bytes + 2 * moment_bytes,  # the parameter, Adam's moments
        num_groups=moe.num_groups,  # group-limited routing: the planner keeps groups on few nodes
        topk_groups=moe.topk_groups,
        replica_sync="packed",  # combine_replica_grads' all-reduce (docstring)
    )
    if isinstance(hardware, str):
        hardware = _hardware(hardware, mesh, workload)
    return functools.partial(
        PlacementController,
        hardware=hardware or H100_NVLINK,
        workload=workload,
        config=config or TRAINING_CONTROLLER,
    )


def _hardware(name: str, mesh, workload: Workload) -> HardwareModel:
    """The `HardwareModel` `controller_factory(hardware=name)` means on `mesh`."""
    if name not in ("auto", "measured"):
        raise ValueError(f"hardware must be a HardwareModel, 'auto' or 'measured', got {name!r}")
    platform = "cpu" if mesh is None else mesh.devices.flat[0].platform
    expert = 1 if mesh is None else mesh_lib.axis_size(mesh, mesh_lib.EXPERT)
    if name == "auto" and (platform != "cpu" or expert < 2):
        return DATASHEET.get(platform, H100_NVLINK)
    return measure_hardware(mesh, workload)


def _median_s(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_hardware(mesh, workload: Workload, *, repeats: int = 5) -> HardwareModel:
    """Per-device FLOP/s and all-to-all bytes/s of `mesh`, timed on `workload`'s shapes: the
    cost model's figures for the machine a run trains on.

    `moejax.placement` ships datasheet figures for H100 and TPU v5p. A controller deciding for
    the machine it runs on should use that machine's figures: on 8 simulated CPU devices
    sharing two cores a matmul is ~10^5x slower than on an H100 while a device-to-device copy is
    a memory copy, so the balance between compute, all-to-all and replica sync, which is all the
    controller weighs, is nothing like a GPU's. Timed on every device of the mesh at once (as
    in a training step): one expert-shaped matmul (`T·K` rows of `D x F`) and one all-to-all of
    those rows over the `expert` axis; the medians are kept. With several processes every
    process times them (the programs span the mesh) and all get process 0's figures
    (`moejax.training.agree.from_process_0`).

    Args:
      mesh: a `moejax.parallel` mesh with an `expert` axis of at least 2 devices.
      workload: the layer shape (`T·K` rows, `D`, `F`, activation bytes).
      repeats: timed runs after one warm-up; the medians are used.

    Returns:
      `HardwareModel("measured", flops_per_s, link_bytes_per_s)` (one flat network).

    Raises:
      ValueError: the mesh has no `expert` axis of >= 2 devices.
    """
    n = mesh_lib.axis_size(mesh, mesh_lib.EXPERT)
    if n < 2:
        raise ValueError(f"measuring the all-to-all needs an expert axis of >= 2, got {n}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    axes = tuple(mesh.axis_names)
    shards = int(np.prod([mesh.shape[a] for a in axes]))
    rows = max(n, workload.rows_per_step // n * n)  # [R] per device, a multiple of N
    dtype = {2: jnp.bfloat16, 4: jnp.float32}.get(workload.activation_bytes, jnp.float32)
    d, f = workload.d_model, workload.d_ff
    key = jax.random.key(0)
    x = jax.random.normal(key, (shards * rows, d), dtype)
    w = jax.random.normal(key, (d, f), dtype) / np.sqrt(d)
    spec = PartitionSpec(axes)

    matmul = jax.jit(
        jax.shard_map(
            lambda x, w: x @ w, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=spec
        )
    )

    def exchange(x):  # [R, D] -> [N, R / N, D], swapped over the expert axis
        x = x.reshape(n, rows // n, d)
        return jax.lax.all_to_all(x, mesh_lib.EXPERT, 0, 0, tiled=True).reshape(rows, d)

    all_to_all = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=spec, out_specs=spec))
    flops = 2.0 * rows * d * f
    sent = rows * d * workload.activation_bytes * (n - 1) / n
    timed = [_median_s(matmul, x, w, repeats=repeats), _median_s(all_to_all, x, repeats=repeats)]
    # Every process timed the same programs (they span the mesh); process 0's figures are the
    # run's, so every process's controller prices with the same ones.
    matmul_s, all_to_all_s = from_process_0("placement/hardware", timed)
    return HardwareModel(
        "measured", flops_per_s=flops / matmul_s, link_bytes_per_s=sent / all_to_all_s
    )
