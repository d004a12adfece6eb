"""Training presets: the `TrainConfig` that goes with each model preset of
`moejax.models.presets` (same names), looked up with `get`.

- `micro`: tests; a handful of steps in seconds. `micro_dense`: the same, for `micro` made
  dense (a run to upcycle from).
- `tiny`: the README's main job, `python experiments/train_lm.py` (8 simulated CPU devices,
  2 x 4 data x expert mesh): 300 steps of 16 x 128 bytes; see the README for the loss it reaches
  and the wall time on a 2-core machine.
- `small`: `python experiments/train_lm.py --preset small` (about 1 s per step per 1k tokens on
  2 CPU cores; meant for more cores or an accelerator).
- `mixtral_8x7b`, `fine_grained_64x1408`: real-size recipes for accelerators: global batch
  1024 x 4096 tokens, bf16 compute with fp32 master weights and Adam state, matmul outputs kept
  for the backward (`remat="dots_saveable"`), scanned layers, 2 micro-batches: on an
  fsdp=8 x expert=8 mesh of 64 H100s or 64 TPU v5p chips this fits with 8-24 GiB to spare
  (`python experiments/plan_scale.py`, BENCHMARKS.md "Real scale"); compiled, never run, in
  tests.

>>> get("tiny").steps
300
"""

from __future__ import annotations

from moejax.training._config import TrainConfig

# The real-size recipe the accelerator presets share; each sets its own learning rate.
_REAL_SIZE = dict(
    steps=100_000,
    batch_size=1024,
    warmup_steps=2000,
    weight_decay=0.1,
    checkpoint_every=1000,
    remat="dots_saveable",
    scan_layers=True,
    microbatches=2,
)

TRAIN_PRESETS: dict[str, TrainConfig] = {
    "micro": TrainConfig(
        steps=8, batch_size=8, learning_rate=1e-2, warmup_steps=2, checkpoint_every=4
    ),
    "tiny": TrainConfig(
        steps=300, batch_size=16, learning_rate=3e-3, warmup_steps=30, checkpoint_every=100
    ),
    "small": TrainConfig(
        steps=2000, batch_size=32, learning_rate=2e-3, warmup_steps=100, checkpoint_every=250
    ),
    "mixtral_8x7b": TrainConfig(**_REAL_SIZE, learning_rate=3e-4),
    "fine_grained_64x1408": TrainConfig(**_REAL_SIZE, learning_rate=4.2e-4),
    # DeepSeek-V3's batch (15360 x 4096 in its report) is for 2048 GPUs; planned at 1024.
    "deepseek_v3_4l": TrainConfig(**_REAL_SIZE, learning_rate=2.2e-4),
    "micro_dense": TrainConfig(
        steps=8, batch_size=8, learning_rate=1e-2, warmup_steps=2, checkpoint_every=4
    ),
}


def real_size(**overrides) -> TrainConfig:
    """The real-size recipe above for a model that is not a preset (`plan_scale.py
    --hf-config`): global batch 1024, `dots_saveable`, scanned layers, 2 micro-batches;
    `overrides` replace fields (learning rate 3e-4 unless given)."""
    return TrainConfig(**{**_REAL_SIZE, "learning_rate": 3e-4, **overrides})


def get(name: str) -> TrainConfig:
    """The training preset `name`.

    Raises:
      ValueError: naming the unknown preset and the known ones.
    """
    if name not in TRAIN_PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(TRAIN_PRESETS)}")
    return TRAIN_PRESETS[name]
