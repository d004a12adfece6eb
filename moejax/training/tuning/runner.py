"""`StepRunner`: the loop's side of the strategy (which compiled step runs each step), and reading
the tuning log back."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

from moejax.training.tuning.candidates import Candidate, candidate_problems
from moejax.training.tuning.tuner import Decision, StrategyTuner, TuningConfig, tuner_for_run

EVENTS_FILE = "tuning_events.jsonl"


class StepRunner:
    """The loop's side of the strategy: which jitted train step runs each step.

    `strategy`, as `train(strategy=)` takes it, is one of:

    - `"auto"`: the layer's default `Strategy` (`moejax.parallel.strategy_space`'s first), one
      step function, dispatched asynchronously;
    - a `Candidate`: that strategy and batch split for the whole run;
    - a `TuningConfig`: chosen by timing steps (on a mesh only: one device has nothing to choose
      and runs `"auto"`). The tuner is asked per step; one jitted step per candidate is kept
      here (so `make_train_step`'s small cache never forces a recompile), and the steps the
      tuner asks for are timed (waits for the previous step, runs, waits for the outputs). New
      decisions are appended to `<run_dir>/tuning_events.jsonl` (with `write`: process 0). A
      resumed single-process run continues on the strategy its log last chose; with several
      processes each starts from the default (they must agree, and only process 0 may see
      the log).

    Raises:
      ValueError: another `strategy`, a pinned `Candidate` or a candidate space that does not
        fit the run.
    """

    def __init__(
        self, strategy, model_cfg, train_cfg, mesh, implementation, run_dir=None, *, write=True
    ):
        self.model_cfg, self.train_cfg, self.mesh = model_cfg, train_cfg, mesh
        self.implementation = implementation
        self.tuner: StrategyTuner | None = None
        self.note = None  # why a tuned run runs fixed
        default = isinstance(strategy, str) and strategy == "auto"
        if not (default or isinstance(strategy, Candidate | TuningConfig)):
            raise ValueError(
                f"strategy={strategy!r}: must be 'auto', a tuning.Candidate (a Strategy and a "
                "batch split) or a tuning.TuningConfig (tune)"
            )
        if isinstance(strategy, TuningConfig) and mesh is None:
            strategy, self.note = "auto", "one device: no parallel strategy to choose"
        if isinstance(strategy, TuningConfig):
            self.tuner, self.fixed = tuner_for_run(model_cfg, train_cfg, mesh, strategy), None
        elif isinstance(strategy, Candidate):
            problems = candidate_problems(strategy, model_cfg, train_cfg, mesh)
            if problems:
                raise ValueError(f"strategy {strategy.label}: {'; '.join(problems)}")
            self.fixed = (strategy.strategy, strategy.batch_split)
        else:
            self.fixed = ("auto", 1)
        self._fns: dict = {}
        self._path = None if run_dir is None else os.path.join(run_dir, EVENTS_FILE)
        self._write, self._written = write, 0

    @property
    def strategy(self):
        """The MoE strategy running now (the evaluation step uses it)."""
        return self.fixed[0] if self.tuner is None else self.tuner.current.strategy

    def begin(self, start: int, stop: int) -> None:
        """Before the first step; resumes the decision log of an earlier run up to `start`."""
        if self.tuner is None:
            return
        import jax

        history = read_decisions(self._path, up_to_step=start)
        if self._path and self._write:
            with open(self._path, "w") as f:
                f.writelines(json.dumps(d.to_json()) + "\n" for d in history)
        self.tuner.begin(start, stop, history, resume_choice=jax.process_count() == 1)
        self._written = len(history)
        self._flush()

    def fn(self, candidate_or_fixed) -> Callable:
        """The jitted train step of a candidate (or of the fixed `(strategy, batch_split)`)."""
        from moejax.training.step import make_train_step

        key = candidate_or_fixed
        if key not in self._fns:
            strategy, split = (key.strategy, key.batch_split) if isinstance(key, Candidate) else key
            self._fns[key] = make_train_step(
                self.model_cfg,
                self.train_cfg,
                self.mesh,
                strategy=strategy,
                implementation=self.implementation,
                batch_split=split,
            )
        return self._fns[key]

    def compiled(self) -> dict[str, int]:
        """Executables compiled per step function, by candidate label (1 each: no retrace)."""
        return {
            (k.label if isinstance(k, Candidate) else str(k)): f._cache_size()
            for k, f in self._fns.items()
        }

    def __call__(self, step: int, state, batch, *args):
        """Run step `step` (numbered as in metrics.jsonl): `(state, metrics)`."""
        if self.tuner is None:
            return self.fn(self.fixed)(state, batch, *args)
        import jax

        candidate, timed = self.tuner.next(step)
        fn = self.fn(candidate)
        if not timed:
            return fn(state, batch, *args)
        jax.block_until_ready(state)
        t0 = self.tuner.clock()
        out = jax.block_until_ready(fn(state, batch, *args))
        self.tuner.timed(candidate, self.tuner.clock() - t0)
        self._flush()
        return out

    def observe(self, record: dict) -> None:
        """A fetched step record (the routing the tuner follows)."""
        if self.tuner is not None:
            self.tuner.observe(record)
            self._flush()

    def _flush(self):
        new = self.tuner.decisions[self._written :]
        if new and self._path and self._write:
            with open(self._path, "a") as f:
                f.writelines(json.dumps(d.to_json()) + "\n" for d in new)
        self._written = len(self.tuner.decisions)

    def summary(self) -> dict | None:
        """What was chosen and why, for `RunResult.tuning` and the summary table."""
        if self.tuner is None:
            if self.note is None:
                return None
            return {"chosen": "default", "kind": "fixed", "reason": self.note}
        decisions = self.tuner.decisions
        measured = [d for d in decisions if d.kind in ("measured", "cost")]
        timed = [d for d in decisions if d.times]
        # A run stopped (SIGTERM, a step budget) before the tuner's first decision has none.
        kind, reason = (decisions[-1].kind, decisions[-1].reason) if decisions else (
            "none", "the run stopped before the tuner's first decision")  # fmt: skip
        return {
            "chosen": self.tuner.current.label,
            "kind": kind,
            "reason": reason,
            "times": dict(timed[-1].times) if timed else {},
            "decisions": len(decisions),
            "rounds": len(measured),
            "spent_s": self.tuner.spent_s,
            "budget_s": self.tuner.budget_s,
            "compiled": self.compiled(),
            "switches": _switches(decisions, self.tuner.space[0].label),
        }


def _switches(decisions: Sequence[Decision], default: str) -> list[tuple[int, str]]:
    """`(step, label)` where the strategy changed (from the default at the start)."""
    out, running = [], default
    for d in decisions:
        if d.chosen != running:
            out.append((d.step, d.chosen))
            running = d.chosen
    return out


def read_decisions(path: str, *, up_to_step: int | None = None) -> list[Decision]:
    """The `Decision`s of a `tuning_events.jsonl` (those taking effect by `up_to_step`)."""
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    out = [Decision.from_json(r) for r in records]
    return [d for d in out if up_to_step is None or d.step <= up_to_step]
