"""The jitted training step: loss, gradients, AdamW update, correction-bias update, and the
non-finite guard; plus the evaluation step.

One step, on device, with nothing read back to the host:

1. forward and backward of `lm_loss` (cross-entropy + weighted mean aux losses);
2. the optax update (clipping, AdamW) on the trained leaves;
3. the correction-bias update of every MoE layer from its expert counts (models with
   `score_correction_bias`), outside the optimizer;
4. with expert placement (`TrainConfig.expert_slots_per_device`, `slot_tables` given): replica
   gradients are combined and clipping uses the logical norm, so the update is the unreplicated
   one (`moejax.training.placed`);
5. the guard: if the loss or the gradient norm is not finite, the new parameters and optimizer
   state are discarded (`jnp.where` per leaf, so the old values survive bit for bit), `skipped`
   counts it, and training goes on with the next batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

import moejax
from moejax.models import LMAux, LMConfig, lm_forward
from moejax.models._mtp import mtp_cross_entropy
from moejax.training import placed
from moejax.training._config import TrainConfig
from moejax.training.optimizer import learning_rate_schedule, make_optimizer
from moejax.training.state import TrainState, batch_sharding, state_shardings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """What one step reports (small arrays, fetched by the host one step late)."""

    loss: jax.Array  # [] fp32 mean next-token cross-entropy (nats)
    total_loss: jax.Array  # [] fp32 loss + weighted aux losses (what is differentiated)
    load_balance_loss: jax.Array  # [] fp32 the active balance loss (`TrainConfig.load_balance`),
    #                               mean over MoE layers
    z_loss: jax.Array  # [] fp32 mean over MoE layers
    grad_norm: jax.Array  # [] fp32 global norm before clipping
    learning_rate: jax.Array  # [] fp32 of this step's update
    finite: jax.Array  # [] bool; False = the step was skipped
    expert_counts: jax.Array  # [Lm, E] int32
    dropped_fraction: jax.Array  # [Lm] fp32
    router_entropy: jax.Array  # [Lm] fp32 nats
    mtp_loss: jax.Array | None = None  # [] fp32 mean over the MTP blocks of their cross-entropy


def balance_loss(aux: LMAux, train_cfg: TrainConfig, fraction=None) -> jax.Array:
    """The balance loss `TrainConfig.load_balance` selects, mean over the MoE layers `[]`.

    Args:
      aux: the forward's statistics.
      train_cfg: the config.
      fraction: for `"global_batch"` with micro-batches, `[Lm, E]` the fraction of the whole
        step's assignments routed to each expert (a constant: counts carry no gradient); None
        when the forward covers the whole batch (then the Switch form over it is the global one).
    """
    if train_cfg.load_balance == "sequence":
        return aux.sequence_balance_loss.mean()
    if train_cfg.load_balance == "global_batch" and fraction is not None:
        e = aux.mean_probs.shape[-1]
        return (e * jnp.sum(jax.lax.stop_gradient(fraction) * aux.mean_probs, axis=-1)).mean()
    return aux.load_balance_loss.mean()


def lm_loss(
    params, batch, model_cfg: LMConfig, train_cfg: TrainConfig, balance_fraction=None, **forward_kw
):
    # (`forward_kw` may carry `slot_tables`, one `SlotTable` per MoE layer.)
    """Training objective of one batch.

    Args:
      params: the model parameters.
      batch: `[B, S + 1]` int32 windows: inputs `[:, :-1]`, targets `[:, 1:]`; or a dict of
        them (`"tokens"`) and `"replay_experts"`: `[Lm, B, S, K]` int experts recorded per MoE
        layer for the inputs (router replay, `moejax.models.lm_forward`).
      model_cfg, train_cfg: the configs.
      balance_fraction: `[Lm, E]` expert fractions of the whole step (`balance_loss`), or None.
      **forward_kw: `mesh`, `strategy`, `implementation` for `lm_forward`.

    Returns:
      `(total, (cross_entropy, LMAux, mtp_loss or None))` with `total = cross_entropy +
      load_balance_weight * balance_loss + z_loss_weight * mean(z_loss) + mtp_loss_weight *
      mtp_loss`. Aux losses are averaged over the MoE layers so that their weights do not scale
      with depth; `mtp_loss` (with `mtp_loss_weight > 0` and a model with `mtp_layers`) is the
      mean over the multi-token-prediction blocks of their cross-entropy
      (`moejax.models._mtp`: block `k` predicts `tokens[:, i + k + 1]`).
    """
    tokens, replay = batch_parts(batch)
    mtp = train_cfg.mtp_loss_weight > 0 and model_cfg.mtp_layers > 0
    out = lm_forward(
        params,
        tokens[:, :-1],
        model_cfg,
        replay_experts=replay,
        mtp_tokens=tokens if mtp else None,
        **forward_kw,
    )
    logits, aux = out[:2]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    total = (
        ce
        + train_cfg.load_balance_weight * balance_loss(aux, train_cfg, balance_fraction)
        + train_cfg.z_loss_weight * aux.z_loss.mean()
    )
    mtp_loss = None
    if mtp:
        mtp_loss = mtp_cross_entropy(out[2], tokens).mean()
        total = total + train_cfg.mtp_loss_weight * mtp_loss
    return total, (ce, aux, mtp_loss)


def batch_parts(batch):
    """`(tokens [B, S + 1], replay_experts [Lm, B, S, K] or None)` of a step's batch: an array
    of tokens, or a dict with `"tokens"` and optionally `"replay_experts"`."""
    if not isinstance(batch, dict):
        return batch, None
    unknown = set(batch) - {"tokens", "replay_experts"}
    if unknown or "tokens" not in batch:
        raise ValueError(
            f"batch keys {sorted(batch)}: need 'tokens' and optionally 'replay_experts'"
        )
    return batch["tokens"], batch.get("replay_experts")


def _split_batch(batch, n):
    """`[n, ...]` micro-batches of a batch: micro-batch `j` takes rows `j, j + n, ...`."""
    tokens, replay = batch_parts(batch)
    rows, width = tokens.shape
    tokens = tokens.reshape(rows // n, n, width).swapaxes(0, 1)  # [n, B / n, S + 1]
    if replay is None:
        return tokens
    lm, _, s, k = replay.shape
    replay = replay.reshape(lm, rows // n, n, s, k).transpose(2, 0, 1, 3, 4)  # [n, Lm, B/n, S, K]
    return {"tokens": tokens, "replay_experts": replay}


def _global_fraction(params, micro, model_cfg, forward_kw):
    """`[Lm, E]` expert fractions over all micro-batches `micro [n, B / n, S + 1]`: a forward
    pass per micro-batch (no backward), on device. Equal-sized micro-batches, so the mean of
    their fractions is the whole batch's."""

    def body(acc, mb):
        tokens, replay = batch_parts(mb)
        _, aux = lm_forward(params, tokens[:, :-1], model_cfg, replay_experts=replay, **forward_kw)
        return acc + aux.routed_fraction, None

    e = model_cfg.moe.num_experts
    zeros = jnp.zeros((model_cfg.num_moe_layers, e), jnp.float32)
    total, _ = jax.lax.scan(body, zeros, micro)
    return total / jax.tree.leaves(micro)[0].shape[0]


