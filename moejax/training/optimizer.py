"""The optimizer: AdamW with linear warm-up and cosine decay, global-norm clipping, and the
DeepSeek correction biases held out of it.

`router/score_correction_bias` is not a trained parameter: it only shifts which experts are
chosen (its gradient is zero) and is nudged against the observed load by
`moejax.update_correction_bias` after every step. `optax.multi_transform` gives it
`optax.set_to_zero()`, so Adam keeps no moments for it, weight decay never shrinks it and it
does not count in the clipping norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from moejax.training._config import TrainConfig

TRAIN, FROZEN = "train", "frozen"
FROZEN_NAMES = frozenset({"score_correction_bias"})


def _name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "idx", last)))


def param_labels(params) -> dict:
    """`"frozen"` for the correction biases, `"train"` for every other leaf."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: FROZEN if _name(path) in FROZEN_NAMES else TRAIN, params
    )


def decay_mask(params) -> dict:
    """Weight decay on matrices (ndim >= 2: projections, experts, embeddings) only."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warm-up from 0 to `learning_rate` over `warmup_steps`, then cosine decay to
    `learning_rate * min_lr_ratio` at `steps`.

    >>> from moejax.training import TrainConfig
    >>> s = learning_rate_schedule(TrainConfig(steps=100, warmup_steps=10, learning_rate=1.0))
    >>> float(s(0)), float(s(10)), round(float(s(100)), 6)
    (0.0, 1.0, 0.1)
    """
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.steps,
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


def _moments_in(dtype, adam: optax.GradientTransformation) -> optax.GradientTransformation:
    """`adam` (`optax.scale_by_adam`) with both moments stored in `dtype` between steps and
    computed in fp32: widened before `adam.update` (whose `b * moment` would otherwise round to
    `dtype` before the gradient's term is added), rounded once after it."""

    def init(params):
        state = adam.init(params)
        return state._replace(
            mu=optax.tree.cast(state.mu, dtype), nu=optax.tree.cast(state.nu, dtype)
        )

    def update(updates, state, params=None):
        wide = state._replace(
            mu=optax.tree.cast(state.mu, jnp.float32), nu=optax.tree.cast(state.nu, jnp.float32)
        )
        updates, new = adam.update(updates, wide, params)
        return updates, new._replace(
            mu=optax.tree.cast(new.mu, dtype), nu=optax.tree.cast(new.nu, dtype)
        )

    return optax.GradientTransformation(init, update)


def _adamw(cfg: TrainConfig) -> optax.GradientTransformation:
    """`optax.adamw` (the same chain, so the same state tree), its moments in
    `cfg.moment_dtype`."""
    if cfg.moment_dtype is None:
        return optax.adamw(
            learning_rate_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    adam = optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    return optax.chain(
        _moments_in(cfg.moment_dtype, adam),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask),
        optax.scale_by_learning_rate(learning_rate_schedule(cfg)),
    )


def make_optimizer(cfg: TrainConfig, *, clip: bool = True) -> optax.GradientTransformation:
    """`clip_by_global_norm -> adamw(schedule, mask=matrices)` on the trained leaves, zero
    updates for the correction biases (module docstring). Adam's moments are stored in
    `cfg.moment_dtype` (None: the parameters' dtype).

    `clip=False` puts `optax.identity()` (the same empty state) in place of the clipping, for
    steps that clip by a norm of their own (replicated experts: `moejax.training.placed`).

    The schedule is indexed by the count of *applied* updates (Adam's own step count), so a
    skipped non-finite step does not advance it.
    """
    adamw = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm) if clip else optax.identity(),
        _adamw(cfg),
    )
    return optax.multi_transform({TRAIN: adamw, FROZEN: optax.set_to_zero()}, param_labels)
