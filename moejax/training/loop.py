"""`train`: the host loop around the jitted step.

Per step the host (1) takes the next batch from the iterator and dispatches the step (jax
returns at once: async dispatch), then (2) fetches the *previous* step's metrics, which are
ready or nearly so while the device works on the current step; it never waits on the step it
just dispatched, so routing statistics reach the host one step late without stalling the
device. A checkpoint save waits only for the device-to-host copy of the state.

SIGTERM (preemption) and SIGINT (Ctrl-C) set a flag; the loop finishes the step in flight,
saves a checkpoint, writes the outputs and returns with `interrupted=True` (`stop_signal` names
the signal); a second Ctrl-C aborts at once (KeyboardInterrupt, nothing more saved). Rerunning
with the same run directory resumes from the newest intact checkpoint
(`Checkpointer.restore_latest`: checksummed, corrupt ones skipped), bit-identically (same mesh)
to an uninterrupted run, and says so on stderr. The handlers are installed when `train` runs in
the main thread. Under `jax.distributed` the processes agree at every step boundary
(`moejax.training.peers.StopAgreement`, through the coordination service): a signal to any one
of them stops all of them after the same step, with one checkpoint (`stop_signal` names the
process that received it, e.g. `"SIGTERM on process 1"`).

Skipped steps (non-finite loss or gradient: the update is dropped) are reported on stderr as
they happen (the first few, then a count in the progress bar) and counted in the result; once
they exceed `TrainConfig.max_skipped_fraction` of the planned steps the loop stops, saves, and
the result carries the reason in `failure`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from contextlib import ExitStack

import jax
import numpy as np

from moejax.data import BatchIterator, Corpus, DataError
from moejax.data._corpus import check_token_ids
from moejax.models import LMConfig
from moejax.placement import Placement, save_trace
from moejax.training import peers, placed, report, resume, rundir, tuning
from moejax.training._config import SetupError, TrainConfig, check_setup
from moejax.training.checkpoint import Checkpointer, restore_target
from moejax.training.metrics import (
    MetricsWriter,
    flops_per_token,
    read_records,
    replace_atomically,
    step_record,
)
from moejax.training.placement_runtime import PlacementRuntime, measured_effect
from moejax.training.state import (
    TrainState,
    abstract_state,
    global_batch,
    init_train_state,
    state_shardings,
)
from moejax.training.step import make_eval_step


@dataclasses.dataclass
class RunResult:
    """What a run produced (see `report.summary_table`)."""

    run_dir: str
    step: int  # steps done in total (including earlier runs this one resumed)
    steps_this_run: int
    final_loss: float | None  # mean train loss of the last `final_loss_steps` steps
    eval_loss: float | None  # mean held-out loss (None without eval data)
    unigram_entropy: float
    skipped: int
    tokens_per_s: float | None
    flops_per_s: float | None
    mean_imbalance: float | None
    mean_dropped: float | None
    wall_s: float
    interrupted: bool
    stop_signal: str | None = None  # "SIGTERM", "SIGINT" (or "SIGTERM on process 1") if stopped
    resumed_from: int | None = None  # the checkpoint step this run resumed from
    skipped_checkpoints: tuple = ()  # one line per corrupt checkpoint skipped on resume
    failure: str | None = None  # why the run failed (too many skipped steps), else None
    records: list = dataclasses.field(repr=False, default_factory=list)
    state: TrainState | None = dataclasses.field(repr=False, default=None)  # the final state
    placement: dict | None = None  # PlacementRuntime.summary: re-placements and their overhead
    placements: tuple = ()  # the final `Placement` of every MoE layer (the state's layout)
    # Every re-placement and every check of this run (`placement_events.jsonl` and
    # `placement_decisions.jsonl` records), on every process alike.
    placement_events: list = dataclasses.field(repr=False, default_factory=list)
    placement_checks: list = dataclasses.field(repr=False, default_factory=list)
    tuning: dict | None = None  # tuning.StepRunner.summary: the strategy chosen and why
    final_loss_steps: int = 20  # `report.loss_window` of the run's steps
    recipes: tuple = ()  # one line per training recipe in use (`recipe_lines`; upcycling: the CLI)


def recipe_lines(train_cfg: TrainConfig) -> tuple[str, ...]:
    """Summary lines of the training recipes `train_cfg` turns on (none for the defaults)."""
    lines = []
    if train_cfg.load_balance != "micro_batch":
        lines.append(
            f"balance loss: {train_cfg.load_balance} (weight {train_cfg.load_balance_weight:g})"
        )
    return tuple(lines)


def _saved_placements(meta: dict, current: list[Placement]) -> list[Placement] | None:
    """The checkpoint's placements if they fit the current run's slots (same `N` and `S`), else
    None (parameters are saved logical: the run's initial placements take them)."""
    saved = meta["placement"]
    first = current[0]
    fits = (
        saved["slot_to_expert"]
        and saved["num_devices"] == first.num_devices
        and saved["slots_per_device"] == first.slots_per_device
    )
    if not fits:
        return None
    return [p.with_table(t) for p, t in zip(current, saved["slot_to_expert"], strict=True)]


_REPORTED_SKIPS = 5  # skipped steps reported one line each; later ones only counted


class EarlySigterm:
    """A SIGTERM recorder for the start-up before `train`'s loop (installed by
    `record_early_sigterm`): the loop's handler takes over what it recorded, so a SIGTERM during
    set-up or compilation stops the run at its first step boundary (under jax.distributed, every
    process: otherwise jax's own preemption notifier would swallow it)."""

    def __init__(self):
        self.received: str | None = None

    def __call__(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name
            os.write(2, b"moejax: SIGTERM during start-up: stopping at the first step boundary\n")


def record_early_sigterm() -> None:
    """Install `EarlySigterm` for SIGTERM (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, EarlySigterm())


class _StopSignals:
    """Records SIGTERM and a first SIGINT instead of dying (a second SIGINT raises
    KeyboardInterrupt); restores the previous handlers on exit."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            early = self._previous[signal.SIGTERM]
            if isinstance(early, EarlySigterm) and early.received:
                self.received = early.received
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt
        if self.received is None:
            self.received = name
            # os.write, not print: a handler that prints while the progress bar is printing
            # would re-enter the same buffered stream (RuntimeError: reentrant call).
            again = " (Ctrl-C again to abort without saving)" if name == "SIGINT" else ""
            line = f"\nmoejax: {name}: finishing the step in flight, then saving a checkpoint"
            os.write(2, f"{line}{again}\n".encode())

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _say(line: str) -> None:
    """One line on stderr from process 0 (above the progress bar)."""
    if jax.process_index() == 0:
        from tqdm import tqdm  # write() is a class method: the same line for every bar kind

        tqdm.write(f"moejax: {line}", file=sys.stderr)


def train(
    model_cfg: LMConfig,
    train_cfg: TrainConfig,
    corpus: Corpus,
    *,
    run_dir: str,
    mesh=None,
    strategy="auto",
    implementation: str = "auto",
    stop_at: int | None = None,
    progress: bool = True,
    outputs: bool = True,
    tensorboard: bool = True,
    async_checkpoints: bool = True,
    controller=None,
    init_params=None,
    allow_nonfinite: bool = False,
) -> RunResult:
    """Train (or resume training) `model_cfg` on `corpus`; write everything under `run_dir`.

    Outputs: `metrics.jsonl` (one record per step, also a routing trace), `tensorboard/`,
    `checkpoints/<step>/`, `routing_trace.npy` (`[steps, Lm, E]` expert counts), and with
    `outputs` the plots `loss.png`, `expert_load.png`. Only process 0 writes the metrics and
    plots; every process takes part in checkpointing.

    Args:
      model_cfg, train_cfg: the configs.
      corpus: the tokenized corpus (its tail `train_cfg.eval_fraction` is held out).
      run_dir: the run directory; an existing checkpoint there is resumed.
      mesh: a `moejax.parallel` mesh, or None for one device.
      strategy: how the step runs on the mesh, one of: `"auto"` (the layer's default
        `Strategy`); a `tuning.Candidate` (a `Strategy` and a batch split) for the whole run;
        a `tuning.TuningConfig`: chosen by timing steps (`moejax.training.tuning`: timed rounds
        at the start and when the routing load moves the dropless bucket, within a time
        budget; decisions go to `tuning_events.jsonl` and `RunResult.tuning`; on one device
        the default runs).
      implementation: the grouped-matmul implementation.
      stop_at: stop after this step (default `train_cfg.steps`); the schedule still spans
        `train_cfg.steps`.
      progress: show a tqdm progress bar.
      outputs: write plots and the trace at the end (tests turn it off for speed).
      tensorboard: write TensorBoard event files.
      async_checkpoints: write checkpoints in the background.
      controller: with `train_cfg.expert_slots_per_device > 0`, a factory `placements ->
        controller` (`moejax.training.placed.controller_factory`): the controller sees each
        step's expert counts one step late (`observe(step, counts [Lm, E])`) and returns
        accepted `moejax.placement.Decision`s, which the loop applies between steps (a jitted
        gather of the expert parameters and moments, compiled in the background at start).
        Events go to `placement_events.jsonl` and are marked in `loss.png`; every check of a
        controller with a `log` (accepted or declined, with its reason) goes to
        `placement_decisions.jsonl`. None: the placement stays as initialised (or as resumed).
      init_params: None, or `mesh -> params` (logical expert order, on `mesh`'s parameter
        shardings): a fresh run starts from these parameters instead of the initialiser's,
        e.g. a converted Hugging Face model (`moejax.interop.hf`); a resumed run ignores it.
      allow_nonfinite: resume from a checkpoint whose state holds NaN or Inf (default:
        `NonFiniteState`, naming the array).

    Returns:
      A `RunResult`.

    Raises:
      SetupError, DataError, CheckpointError (all ValueErrors): bad shapes, data or checkpoint
        directory, raised before anything in `run_dir` is written. RunDirError: `run_dir`
        holds files moejax did not write; `RunDirBusy`: another run holds its lock
        (`moejax.training.rundir`; only process 0 takes it). ResumeMismatch: the checkpoint
        was written with another model, batch or seed (`moejax.training.resume`; other
        changed settings are applied, listed in one line on stderr).
    """
    with ExitStack() as held:  # the run directory's lock, taken in _train, released on return
        return _train(
            model_cfg, train_cfg, corpus, run_dir=run_dir, mesh=mesh, strategy=strategy,
            implementation=implementation, stop_at=stop_at, progress=progress, outputs=outputs,
            tensorboard=tensorboard, async_checkpoints=async_checkpoints, controller=controller,
            init_params=init_params, allow_nonfinite=allow_nonfinite, held=held,
        )  # fmt: skip


def _train(
    model_cfg, train_cfg, corpus, *, run_dir, mesh, strategy, implementation, stop_at, progress,
    outputs, tensorboard, async_checkpoints, controller, init_params, allow_nonfinite, held,
) -> RunResult:  # fmt: skip
    """`train`'s body; takes the run directory's lock into `held` before it touches run_dir."""
    t_start = time.perf_counter()
    seq_len = check_setup(model_cfg, train_cfg, mesh)
    if stop_at is not None and not (
        isinstance(stop_at, int) and not isinstance(stop_at, bool) and stop_at >= 1
    ):
        raise SetupError(f"stop_at={stop_at!r}: must be a step >= 1 (None: train_cfg.steps)")
    if stop_at is not None and stop_at > train_cfg.steps:
        raise SetupError(
            f"stop_at={stop_at}: beyond the schedule's TrainConfig.steps={train_cfg.steps}"
        )
    check_token_ids(corpus.tokens, model_cfg.vocab_size, f"corpus {corpus.name}")
    train_tokens, eval_tokens = corpus.split(train_cfg.eval_fraction)
    iterator = BatchIterator(train_tokens, train_cfg.batch_size, seq_len, seed=train_cfg.seed)
    stop = stop_at or train_cfg.steps
    primary = jax.process_index() == 0
    try:  # writes nothing yet
        steps = tuning.StepRunner(
            strategy, model_cfg, train_cfg, mesh, implementation, run_dir, write=primary
        )
    except ValueError as err:  # a bad strategy, or no candidate strategy fits the run
        raise SetupError(str(err)) from None
    if primary:  # before run_dir is read or written (re-entrant: train_lm.py may hold it)
        held.enter_context(rundir.run_lock(run_dir, log=_say))
    # A metrics.jsonl damaged before its last line stops the run before anything is written.
    read_records(os.path.join(run_dir, "metrics.jsonl"), on_torn=lambda _: None)

    ckpt = Checkpointer(
        os.path.join(run_dir, "checkpoints"),
        model_cfg,
        train_cfg,
        keep=train_cfg.keep_checkpoints,
        async_save=async_checkpoints,
        allow_nonfinite=allow_nonfinite,
    )
    shardings = None if mesh is None else state_shardings(model_cfg, train_cfg, mesh)
    placements = placed.initial_placements(model_cfg, train_cfg, mesh)
    resumed = None  # the controller state of the checkpoint resumed, if its tables apply
    target = restore_target(abstract_state(model_cfg, train_cfg), shardings)
    try:
        check = lambda meta, path: resume.check(meta, train_cfg, path)  # noqa: E731
        restored = ckpt.restore_latest(target, log=_say, check=check)
        if restored is not None:
            iterator.restore(restored.meta["data"])
    except ValueError:
        ckpt.close()
        raise
    latest = None if restored is None else restored.step
    if restored is not None:
        state, meta = restored.state, restored.meta
        _say(
            f"resumed from checkpoint step {latest} ({ckpt.directory}/{latest})"
            + ("" if restored.verified else ", not verified: written without checksums")
        )
        for line in resume.check(meta, train_cfg, f"{ckpt.directory}/{latest}"):
            _say(line)
        saved = _saved_placements(meta, placements)
        if saved is not None:  # the saved tables apply here: so does their controller's state
            placements, resumed = saved, meta.get("controller")
    else:
        params = None if init_params is None else init_params(mesh)
        state = init_train_state(model_cfg, train_cfg, mesh, params=params)
    placing, state = PlacementRuntime.start(
        state,
        placements,
        controller,
        model_cfg,
        train_cfg,
        mesh,
        run_dir if primary else None,
        resumed=resumed,
    )
    start = int(jax.device_get(state.step))
    skipped = int(jax.device_get(state.skipped))
    if start >= stop:
        _say(f"nothing to train: the checkpoint is at step {start}, stop_at={stop}")

    os.makedirs(run_dir, exist_ok=True)
    writer = MetricsWriter(run_dir, keep_up_to=start, tensorboard=tensorboard) if primary else None
    steps.begin(start, stop)
    tokens_per_step = train_cfg.batch_size * seq_len
    flops_per_step = flops_per_token(model_cfg, seq_len) * tokens_per_step
    last_saved = latest
    # More skipped steps than this over the planned run cannot come back under the threshold.
    skip_limit = train_cfg.max_skipped_fraction * stop

    def save(wait=False):
        nonlocal last_saved
        last_saved = ckpt.save(
            placing.logical(state),
            data_state=iterator.state(),
            placements=placing.placements,
            controller=placing.checkpoint_state(unobserved()),
            mesh=mesh,
            wait=wait,
        )

    def unobserved():
        """The step the loop fetched (or dispatched) last and the controller has not seen."""
        if pending is None or placing.controller is None:
            return None
        return pending[0], np.asarray(jax.device_get(pending[1].expert_counts))

    bar = _progress_bar(start, stop, progress and primary)
    pending, t_prev = None, time.perf_counter()
    interrupted = False
    failure = None

    def record(step_no, metrics, placements):
        nonlocal skipped, t_prev
        metrics = jax.device_get(metrics)  # blocks on that step only
        now = time.perf_counter()
        skipped += int(not metrics.finite)
        rec = step_record(
            step_no,
            metrics,
            step_time_s=now - t_prev,
            tokens_per_step=tokens_per_step,
            flops_per_step=flops_per_step,
            skipped_total=skipped,
            placements=placements,
        )
        t_prev = now
        if writer is not None:
            writer.write(rec)
        steps.observe(rec)
        if not metrics.finite:
            _report_skip(step_no, skipped, metrics)
        bar.update(1)
        postfix = {"loss": f"{metrics.loss:.3f}", "tok_s": f"{rec['tokens_per_s'] or 0:,.0f}"}
        if skipped:
            postfix["skipped"] = skipped
        bar.set_postfix(**postfix)
        return metrics

    agreement = peers.StopAgreement.current()  # None on one process

    def stop_reason(boundary):
        """Why every process stops at `boundary` (None: go on); one process decides alone."""
        if agreement is None:
            return stop_signals.received
        return agreement.agree(boundary, stop_signals.received)

    stopped_by = None
    with _StopSignals() as stop_signals:
        for step in range(start, stop):
            batch = global_batch(iterator.next(), mesh)
            layout = placing.placements  # what this step runs on
            # Dispatched, not awaited (unless the tuner times this step).
            state, metrics = steps(step + 1, state, batch, *placing.step_args)
            if pending is not None:
                fetched = record(*pending)
                # Counts of step `pending`, one step late; a re-placement applies to the state
                # after the step just dispatched, so step + 1 runs on the new layout.
                state = placing.observe(state, pending[0], fetched.expert_counts, step + 1)
            elif (saved := placing.take_unobserved()) is not None:  # resumed: the same place
                state = placing.observe(state, *saved, step + 1)
            pending = (step + 1, metrics, layout)
            every = train_cfg.checkpoint_every
            if every and (step + 1) % every == 0 and step + 1 < stop:
                save()
            if (stopped_by := stop_reason(step + 1)) is not None:
                interrupted = True
                break
            if skipped > skip_limit:
                break
        if pending is not None:
            record(*pending)
        placing.close()
        if last_saved != int(jax.device_get(state.step)):
            save(wait=True)
        ckpt.close()
        bar.close()
        done = int(jax.device_get(state.step))
        if done and skipped / done > train_cfg.max_skipped_fraction:
            failure = (
                f"{skipped} of {done} steps skipped (non-finite loss or gradient), more than "
                f"TrainConfig.max_skipped_fraction={train_cfg.max_skipped_fraction:g}"
            )
            _say(f"run failed: {failure}")

        if stopped_by is None:  # a signal after the last step: no eval (on every process)
            stopped_by = stop_reason("end")
        eval_loss = None
        if stopped_by is None:  # a signal during the loop: save and leave, no eval
            eval_loss = _evaluate(
                state,
                placing,
                eval_tokens,
                model_cfg,
                train_cfg,
                seq_len,
                mesh,
                steps.strategy,
                implementation,
            )
        records = writer.records if writer is not None else []
        if writer is not None:
            if eval_loss is not None:
                writer.write_scalar("eval/loss", eval_loss, int(jax.device_get(state.step)))
            writer.close()
        result = _result(
            run_dir,
            state,
            start,
            records,
            eval_loss,
            report.unigram_entropy(train_tokens, model_cfg.vocab_size),
            skipped,
            time.perf_counter() - t_start,
            interrupted,
        )
        result.stop_signal = stopped_by if interrupted else None
        result.resumed_from = latest
        result.skipped_checkpoints = () if restored is None else restored.skipped
        result.failure = failure
        result.state = state
        result.placement = placing.summary(result.wall_s, records)
        result.placements = placing.placements
        result.placement_events, result.placement_checks = placing.events, placing.decisions
        result.tuning = steps.summary()
        result.recipes = recipe_lines(train_cfg)
        if primary and outputs and records:
            write_outputs(run_dir, result, events=placing.events)
    return result


def _report_skip(step: int, skipped: int, metrics) -> None:
    if skipped > _REPORTED_SKIPS:
        return
    _say(
        f"step {step} skipped: loss {float(metrics.loss):.4g}, grad norm "
        f"{float(metrics.grad_norm):.4g} not finite, update dropped ({skipped} skipped so far"
        + ("; further ones are counted in the progress bar)" if skipped == _REPORTED_SKIPS else ")")
    )


def _progress_bar(start: int, stop: int, enabled: bool):
    # tqdm.auto picks the notebook bar in Jupyter and warns there without ipywidgets: only
    # import it for a bar that is shown.
    if enabled:
        from tqdm.auto import tqdm
    else:
        from tqdm import tqdm

    return tqdm(total=stop, initial=start, disable=not enabled, unit="step", dynamic_ncols=True)


def _evaluate(
    state, placing, tokens, model_cfg, train_cfg, seq_len, mesh, strategy, implementation
):
    """Mean cross-entropy over the first `eval_batches` held-out batches (None if too few)."""
    if not train_cfg.eval_batches:
        return None
    try:
        it = BatchIterator(tokens, train_cfg.batch_size, seq_len, seed=train_cfg.seed)
    except DataError:
        return None
    evaluate = make_eval_step(
        model_cfg,
        mesh,
        strategy=strategy,
        implementation=implementation,
        scan_layers=train_cfg.scan_layers,
    )
    n = min(train_cfg.eval_batches, it.batches_per_epoch)
    losses = [
        evaluate(state.params, global_batch(it.next(), mesh), *placing.step_args) for _ in range(n)
    ]
    return float(np.mean(jax.device_get(losses)))


def _result(run_dir, state, start, records, eval_loss, entropy, skipped, wall, interrupted):
    step = int(jax.device_get(state.step))
    window = report.loss_window(len(records))
    finite = [r["loss"] for r in records[-window:] if r["loss"] is not None]
    timed = records[1:] if len(records) > 1 else records  # the first includes compilation

    def median(key):
        values = [r[key] for r in timed if r.get(key) is not None]
        return float(np.median(values)) if values else None

    def mean_of_lists(key):
        values = [v for r in records for v in r[key] if v is not None]
        return float(np.mean(values)) if values else None

    return RunResult(
        run_dir=run_dir,
        step=step,
        steps_this_run=step - start,
        final_loss=float(np.mean(finite)) if finite else None,
        eval_loss=eval_loss,
        unigram_entropy=entropy,
        skipped=skipped,
        tokens_per_s=median("tokens_per_s"),
        flops_per_s=median("flops_per_s"),
        mean_imbalance=mean_of_lists("device_imbalance"),
        mean_dropped=mean_of_lists("dropped_fraction"),
        wall_s=wall,
        interrupted=interrupted,
        records=records,
        final_loss_steps=window,
    )


def write_outputs(run_dir: str, result: RunResult, events=()) -> None:
    """`routing_trace.npy`, `loss.png` (re-placement `events` marked), `expert_load.png` from
    the run's records, and with events `placement_forecast.png` (forecast vs measured fall).
    Each is written to a temporary file renamed over the old one: never half-written."""
    counts = np.array([r["expert_counts"] for r in result.records], np.int64)

    def out(name, write):
        replace_atomically(os.path.join(run_dir, name), write)

    out("routing_trace.npy", lambda path: save_trace(path, counts))
    out(
        "loss.png",
        lambda path: report.plot_loss(
            result.records,
            path,
            baseline=result.unigram_entropy,
            eval_loss=result.eval_loss,
            events=events,
            switches=(result.tuning or {}).get("switches", ()),
        ),
    )
    out("expert_load.png", lambda path: report.plot_expert_load(result.records, path))
    if events:
        rows = measured_effect(result.records, list(events))
        out("placement_forecast.png", lambda path: report.plot_placement_forecast(rows, path))