def _accumulated(grad_fn, params, batch, model_cfg, train_cfg, forward_kw):
    """`grad_fn` over `TrainConfig.microbatches` equal slices of the batch, one after the other
    (a `jax.lax.scan`, so activations are those of one micro-batch): the mean loss and
    gradients, expert counts summed, other statistics averaged.

    Micro-batch `j` takes rows `j, j + n, j + 2n, ...`, so each device keeps its own rows (the
    batch is split over the token axes in contiguous blocks; each block's size is a multiple of
    `n`, checked by `TrainConfig` against the mesh in `moejax.training.loop`). Cross-entropy,
    z-loss and their gradients equal the whole batch's; the `"micro_batch"` load-balance loss,
    nonlinear in the batch's statistics, is the mean of the micro-batches' (as Megatron-LM and
    MaxText do); the `"global_batch"` one takes the whole batch's expert fractions from a
    forward pass over all micro-batches first (`_global_fraction`), and so equals the whole
    batch's, gradients included. Also returns those fractions (None for other losses).
    """
    n = train_cfg.microbatches
    micro = _split_batch(batch, n)  # [n, B / n, S + 1] (and [n, Lm, B / n, S, K])
    fraction = None
    if train_cfg.load_balance == "global_batch":
        fraction = _global_fraction(params, micro, model_cfg, forward_kw)

    def body(acc, mb):
        out, grads = grad_fn(params, mb, model_cfg, train_cfg, fraction, **forward_kw)
        return jax.tree.map(jnp.add, acc, (out, grads)), None

    zeros = jax.tree.map(
        jnp.zeros_like,
        jax.eval_shape(
            lambda: grad_fn(
                params,
                jax.tree.map(lambda a: a[0], micro),
                model_cfg,
                train_cfg,
                fraction,
                **forward_kw,
            )  # fmt: skip
        ),
    )
    (out, grads), _ = jax.lax.scan(body, zeros, micro)
    total, (ce, aux, mtp_loss) = out
    mean = lambda x: x / n
    aux = dataclasses.replace(
        jax.tree.map(mean, aux), expert_counts=aux.expert_counts
    )  # counts add up; every other statistic is a mean over tokens or layers
    mtp_loss = None if mtp_loss is None else mean(mtp_loss)
    return (mean(total), (mean(ce), aux, mtp_loss)), jax.tree.map(mean, grads), fraction


