"""`TrainConfig`: the frozen, validated training hyper-parameters of one run, and `check_setup`:
the run's shapes checked against the model and the mesh."""

from __future__ import annotations

import dataclasses
import math

from moejax.models import LMConfig, lm_mesh_problems


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation, batch, logging and checkpoint settings.

    Args:
      steps: length of the run and of the learning-rate schedule.
      batch_size: `B`, sequences per step over the whole mesh (the global batch); must divide
        over the token shards (`data x fsdp x expert` devices).
      seq_len: `S`, tokens per sequence (None: the model's `max_seq_len`).
      learning_rate: peak learning rate.
      warmup_steps: linear warm-up from 0 to the peak.
      min_lr_ratio: the cosine decay ends at `learning_rate * min_lr_ratio` at `steps`.
      weight_decay: AdamW decoupled weight decay, applied to matrices only (not to norm scales
        or biases).
      b1, b2, eps: Adam moments.
      moment_dtype: the dtype Adam's two moments are stored in between steps: None (the
        parameters' dtype, `LMConfig.param_dtype`) or `"bfloat16"` (DeepSeek-V3's recipe: with
        fp32 parameters the state is 8 bytes per parameter instead of 12). The update is
        computed in fp32 either way. bfloat16 resolves a relative change of 2^-8 at best, so
        its second moment needs `1 - b2 >= 2^-8` (`b2 <= 0.996`) to decay at all.
      clip_norm: global-norm gradient clipping threshold (of the trainable parameters).
      load_balance: which balance loss `load_balance_weight` weighs (mean over MoE layers):
        `"micro_batch"`: the Switch form `E * sum_e f_e P_e` over the tokens of one forward
        (one micro-batch of `microbatches`; on a mesh, all token shards' tokens: the sharded
        layer sums `f` and `P` over them). `"sequence"`: DeepSeek-V3's sequence-wise form, the
        Switch form within each sequence, averaged over sequences
        (`MoEAux.sequence_balance_loss`). `"global_batch"`: the Switch form with `f` over the
        whole step's batch, all token shards and all `microbatches` (Qwen's global-batch
        loss; Megatron's `global_aux_loss`): with `microbatches > 1` the step first runs a
        forward pass over the micro-batches for their expert counts (on device, no host
        sync; one extra forward per step), so loss and gradients equal those of one forward
        over the whole batch.
      load_balance_weight: weight of the balance loss `load_balance` selects.
      z_loss_weight: weight of the mean over MoE layers of the router z-loss.
      mtp_loss_weight: weight of the mean over the model's multi-token-prediction blocks
        (`LMConfig.mtp_layers`) of their cross-entropies (DeepSeek-V3: 0.3, later 0.1); logged
        as `mtp_loss`. 0 (the default) leaves the blocks out of the step.
      bias_update_rate: step of the aux-loss-free correction-bias update (models whose MoE config
        has `score_correction_bias`), applied after the optimizer, outside it.
      seed: initialisation and data-shuffling seed.
      eval_fraction: the tail of the corpus held out for evaluation.
      eval_batches: held-out batches evaluated at the end (0: none).
      checkpoint_every: save every this many steps (0: only at the end and on SIGTERM).
      keep_checkpoints: how many recent checkpoints to keep.
      expert_slots_per_device: `S`, expert slots per device of the mesh's `expert` axis for
        dynamic placement (`moejax.training.placed`); at least `E / N`, spare slots hold
        replicas of hot experts. 0: no placement, experts in logical order.
      remat: rematerialisation of each block in the backward: `"none"`, `"dots_saveable"`
        (keep matmul outputs, recompute the rest), `"full"` (keep only block inputs); see
        `moejax.models.remat_policy`. Changes memory and time, never the math.
      scan_layers: run the blocks as `jax.lax.scan`s over repeats of a unit of blocks (the
        `moe_every`-block unit, or the runs of `LMConfig.mlp_layer_types`;
        `moejax.models.lm_forward`): compile time stops growing with depth.
      delay_wgrad: compute each attention's weight gradients inside the backward all-to-all
        window of the MoE layer before it (`moejax.models.lm_forward`). None: on where the mesh
        has an `expert` axis and the layers are not scanned.
        Changes the schedule, never the math.
      max_skipped_fraction: a run whose skipped (non-finite) steps exceed this fraction of its
        steps fails (`RunResult.failure`; `train_lm.py` exits 3); the loop stops as soon as the
        fraction of the planned steps is exceeded (it cannot come back under). 1: never.
      microbatches: split each step's batch into this many equal micro-batches whose gradients
        are accumulated (`moejax.training.step`): activation memory of one micro-batch, the
        same update (the load-balance loss is averaged over micro-batches). `batch_size` must
        divide into `microbatches` x token shards.
    """

    steps: int = 300
    batch_size: int = 16
    seq_len: int | None = None
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    moment_dtype: str | None = None
    clip_norm: float = 1.0
    load_balance: str = "micro_batch"
    load_balance_weight: float = 0.01
    z_loss_weight: float = 1e-3
    mtp_loss_weight: float = 0.0
    bias_update_rate: float = 1e-3
    seed: int = 0
    eval_fraction: float = 0.05
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    expert_slots_per_device: int = 0
    remat: str = "none"
    scan_layers: bool = False
    delay_wgrad: bool | None = None
    microbatches: int = 1
    max_skipped_fraction: float = 0.1

    def __post_init__(self):
        for name in ("steps", "batch_size", "microbatches"):
            _positive_int(name, getattr(self, name))
        if self.batch_size % self.microbatches:
            _bad("microbatches", self.microbatches, f"must divide batch_size={self.batch_size}")
        if self.seq_len is not None:
            _positive_int("seq_len", self.seq_len)
        for name in (
            "warmup_steps",
            "eval_batches",
            "checkpoint_every",
            "seed",
            "expert_slots_per_device",
        ):
            _non_negative_int(name, getattr(self, name))
        _positive_int("keep_checkpoints", self.keep_checkpoints)
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            _bad("learning_rate", self.learning_rate, "must be a finite number > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            _bad("min_lr_ratio", self.min_lr_ratio, "must lie in [0, 1]")
        if self.warmup_steps >= self.steps and self.warmup_steps:  # the cosine needs a step
            _bad("warmup_steps", self.warmup_steps, f"must be < steps={self.steps}")
        for name in (
            "weight_decay", "load_balance_weight", "z_loss_weight", "bias_update_rate",
            "mtp_loss_weight",
        ):  # fmt: skip
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                _bad(name, value, "must be a finite number >= 0")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                _bad(name, getattr(self, name), "must lie in [0, 1)")
        if not self.eps > 0:
            _bad("eps", self.eps, "must be > 0")
        if self.moment_dtype not in MOMENT_DTYPES:
            _bad("moment_dtype", self.moment_dtype, f"must be one of {MOMENT_DTYPES}")
        if self.moment_dtype == "bfloat16" and 1 - self.b2 < 2**-8:
            _bad(
                "b2", self.b2,
                f"with moment_dtype='bfloat16' the second moment moves by 1 - b2 = "
                f"{1 - self.b2:.2%} a step, under bfloat16's resolution (2^-8 = 0.39%): it would "
                "stop decaying. Use b2 <= 0.996 or moment_dtype=None",
            )  # fmt: skip
        if not self.clip_norm > 0:
            _bad("clip_norm", self.clip_norm, "must be > 0")
        if not 0 <= self.eval_fraction < 1:
            _bad("eval_fraction", self.eval_fraction, "must lie in [0, 1)")
        if not 0 <= self.max_skipped_fraction <= 1:
            _bad("max_skipped_fraction", self.max_skipped_fraction, "must lie in [0, 1]")
        if self.load_balance not in LOAD_BALANCE_LOSSES:
            _bad("load_balance", self.load_balance, f"must be one of {LOAD_BALANCE_LOSSES}")
        if self.remat not in _REMAT:
            _bad("remat", self.remat, f"must be one of {_REMAT}")
        if not isinstance(self.scan_layers, bool):
            _bad("scan_layers", self.scan_layers, "must be a bool")
        if self.delay_wgrad is not None and not isinstance(self.delay_wgrad, bool):
            _bad("delay_wgrad", self.delay_wgrad, "must be None or a bool")

    def replace(self, **changes) -> TrainConfig:
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)


LOAD_BALANCE_LOSSES = ("micro_batch", "sequence", "global_batch")
MOMENT_DTYPES = (None, "bfloat16")
_REMAT = ("none", "dots_saveable", "full")  # moejax.models.REMAT_POLICIES


def _bad(field: str, value, why: str):
    raise ValueError(f"TrainConfig.{field}={value!r}: {why}")


def _positive_int(field: str, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        _bad(field, value, "must be a positive int")


def _non_negative_int(field: str, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        _bad(field, value, "must be an int >= 0")


class SetupError(ValueError):
    """Shapes of the run that do not fit each other or the mesh (one line, names the field)."""


def check_setup(model_cfg: LMConfig, train_cfg: TrainConfig, mesh) -> int:
    """Validate the run's shapes against each other and the mesh; returns the sequence length.

    Raises:
      SetupError: one line per mismatch, each naming the field (batch vs token shards,
        micro-batches, experts vs the expert axis, heads and widths vs the model axis, sequence
        length vs the model), or a model without MoE layers.
    """
    if not model_cfg.moe_layers:  # e.g. a Hugging Face Llama, Qwen2 or Qwen3 as loaded
        raise SetupError(
            f"LMConfig.mlp_layer_types={model_cfg.mlp_layer_types}: no MoE layer; moejax trains "
            "MoE models: upcycle this dense one (moejax.models.upcycle, train_lm.py "
            "--upcycle-from) or write its MLPs as one-expert MoE layers (dense_lm_config)"
        )
    seq_len = train_cfg.seq_len or model_cfg.max_seq_len
    if seq_len > model_cfg.max_seq_len:
        raise SetupError(
            f"TrainConfig.seq_len={seq_len}: exceeds the model's max_seq_len="
            f"{model_cfg.max_seq_len}"
        )
    if mesh is None:
        if train_cfg.expert_slots_per_device:
            raise SetupError(
                f"TrainConfig.expert_slots_per_device={train_cfg.expert_slots_per_device}: "
                "expert placement needs a mesh"
            )
        return seq_len
    from moejax.parallel import mesh as mesh_lib

    shape = " x ".join(f"{k}={v}" for k, v in dict(mesh.shape).items())
    shards = mesh_lib.token_shards(mesh)
    problems = []
    if train_cfg.batch_size % shards:
        problems.append(
            f"TrainConfig.batch_size={train_cfg.batch_size}: does not divide over the {shards} "
            f"token shards of the mesh"
        )
    elif (train_cfg.batch_size // shards) % train_cfg.microbatches:
        problems.append(
            f"TrainConfig.microbatches={train_cfg.microbatches}: does not divide the "
            f"{train_cfg.batch_size // shards} sequences each of the {shards} token shards holds"
        )
    problems += lm_mesh_problems(model_cfg, mesh)
    experts = mesh_lib.axis_size(mesh, "expert")
    slots = train_cfg.expert_slots_per_device
    if slots and slots < model_cfg.moe.num_experts // experts:
        problems.append(
            f"TrainConfig.expert_slots_per_device={slots}: fewer than the "
            f"{model_cfg.moe.num_experts // experts} experts each of the {experts} devices of "
            f"the expert axis must hold"
        )
    if problems:  # one line per mistake, each naming the field and the mesh
        raise SetupError("\n".join(f"{line} ({shape})" for line in problems))
    return seq_len
