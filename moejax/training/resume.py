"""What a resumed run may change: its `TrainConfig` against the one its checkpoint was written
with (`meta["train"]`).

Refused (`ResumeMismatch`, naming the field and both values; nothing is changed): the fields
that decide which tokens the saved data position points at. `batch_size`, `seq_len` and
`eval_fraction` size the batches and the training split the position counts in; `seed` orders
the shuffle of every epoch, so another seed would silently continue on other batches (the
iterator would keep the saved seed and ignore the new one). And `moment_dtype`: the saved Adam
moments are stored in it (their checksums are of those bytes). The model must be the same too
(`Checkpointer`: `ResumeMismatch` on a `model.*` field).

Applied, with one line listing each change (`notices`): everything else. Optimiser and schedule
settings (`learning_rate`, `steps`, `warmup_steps`, `min_lr_ratio`, ...) are legitimate
mid-run decisions (extend a run, lower a learning rate that diverges) that take effect from the
resumed step: the schedule is a function of the step, so the learning rate jumps to the new
schedule's value there. How the step is run (`microbatches`, `remat`, `scan_layers`,
`delay_wgrad`, expert slots) and bookkeeping (`checkpoint_every`, `keep_checkpoints`,
`eval_batches`, `max_skipped_fraction`) change no saved state.
"""

from __future__ import annotations

import dataclasses

from moejax.training._config import TrainConfig
from moejax.training.checkpoint import ResumeMismatch

_BATCHES = "it decides which batches come next"
REFUSED = {  # field -> why a resumed run keeps the saved value
    "batch_size": _BATCHES,
    "seq_len": _BATCHES,
    "seed": _BATCHES,
    "eval_fraction": _BATCHES,
    "moment_dtype": "the saved Adam moments are stored in it",
}


def _changed(saved: dict, train_cfg: TrainConfig) -> list[tuple[str, object, object]]:
    out = []
    for f in dataclasses.fields(train_cfg):
        # a field added after the checkpoint was written: the run had its default's behaviour
        a = saved.get(f.name, f.default)
        b = getattr(train_cfg, f.name)
        if a != b:
            out.append((f.name, a, b))
    return out


def check(meta: dict, train_cfg: TrainConfig, path: str) -> list[str]:
    """Compare checkpoint `meta` (at `path`) with the resumed run's `train_cfg`.

    Returns:
      One notice line listing the changes that are applied (empty when nothing changed).

    Raises:
      ResumeMismatch: a field of `REFUSED` differs (the first one, with both values).
    """
    saved = meta.get("train") or {}
    changes = _changed(saved, train_cfg)
    for name, a, b in changes:
        if name in REFUSED:
            raise ResumeMismatch(
                f"checkpoint {path} was written with TrainConfig.{name}={a!r}, this run has "
                f"{b!r}: a resumed run keeps it ({REFUSED[name]}); use {a!r} or another run "
                "directory",
                field=name,
                saved=a,
                current=b,
            )
    if not changes:
        return []
    listed = ", ".join(f"{name} {a!r} -> {b!r}" for name, a, b in changes)
    return [f"resumed with changed settings, applied from step {meta.get('step')}: {listed}"]
