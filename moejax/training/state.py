"""`TrainState`: everything the jitted step carries, its initialisation and its shardings.

Sharding on a mesh (`moejax.parallel` axes): parameters as `moejax.models.lm_partition_specs`
(MoE experts over `expert`, the rest replicated), each optimizer moment like its parameter,
scalars and the RNG replicated. Batches `[B, S + 1]` split over `("data", "expert")`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from optax.transforms import MaskedNode

from moejax.models import LMConfig, init_lm_params, lm_partition_specs
from moejax.training._config import TrainConfig
from moejax.training.optimizer import make_optimizer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """The training state (a pytree; every leaf is checkpointed).

    Attributes:
      step: `[]` int32 steps taken, skipped ones included (= batches consumed).
      updates: `[]` int32 optimizer updates applied (indexes the learning-rate schedule).
      skipped: `[]` int32 steps skipped because the loss or gradient norm was not finite.
      params: the model parameters (`moejax.models.init_lm_params`).
      opt_state: the optax state of `make_optimizer`.
      rng: `[2]` uint32 raw PRNG key data, split once per step. No preset draws random numbers
        while training (no dropout, no router noise); the key is carried and checkpointed so
        that a model that does resumes exactly.
    """

    step: jax.Array
    updates: jax.Array
    skipped: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array


def _init(model_cfg: LMConfig, train_cfg: TrainConfig, params=None) -> TrainState:
    key_params, key_rng = jax.random.split(jax.random.key(train_cfg.seed))
    if params is None:
        params = init_lm_params(model_cfg, key_params)
    zero = jnp.zeros((), jnp.int32)
    return TrainState(
        step=zero,
        updates=zero,
        skipped=zero,
        params=params,
        opt_state=make_optimizer(train_cfg).init(params),
        rng=jax.random.key_data(key_rng),
    )


def abstract_state(model_cfg: LMConfig, train_cfg: TrainConfig) -> TrainState:
    """The state as `jax.ShapeDtypeStruct`s (nothing allocated)."""
    return jax.eval_shape(functools.partial(_init, model_cfg, train_cfg))


def state_shardings(model_cfg: LMConfig, train_cfg: TrainConfig, mesh) -> TrainState:
    """A `TrainState` of `NamedSharding`s on `mesh` (module docstring)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    param_specs = lm_partition_specs(model_cfg, mesh)
    abstract = abstract_state(model_cfg, train_cfg)
    named = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs)
    # Moments follow their parameter; the frozen correction biases have no moments (optax puts
    # a `MaskedNode` there, kept as is).
    masked = lambda x: isinstance(x, NamedSharding | MaskedNode)
    opt = optax.tree_map_params(
        make_optimizer(train_cfg),
        lambda leaf, sharding: leaf if isinstance(leaf, MaskedNode) else sharding,
        abstract.opt_state,
        named,
        transform_non_params=lambda _: replicated,
        is_leaf=masked,
    )
    return TrainState(
        step=replicated,
        updates=replicated,
        skipped=replicated,
        params=named,
        opt_state=opt,
        rng=replicated,
    )


def init_train_state(
    model_cfg: LMConfig, train_cfg: TrainConfig, mesh=None, params=None
) -> TrainState:
    """Initial state from `train_cfg.seed`, created sharded on `mesh` (or on one device).

    The values do not depend on the mesh (jax's partitionable threefry), so runs on different
    meshes or process counts start from the same parameters. Given `params` (a converted model,
    on `mesh`'s parameter shardings), the state holds them and nothing is initialised randomly
    but the step's rng: the same state as replacing the initialised parameters, without
    computing (and holding) a random model first.
    """
    init = functools.partial(_init, model_cfg, train_cfg)
    placed = {} if mesh is None else {"out_shardings": state_shardings(model_cfg, train_cfg, mesh)}
    if params is None:
        return jax.jit(init, **placed)()
    return jax.jit(init, **placed)(params)


def batch_sharding(mesh) -> NamedSharding:
    """Sharding of a `[B, S + 1]` token batch: B over the token axes `("data", "expert")`."""
    from moejax import parallel

    return NamedSharding(mesh, parallel.activation_spec(mesh, 2))


def global_batch(batch: np.ndarray, mesh=None) -> jax.Array:
    """The host batch as a (global) device array.

    Every process holds the whole global batch (the data iterator is deterministic and cheap),
    and each contributes the rows of its own devices, so the same code runs single- and
    multi-process.
    """
    if mesh is None:
        return jnp.asarray(batch)
    return jax.make_array_from_callback(batch.shape, batch_sharding(mesh), lambda idx: batch[idx])