def _update_correction_biases(params, counts, model_cfg: LMConfig, rate: float):
    layers = list(params["layers"])
    for j, i in enumerate(model_cfg.moe_layers):
        router = layers[i]["moe"]["router"]
        bias = moejax.update_correction_bias(router["score_correction_bias"], counts[j], rate)
        moe = {**layers[i]["moe"], "router": {**router, "score_correction_bias": bias}}
        layers[i] = {**layers[i], "moe": moe}
    return {**params, "layers": layers}


def train_step(
    state: TrainState,
    batch: jax.Array,
    slot_tables=(),
    *,
    model_cfg: LMConfig,
    train_cfg: TrainConfig,
    mesh=None,
    strategy="auto",
    implementation: str = "auto",
    batch_split: int = 1,
) -> tuple[TrainState, StepMetrics]:
    """One training step (module docstring); pure, to be jitted by `make_train_step`.

    `batch`: `[B, S + 1]` tokens, or a dict with `"tokens"` and `"replay_experts"`
    `[Lm, B, S, K]` (router replay: the experts recorded per MoE layer, e.g. at rollout with
    `lm_forward(..., return_experts=True)`; see `lm_loss`).
    `slot_tables`: one `moejax.parallel.SlotTable` per MoE layer when the state's experts are
    physical slots (`moejax.training.placed`), else `()`. `strategy` (the sharded MoE
    layers' `Strategy`) and `batch_split` (micro-batches side by side through every block,
    `moejax.models.lm_forward`) change the schedule, never the math.
    """
    tx = make_optimizer(train_cfg, clip=not slot_tables)
    grad_fn = jax.value_and_grad(lm_loss, has_aux=True)
    forward_kw = dict(
        mesh=mesh,
        strategy=strategy,
        implementation=implementation,
        slot_tables=tuple(slot_tables) or None,
        remat=train_cfg.remat,
        scan_layers=train_cfg.scan_layers,
        batch_split=batch_split,
        delay_wgrad=train_cfg.delay_wgrad,
    )
    if train_cfg.microbatches > 1:
        (total, (ce, aux, mtp_loss)), grads, fraction = _accumulated(
            grad_fn, state.params, batch, model_cfg, train_cfg, forward_kw
        )
    else:
        (total, (ce, aux, mtp_loss)), grads = grad_fn(
            state.params, batch, model_cfg, train_cfg, **forward_kw
        )
        fraction = None
    aux: LMAux
    if slot_tables:
        grads = placed.combine_grads(grads, slot_tables, model_cfg, mesh)
        grad_norm = placed.logical_norm(grads, slot_tables, model_cfg)
        grads = placed.clip_by_norm(grads, grad_norm, train_cfg.clip_norm)
    else:
        grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if model_cfg.moe.score_correction_bias and train_cfg.bias_update_rate > 0:
        params = _update_correction_biases(
            params, aux.expert_counts, model_cfg, train_cfg.bias_update_rate
        )
    finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = TrainState(
        step=state.step + 1,
        updates=state.updates + finite.astype(jnp.int32),
        skipped=state.skipped + (~finite).astype(jnp.int32),
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        rng=jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0]),
    )
    metrics = StepMetrics(
        loss=ce,
        total_loss=total,
        load_balance_loss=balance_loss(aux, train_cfg, fraction),
        z_loss=aux.z_loss.mean(),
        grad_norm=grad_norm,
        learning_rate=learning_rate_schedule(train_cfg)(state.updates).astype(jnp.float32),
        finite=finite,
        expert_counts=aux.expert_counts,
        dropped_fraction=aux.dropped_fraction,
        router_entropy=aux.router_entropy,
        mtp_loss=mtp_loss,
    )
    return new_state, metrics


