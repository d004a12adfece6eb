"""`StrategyTuner`: the host-side decisions of the tuning loop (probe, timed rounds, budget, routing
drift), with its `TuningConfig` and its `Decision` log."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence

from moejax.parallel.dispatch_dropless import default_bucket
from moejax.training.tuning.candidates import (
    Candidate,
    candidate_space,
    parse_candidate,
    wanted_bucket,
)
from moejax.training.tuning.cost import choose_by_cost

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """What the tuner tries and how much it may spend.

    Args:
      candidates: the candidates in priority order (None: `default_candidates` for the mesh's
        platform); those that do not fit the run are left out (`candidate_problems`); their
        buckets are the tuner's to set.
      repeats: timed steps per candidate and bucket (the median counts), after the step that
        compiles it.
      budget: fraction of the projected run time (the probe's step time x the run's steps)
        that compiling and running slower candidates may cost; `math.inf`: no limit, 0: keep
        the default (the probe still runs).
      window: steps over which the largest wanted bucket is taken.
      margin: standard deviations of a source's count added to the mean (`wanted_bucket`).
      redecide: re-decide when the wanted bucket changes (False: decide once, at the start).
    """

    candidates: tuple[Candidate, ...] | None = None
    repeats: int = 3
    budget: float = 0.1
    window: int = 10
    margin: float = 2.0
    redecide: bool = True

    def __post_init__(self):
        if self.candidates is not None:
            object.__setattr__(self, "candidates", tuple(self.candidates))
            if not self.candidates or not all(isinstance(c, Candidate) for c in self.candidates):
                raise ValueError(
                    f"TuningConfig.candidates={self.candidates!r}: need Candidates, or None"
                )
        for name in ("repeats", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TuningConfig.{name}={value!r}: must be a positive int")
        if not self.budget >= 0:
            raise ValueError(f"TuningConfig.budget={self.budget!r}: must be >= 0 (or math.inf)")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"TuningConfig.margin={self.margin!r}: must be a finite number >= 0")


@dataclasses.dataclass(frozen=True)
class Decision:
    """One entry of the tuner's log (a line of `tuning_events.jsonl`).

    `kind`: `"probe"` (the default's step and compile time), `"measured"` (a round of timed
    steps), `"cost"` (ranked by the cost function), `"followed"` (only one candidate could be
    afforded: taken without timing), `"skipped"` (nothing new affordable: kept the current one).
    """

    step: int  # the first step (as numbered in metrics.jsonl) that runs `chosen`
    started: int  # the first step of its round (timed steps from here to `step - 1`)
    kind: str
    reason: str
    bucket: int  # the dropless bucket decided for (rows per (source, destination) per round)
    chosen: str  # Candidate.label
    times: tuple[tuple[str, float], ...] = ()  # median s per step, fastest first
    compile_s: tuple[tuple[str, float], ...] = ()  # first step's time over the median, if compiled
    skipped: tuple[str, ...] = ()  # candidates left out for the budget
    spent_s: float = 0.0  # tuning cost so far (compiles, slower candidates' excess time)
    budget_s: float | None = None

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["times"] = dict(self.times)
        out["compile_s"] = dict(self.compile_s)
        out["skipped"] = list(self.skipped)
        if self.budget_s is not None and math.isinf(self.budget_s):
            out["budget_s"] = "inf"  # JSON has no infinity
        return out

    @classmethod
    def from_json(cls, record: dict) -> Decision:
        return cls(
            **{
                **record,
                "times": tuple(record["times"].items()),
                "compile_s": tuple(record["compile_s"].items()),
                "skipped": tuple(record["skipped"]),
                "budget_s": None if record["budget_s"] is None else float(record["budget_s"]),
            }
        )


def _secs(x: float | None) -> str:
    return "no limit" if x is None or math.isinf(x) else f"{x:.3g} s"


@dataclasses.dataclass
class _Round:
    started: int
    key: int
    candidates: list[Candidate]
    reason: str
    kind: str
    skipped: tuple[str, ...] = ()
    runs: list = dataclasses.field(default_factory=list)  # (candidate, seconds) timed
    first: dict = dataclasses.field(default_factory=dict)  # candidate -> its compiling run


class StrategyTuner:
    """Decides which `Candidate` runs each step (module docstring); the loop runs it.

    The loop calls `begin` once, then per step `next(step)` -> `(candidate, timed)`; after a
    timed step `timed(candidate, seconds)`; and `observe(record)` with each fetched step record
    (`moejax.training.metrics.step_record`). `decisions` is the log; `running` the candidate
    of the step being timed (None otherwise), which a test's clock may read.

    Args:
      space: candidates in priority order, the default first (`candidate_space`).
      tokens: `T`, tokens per device in one MoE call at `batch_split=1`.
      top_k: `K`.
      n: `N`, devices on the `expert` axis.
      config: a `TuningConfig` (its `candidates` are not used here: `space` is).
      clock: seconds, monotonic (`time.perf_counter`).
      cost: optional `Candidate -> seconds` that replaces timing steps (`choose_by_cost`).
      agree: `seconds -> seconds` applied to every timed sample (multi-process: process 0's).
    """

    def __init__(
        self,
        space: Sequence[Candidate],
        *,
        tokens: int,
        top_k: int,
        n: int,
        config: TuningConfig = TuningConfig(),
        clock: Callable[[], float] = time.perf_counter,
        cost: Callable[[Candidate], float] | None = None,
        agree: Callable[[float], float] | None = None,
    ):
        if not space:
            raise ValueError("StrategyTuner: the candidate space is empty")
        self.space = tuple(c.unbucketed() for c in space)
        self.tokens, self.top_k, self.n = tokens, top_k, n
        self.config, self.clock, self.cost = config, clock, cost
        self._agree = agree or (lambda x: x)
        self.balanced = default_bucket(tokens, top_k, n)
        self.decisions: list[Decision] = []
        self.running: Candidate | None = None
        self.key = self.balanced  # the bucket decided for
        self.current = self.at(self.space[0], self.key)
        self.spent_s, self.budget_s = 0.0, None
        self._steps = 0  # steps of this run (for the budget)
        self._last_step = self._stop = 0
        self._queue: list[Candidate] = []
        self._round: _Round | None = None
        self._choice: dict[int, Candidate] = {}
        self._samples: dict[tuple[Candidate, int], list[float]] = {}
        self._compile_s: dict[Candidate, float] = {}
        self._compiled: set[Candidate] = set()
        self._wanted: collections.deque[int] = collections.deque(maxlen=config.window)
        self._skipped_keys: set[int] = set()

    # -- the loop's side ------------------------------------------------------------------

    def begin(
        self, start: int, stop: int, history: Sequence[Decision] = (), *, resume_choice=True
    ) -> None:
        """Start at step `start` (steps done) of a run that stops at `stop`; `history`: the
        decisions of the run this one resumes, kept in `decisions`; with `resume_choice` it
        continues on the last one's choice."""
        self._steps, self._last_step, self._stop = stop - start, start, stop
        self.decisions = list(history)
        if history and resume_choice:
            last = history[-1]
            chosen = parse_candidate(last.chosen)
            if chosen.unbucketed() in self.space:
                self.key, self.current = last.bucket, chosen
                self._choice[last.bucket] = chosen
        probe = 1 + self.config.repeats
        if self._steps <= probe:  # nothing would be left to run the winner on
            self._log("skipped", f"{self._steps} steps: too few to tune (a probe is {probe})")
            return
        self._start_round(self.key, [self.current], "probe", kind="probe")

    def next(self, step: int) -> tuple[Candidate, bool]:
        """The candidate to run step `step` (numbered as in metrics.jsonl) and whether to time
        it (the loop then waits for the step and calls `timed`)."""
        self._last_step = step
        if self._queue:
            self.running = self._queue[0]
            return self.running, True
        self.running = None
        return self.current, False

    def timed(self, candidate: Candidate, seconds: float) -> None:
        """The wall time of a timed step of `candidate` (compile included on its first)."""
        if not self._queue or self._queue[0] != candidate:
            raise ValueError(f"timed({candidate.label}): not the candidate being timed")
        seconds = float(self._agree(float(seconds)))
        self._queue.pop(0)
        self.running = None
        rnd = self._round
        rnd.runs.append((candidate, seconds))
        if candidate in self._compiled:
            self._samples.setdefault((candidate, rnd.key), []).append(seconds)
        else:  # compile + run; the compile's share is known once the median is
            self._compiled.add(candidate)
            rnd.first[candidate] = seconds
        if not self._queue:
            self._finish_round()

    def observe(self, record: dict) -> None:
        """A fetched step record: its `device_imbalance` moves the wanted bucket; a change
        starts a re-decision (when no round is running and the probe is done)."""
        imbalance = [x for x in record.get("device_imbalance") or () if x is not None]
        if not imbalance:
            return
        self._wanted.append(
            wanted_bucket(
                max(imbalance), self.tokens, self.top_k, self.n, margin=self.config.margin
            )
        )
        if self._round is not None or self.budget_s is None or not self.config.redecide:
            return
        want = max(self._wanted)
        if want != self.key:
            self.redecide(
                want,
                f"routing: bucket {self.key} -> {want} (busiest device {max(imbalance):.2f}x "
                f"the mean)",
            )

    @property
    def programs(self) -> frozenset[Candidate]:
        """The candidates (bucket included) that have run: one compiled program each."""
        return frozenset(self._compiled)

    # -- decisions ------------------------------------------------------------------------

    def at(self, candidate: Candidate, key: int) -> Candidate:
        """`candidate` with the bucket for `key` (None where the balanced share covers it, so
        the default program is the one `strategy="auto"` runs)."""
        if not candidate.bucketed:
            return candidate
        bucket = math.ceil(key / candidate.batch_split)
        balanced = default_bucket(self.tokens // candidate.batch_split, self.top_k, self.n)
        strategy = candidate.strategy.replace(bucket=None if bucket <= balanced else bucket)
        return dataclasses.replace(candidate, strategy=strategy)

    def redecide(self, key: int, reason: str) -> None:
        """Choose for bucket `key`: a cached choice, or a round within the budget."""
        if key in self._choice and self._choice[key] in self._compiled:
            if (key, self._choice[key]) != (self.key, self.current):  # else nothing changes
                self.key, self.current = key, self._choice[key]
                self._log("followed", f"{reason}; decided before", key, ())
            return
        ordered = sorted(self.space, key=lambda c: c != self.current.unbucketed())
        candidates = list(dict.fromkeys(self.at(c, key) for c in ordered))
        if self.cost is not None:
            t0 = time.perf_counter()
            best, times = choose_by_cost(candidates, self.cost)
            self.spent_s += self._agree(time.perf_counter() - t0)  # processes decide alike
            self.key, self.current, self._choice[key] = key, best, best
            self._log("cost", f"{reason}; ranked by the cost function", key, (), times=times)
            return
        estimate = max(self._compile_s.values(), default=0.0)
        left = (self.budget_s if self.budget_s is not None else math.inf) - self.spent_s
        chosen, skipped, compiles = [], [], 0
        for c in candidates:
            new = c not in self._compiled
            if new and estimate * (compiles + 1) > left:
                skipped.append(c.label)
                continue
            chosen.append(c)
            compiles += new
        why = (
            f"a compile is estimated at {_secs(estimate)}, {_secs(max(left, 0.0))} of the "
            f"{_secs(self.budget_s)} budget left"
            if skipped
            else "no other candidate"
        )
        steps = sum(self._runs_needed(c, key) for c in chosen)
        if len(chosen) > 1 and steps >= self._stop - self._last_step:
            if key not in self._skipped_keys:  # the winner would never run
                self._skipped_keys.add(key)
                self._log("skipped", f"{reason}; a round of {steps} steps does not fit", key)
        elif len(chosen) > 1:
            self._start_round(key, chosen, reason, kind="measured", skipped=tuple(skipped))
        elif chosen:  # one affordable candidate: nothing to compare, take it
            c = chosen[0]
            if c not in self._compiled:
                self.spent_s += estimate
                self._compiled.add(c)
            self.key, self.current, self._choice[key] = key, c, c
            self._log("followed", f"{reason}; only it fits: {why}", key, tuple(skipped))
        elif key not in self._skipped_keys:
            self._skipped_keys.add(key)
            self._log("skipped", f"{reason}; kept {self.current.label}: {why}", key, skipped)

    def _start_round(self, key, candidates, reason, *, kind, skipped=()):
        self._round = _Round(self._last_step + 1, key, list(candidates), reason, kind, skipped)
        # The compiling runs first, then the timed ones taken in turns (A B C A B C ...): a
        # load that drifts during the round (a shared machine) weighs on every candidate alike.
        self._queue = [c for c in candidates if c not in self._compiled]
        timed = [
            [c] * max(0, self.config.repeats - len(self._samples.get((c, key), ())))
            for c in candidates
        ]
        self._queue += [c for turn in itertools.zip_longest(*timed) for c in turn if c]
        if not self._queue:
            self._finish_round()

    def _runs_needed(self, candidate: Candidate, key: int) -> int:
        """Steps a round runs `candidate` for: one that compiles it, then the timed ones."""
        runs = int(candidate not in self._compiled)
        return runs + max(0, self.config.repeats - len(self._samples.get((candidate, key), ())))

    def _finish_round(self):
        rnd, self._round = self._round, None
        median = {c: statistics.median(self._samples[(c, rnd.key)]) for c in rnd.candidates}
        compile_s = {c: max(0.0, first - median[c]) for c, first in rnd.first.items()}
        self._compile_s.update(compile_s)
        best = min(rnd.candidates, key=median.__getitem__)
        if rnd.kind == "probe":  # the default compiles in any run: not a tuning cost
            self.budget_s = self.config.budget * self._steps * median[best]
        else:  # what the round took beyond running the winner all along
            self.spent_s += sum(s for _, s in rnd.runs) - len(rnd.runs) * median[best]
        self.key, self.current = rnd.key, best
        if rnd.kind != "probe":  # the probe measured one candidate: it decided nothing
            self._choice[rnd.key] = best
        self._log(
            rnd.kind,
            rnd.reason,
            rnd.key,
            rnd.skipped,
            times=median,
            compile_s=compile_s,
            started=rnd.started,
        )
        if rnd.kind == "probe":
            want = max(self._wanted, default=self.key)
            self.redecide(
                want,
                "start"
                if want == self.key
                else f"start: the routing load wants bucket {want} (balanced {self.balanced})",
            )

    def _log(self, kind, reason, key=None, skipped=(), *, times=None, compile_s=None, started=None):
        times = sorted((times or {}).items(), key=lambda kv: kv[1])
        decision = Decision(
            step=self._last_step + 1,
            started=self._last_step + 1 if started is None else started,
            kind=kind,
            reason=reason,
            bucket=self.key if key is None else key,
            chosen=self.current.label,
            times=tuple((c.label, round(t, 6)) for c, t in times),
            compile_s=tuple((c.label, round(t, 3)) for c, t in (compile_s or {}).items()),
            skipped=tuple(skipped),
            spent_s=round(self.spent_s, 3),
            budget_s=None if self.budget_s is None else round(self.budget_s, 3),
        )
        self.decisions.append(decision)
        log.info("strategy decision: %s", decision.to_json())


def tuner_for_run(
    model_cfg,
    train_cfg,
    mesh,
    config: TuningConfig = TuningConfig(),
    *,
    clock: Callable[[], float] = time.perf_counter,
    cost: Callable[[Candidate], float] | None = None,
) -> StrategyTuner:
    """A `StrategyTuner` for a run's model, batch and mesh (`mesh` not None): the candidate
    space that fits, the per-device token count of one MoE call, and, with several processes,
    timings agreed on process 0's."""
    import jax

    from moejax.parallel import mesh as mesh_lib

    rows = train_cfg.batch_size // mesh_lib.token_shards(mesh) // train_cfg.microbatches
    agree = None
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        def agree(seconds):
            return float(multihost_utils.broadcast_one_to_all(np.float32(seconds)))

    return StrategyTuner(
        candidate_space(model_cfg, train_cfg, mesh, config.candidates),
        tokens=rows * (train_cfg.seq_len or model_cfg.max_seq_len),
        top_k=model_cfg.moe.top_k,
        n=mesh_lib.axis_size(mesh, "expert"),
        config=config,
        clock=clock,
        cost=cost,
        agree=agree,
    )
