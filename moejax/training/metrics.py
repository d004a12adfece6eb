"""Training metrics on the host: FLOP accounting, per-step records, JSONL and TensorBoard.

A record (one JSON line of `metrics.jsonl` per step) holds: `step`, `loss` (next-token
cross-entropy, nats), `total_loss`, `load_balance_loss`, `z_loss`, `grad_norm`,
`learning_rate`, `skipped` (this step's update was dropped: non-finite loss or gradient),
`skipped_total`, `step_time_s`, `tokens_per_s`, `flops_per_s`, and per MoE layer
`expert_counts [Lm][E]`, `dropped_fraction [Lm]`, `router_entropy [Lm]` and
`device_imbalance [Lm]`. The `expert_counts` field makes `metrics.jsonl` a routing trace that
`moejax.placement.load_trace` reads directly.

Device-load imbalance of a layer is `max / mean` over the `N` devices of the `expert` axis of the
rows (token assignments) each device computes under the current placement
(`moejax.placement.Placement.imbalance`; identity placement: expert `e` on device `e // (E/N)`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import warnings

import numpy as np

from moejax._disk import OutputWriteError, disk_error
from moejax.models import LMConfig, param_counts
from moejax.training.checkpoint import CheckpointError


def flops_per_token(cfg: LMConfig, seq_len: int) -> float:
    """Training FLOPs per token: `6 * N_active + 12 * L * H * Dh * S`.

    `N_active` (`moejax.models.param_counts`) counts the weights that multiply a token: the
    matmuls cost 2 FLOPs per weight forward and 4 backward. The second term is attention's
    scores and weighted values (`Q K^T` and `P V`: `2 * 2 * S * H * Dh` per token forward, times 3
    with the backward), as in PaLM (Chowdhery et al. 2022, appendix B), without discounting the
    causal mask. Element-wise work (norms, softmax, activations) and the MoE permutations are
    not counted.
    """
    active = param_counts(cfg).active
    return 6.0 * active + 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len


def device_imbalance(counts: np.ndarray, placements) -> list[float]:
    """`[Lm]` busiest device's rows over the mean, per MoE layer (module docstring).

    Args:
      counts: `[Lm, E]` expert counts of one step.
      placements: `Lm` `moejax.placement.Placement`s.
    """
    return [p.imbalance(c) for p, c in zip(placements, np.asarray(counts), strict=True)]


def step_record(
    step: int,
    metrics,
    *,
    step_time_s: float,
    tokens_per_step: int,
    flops_per_step: float,
    skipped_total: int,
    placements,
) -> dict:
    """The JSONL record of one step from its fetched `StepMetrics` (numpy leaves)."""
    finite = bool(metrics.finite)
    rate = 1.0 / step_time_s if step_time_s > 0 else math.nan
    return {
        "step": int(step),
        "loss": _num(metrics.loss),
        "total_loss": _num(metrics.total_loss),
        "load_balance_loss": _num(metrics.load_balance_loss),
        "z_loss": _num(metrics.z_loss),
        **({} if metrics.mtp_loss is None else {"mtp_loss": _num(metrics.mtp_loss)}),
        "grad_norm": _num(metrics.grad_norm),
        "learning_rate": _num(metrics.learning_rate),
        "skipped": not finite,
        "skipped_total": int(skipped_total),
        "step_time_s": round(step_time_s, 6),
        "tokens_per_s": _num(tokens_per_step * rate),
        "flops_per_s": _num(flops_per_step * rate),
        "expert_counts": np.asarray(metrics.expert_counts).astype(int).tolist(),
        "dropped_fraction": [_num(x) for x in np.asarray(metrics.dropped_fraction)],
        "router_entropy": [_num(x) for x in np.asarray(metrics.router_entropy)],
        "device_imbalance": [_num(x) for x in device_imbalance(metrics.expert_counts, placements)],
    }


def _num(x) -> float | None:
    """A JSON-safe float (None for NaN/inf, which JSON cannot hold)."""
    x = float(x)
    return x if math.isfinite(x) else None


def read_records(
    path: str | os.PathLike, *, up_to_step: int | None = None, on_torn=None
) -> list[dict]:
    """Records of a `metrics.jsonl` (those with `step <= up_to_step` if given).

    A torn last line (a run killed mid-write) is dropped and reported: `on_torn(message)`, by
    default a `UserWarning`. An unreadable line before the last raises `MetricsFileError`.
    """
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    records = []
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    for k, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a step record")
        except ValueError as err:
            if k == len(numbered) - 1:  # the last one: torn by a crash, resumable without it
                message = f"{path}: dropped a torn last record (line {number}, {len(line)} bytes)"
                if on_torn is None:
                    warnings.warn(message, stacklevel=2)
                else:
                    on_torn(message)
                break
            raise MetricsFileError(
                f"{path} line {number} is not a metrics record ({type(err).__name__}); "
                f"fix or remove that line"
            ) from None
        records.append(record)
    return [r for r in records if up_to_step is None or r["step"] <= up_to_step]


class MetricsFileError(CheckpointError):
    """A `metrics.jsonl` damaged before its last line (a resumed run cannot append to it)."""


def replace_atomically(path: str, write) -> None:
    """Write a file through `write(tmp_path)` and rename it over `path` (never half-written).

    The temporary name keeps `path`'s extension, for writers that choose a format by it.
    """
    root, ext = os.path.splitext(path)
    tmp = f"{root}.tmp-{os.getpid()}{ext}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


_SCALARS = (
    "loss",
    "total_loss",
    "load_balance_loss",
    "z_loss",
    "grad_norm",
    "learning_rate",
    "tokens_per_s",
    "flops_per_s",
    "skipped_total",
)
_PER_LAYER = ("device_imbalance", "router_entropy", "dropped_fraction")


class MetricsWriter:
    """Appends records to `metrics.jsonl` and TensorBoard event files under `run_dir`.

    Args:
      run_dir: the run directory.
      keep_up_to: on resume, the restored step: records after it (written before an interrupted
        run died, so not part of the resumed history) and a torn last line (reported on stderr)
        are dropped from `metrics.jsonl` by writing the kept records to a new file renamed over
        it (never a rewrite in place), and TensorBoard purges its events after it
        (`purge_step`). Otherwise records are appended, one `write` each, so a crash can only
        tear the last line.
      tensorboard: write TensorBoard events (`tensorboardX`) under `run_dir/tensorboard`.
    """

    def __init__(self, run_dir: str, *, keep_up_to: int | None = None, tensorboard: bool = True):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.run_dir = run_dir
        kept = []
        if keep_up_to is not None:
            kept = read_records(self.path, up_to_step=keep_up_to, on_torn=_say)
        if keep_up_to is None or _needs_rewrite(self.path, kept):
            # Records to drop (after the restored step, or torn): a new file renamed over the
            # old one, never a rewrite in place that a crash could leave half done.
            def write(tmp):
                with open(tmp, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in kept)
                    f.flush()
                    os.fsync(f.fileno())

            replace_atomically(self.path, write)
        self.records = kept
        self._file = open(self.path, "a")  # noqa: SIM115 (closed in close())
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            purge = None if keep_up_to is None else keep_up_to + 1
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=purge)

    def write(self, record: dict) -> None:
        """Append one step's record."""
        self.records.append(record)
        try:
            self._file.write(json.dumps(record) + "\n")  # one write: a crash tears the last line
            self._file.flush()
        except OSError as err:
            _disk_failure(self.path, err, record.get("step"))
            raise
        if self._tb is not None:
            self._check_tensorboard(record.get("step"))
            step = record["step"]
            for key in _SCALARS:
                if record.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", record[key], step)
            for key in _PER_LAYER:
                for layer, value in enumerate(record[key]):
                    if value is not None:
                        self._tb.add_scalar(f"{key}/moe_layer_{layer}", value, step)

    def _check_tensorboard(self, step) -> None:
        """tensorboardX writes from a thread, which dies on a write error (a full disk) and
        leaves the next `add_scalar` blocked on its full queue for ever: a dead writer thread is
        an `OutputWriteError` naming the directory instead."""
        worker = getattr(getattr(getattr(self._tb, "file_writer", None), "event_writer", None),
                         "_worker", None)  # fmt: skip
        if worker is None or worker.is_alive():
            return
        tb_dir = os.path.join(self.run_dir, "tensorboard")
        try:
            full = shutil.disk_usage(tb_dir).free == 0
        except OSError:
            full = False
        self._tb = None  # (closing it would block on the same queue)
        reason = "no space left on device" if full else "its writer thread failed (see above)"
        raise OutputWriteError(
            f"{tb_dir}: {reason} writing TensorBoard events of step {step}; free space and rerun "
            "with the same --out to resume from the newest checkpoint"
        )

    def write_scalar(self, name: str, value: float, step: int) -> None:
        """A scalar outside the per-step records (e.g. the final eval loss): TensorBoard only."""
        if self._tb is not None:
            self._check_tensorboard(step)
            self._tb.add_scalar(name, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._check_tensorboard("(closing)")
            self._tb.close()


def _disk_failure(path: str, err: OSError, step) -> None:
    """Raise `OutputWriteError` for a disk error writing `path` (else return)."""
    reason = disk_error(err)
    if reason is not None:
        raise OutputWriteError(
            f"{path}: {reason} writing the record of step {step}; free space (or make it "
            "writable) and rerun with the same --out to resume from the newest checkpoint"
        ) from None


def _needs_rewrite(path: str, kept: list[dict]) -> bool:
    """Whether `path` holds more than the `kept` records, each on a whole line."""
    if not os.path.exists(path):
        return True
    with open(path, "rb") as f:
        data = f.read()
    lines = [line for line in data.split(b"\n") if line.strip()]
    return len(lines) != len(kept) or (bool(data) and not data.endswith(b"\n"))


def _say(line: str) -> None:
    print(f"moejax: {line}", file=sys.stderr, flush=True)