@functools.lru_cache(maxsize=8)
def make_train_step(
    model_cfg: LMConfig,
    train_cfg: TrainConfig,
    mesh=None,
    *,
    strategy="auto",
    implementation: str = "auto",
    batch_split: int = 1,
    replay_experts: bool = False,
):
    """`train_step` jitted: `(state, batch [B, S + 1][, slot_tables]) -> (state, StepMetrics)`.

    `replay_experts=True`: the batch is `{"tokens": [B, S + 1], "replay_experts":
    [Lm, B, S, K]}` (router replay, `train_step`); on a mesh both are split over the token
    axes along B.

    Cached on its (hashable) arguments, so repeated runs in one process reuse the compiled
    step. The state is donated (updated in place). On a mesh, the state keeps the shardings of
    `state_shardings`, the batch is split over `("data", "expert")` and the metrics come back
    replicated (so every process can read them).
    """
    step = functools.partial(
        train_step,
        model_cfg=model_cfg,
        train_cfg=train_cfg,
        mesh=mesh,
        strategy=strategy,
        implementation=implementation,
        batch_split=batch_split,
    )
    if mesh is None:
        return jax.jit(step, donate_argnums=0)
    sh = state_shardings(model_cfg, train_cfg, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    in_shardings = (sh, batch_sharding(mesh))
    if replay_experts:
        tokens_spec = batch_sharding(mesh).spec
        replay = NamedSharding(mesh, PartitionSpec(None, tokens_spec[0], None, None))
        in_shardings = (sh, {"tokens": batch_sharding(mesh), "replay_experts": replay})
    if train_cfg.expert_slots_per_device:
        in_shardings += (replicated,)  # the slot tables
    return jax.jit(
        step,
        in_shardings=in_shardings,
        out_shardings=(sh, replicated),
        donate_argnums=0,
    )


@functools.lru_cache(maxsize=8)
def make_eval_step(
    model_cfg: LMConfig,
    mesh=None,
    *,
    strategy="auto",
    implementation: str = "auto",
    scan_layers: bool = False,
):
    """Jitted `(params, batch [B, S + 1][, slot_tables]) -> mean cross-entropy []` (fp32,
    replicated); `slot_tables` as for `train_step`."""

    def evaluate(params, batch, slot_tables=()):
        logits, _ = lm_forward(
            params,
            batch[:, :-1],
            model_cfg,
            mesh=mesh,
            strategy=strategy,
            implementation=implementation,
            slot_tables=tuple(slot_tables) or None,
            scan_layers=scan_layers,
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    if mesh is None:
        return jax.jit(evaluate)
    return jax.jit(evaluate, out_shardings=NamedSharding(mesh, PartitionSpec()))
