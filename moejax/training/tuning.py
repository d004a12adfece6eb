"""Choosing a training run's parallel strategy: Tutel's adaptive parallelism, in training.

What is chosen is a `Candidate`: the MoE layers' `moejax.parallel.Strategy` (mode, dispatcher,
pipeline degree `chunks`, `stagger`, dropless `bucket`) and the model's `batch_split`
(`moejax.models.lm_forward`). Every candidate computes the same update (within float
tolerance); only the time differs. `train(strategy=TuningConfig())` (`train_lm.py --strategy
auto`, the CLI default) lets a `StrategyTuner` choose; a `Strategy` or `Candidate` pins one.

How the tuner decides (plain Python on the host; no tracing, testable with a fake clock):

1. **Probe.** The run starts on the default candidate (what `strategy="auto"` always ran); its
   first step (compile + run) and the next `repeats` steps are timed. That gives the step time
   the budget is measured against, and what one compilation costs on this machine.
2. **Rounds.** Each candidate in the round runs one step that compiles it (timed, to learn the
   compile cost), then the candidates take turns for `repeats` timed steps each (a load that
   drifts during the round, as on a shared machine, weighs on all alike); the lowest median
   wins (ties: the earlier candidate). A timed step is the jitted train step itself (forward,
   backward, optimizer update): the host waits for the previous step, reads the clock, runs
   the step and waits for its outputs. These are the run's own steps, and they train: every
   candidate computes the same update, so a round costs no extra steps, only its compilations
   and its slower candidates' time. (Timing on a throwaway copy of the state would double the
   state's memory and spend steps that do not train; the step donates its state.)
3. **Routing drift.** The bounded dropless dispatcher sends its rows in all-to-all rounds of a
   static `bucket` rows per (source, destination) pair: too small and skewed steps take extra
   rounds, too large and every round carries padding (on the wire on CPU, in the receive
   buffer the experts run on everywhere). After each step the host reads the step's
   per-layer device-load imbalance (one step late, from the metrics the loop fetches anyway) and
   turns it into the bucket one round needs (`wanted_bucket`); over the last `window` steps the
   largest wins (so the bucket grows at once and shrinks slowly). When it differs from the
   bucket decided for, the tuner re-decides for the new bucket. Decisions are kept per bucket and
   compiled steps per candidate (its bucket included): a bucket seen before costs nothing, and
   each distinct (candidate, bucket) compiles once. Only the dropless candidates' programs
   depend on the bucket; the others are re-timed (no compile) since the load changed.
4. **Budget.** Compiling is what tuning costs: on a 2-core CPU machine one step of the `tiny`
   model compiles in 10 to 30 s, against ~0.4 s per step. A round only compiles what
   `budget x projected run time` (the probe's step time times the run's steps) still allows,
   each compile estimated at the largest compile cost measured so far, candidates in priority
   order (the current one first, then the space's order); the rest are logged as skipped. With
   the default budget (10%) a short CPU run keeps the default candidate and says why; a long
   run, or one whose compiles hit the persistent compilation cache, tunes.

Why imbalance and not the exact pair counts: the exact largest (source, destination) count needs
every token's expert ids per layer, which the step does not return (`moejax.models.LMAux` keeps
per-layer statistics). The per-layer imbalance (busiest device's rows / mean, under the current
placement) is in every step record; the busiest destination gets `imbalance x T K / N` rows from
an average source, and a source's count is close to binomial, so `wanted_bucket` adds
`margin` standard deviations. An underestimate is never wrong, only slower: the dispatcher takes
one more round.

Every decision (probe, measured round, decision by cost function, skip for budget) is a
`Decision` record with the candidates' median times; `train` appends them to
`tuning_events.jsonl` and the run summary shows the last one. Several processes must run the
same program: every timed sample is broadcast from process 0 (`agree`), so all decide alike.

For a target you do not have, a cost function replaces the clock: `schedule_cost` compiles a
candidate's train step for a deviceless mesh of the target (`moejax.aot.train_step_program`) and
replays the schedule on the target's model (`moejax.schedule_model.estimate`); `plan_strategy`
ranks the target's candidates by it (`choose_by_cost`), and `StrategyTuner(cost=...)` decides
with it instead of timing steps.

>>> c = parse_candidate("dropless,chunks=2,stagger,batch_split=2")
>>> c.strategy.chunks, c.strategy.stagger, c.batch_split
(2, True, 2)
>>> parse_candidate("data").label
'data'
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence

from moejax._config import MoEConfig
from moejax.parallel.dispatch_dropless import choose_bucket, default_bucket
from moejax.parallel.modes import MODES
from moejax.parallel.strategy import DISPATCHERS, Strategy, resolve_strategy

log = logging.getLogger(__name__)

EVENTS_FILE = "tuning_events.jsonl"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the training step: the MoE layers' strategy and the batch split.

    Args:
      strategy: the sharded MoE `Strategy`; its `bucket` is set by the tuner per routing load.
      batch_split: micro-batches side by side through every block (`lm_forward`); must divide
        each token shard's rows (per gradient-accumulation micro-batch).
    """

    strategy: Strategy = Strategy()
    batch_split: int = 1

    def __post_init__(self):
        if not isinstance(self.strategy, Strategy):
            raise ValueError(f"Candidate.strategy={self.strategy!r}: must be a Strategy")
        bs = self.batch_split
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"Candidate.batch_split={bs!r}: must be a positive int")
        s = self.strategy
        if s.mode != "expert" and (s.dispatcher != "dropless" or s.bucket is not None):
            # The dispatcher and bucket only matter in expert mode: one spelling per program.
            object.__setattr__(self, "strategy", s.replace(dispatcher="dropless", bucket=None))

    @property
    def bucketed(self) -> bool:
        """Whether the program depends on the dropless bucket."""
        return self.strategy.mode == "expert" and self.strategy.dispatcher == "dropless"

    @property
    def label(self) -> str:
        """The `parse_candidate` spelling, e.g. `"dropless,chunks=2,stagger,bucket=160"`."""
        s = self.strategy
        parts = [s.dispatcher if s.mode == "expert" else s.mode]
        if s.chunks > 1:
            parts.append(f"chunks={s.chunks}")
        if s.stagger:
            parts.append("stagger")
        if self.bucketed and s.exchange == "ragged":
            parts.append("ragged")
        if self.batch_split > 1:
            parts.append(f"batch_split={self.batch_split}")
        if self.bucketed and s.bucket is not None:
            parts.append(f"bucket={s.bucket}")
        return ",".join(parts)

    def unbucketed(self) -> Candidate:
        return dataclasses.replace(self, strategy=self.strategy.replace(bucket=None))


def parse_candidate(text: str) -> Candidate:
    """A `Candidate` from comma-separated parts: a mode (`expert`, `data`, `tensor`), a
    dispatcher (`dropless`, `allgather`, `capacity`; implies expert mode), `chunks=N`,
    `stagger`, `ragged` (the dropless exchange, `Strategy.exchange`), `batch_split=N` (or
    `split=N`), `bucket=N`.

    Raises:
      ValueError: naming the part that is not understood.
    """
    mode, dispatcher, fields, split = "expert", "dropless", {}, 1
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, _, value = part.partition("=")
        if part in MODES:
            mode = part
        elif part in DISPATCHERS:
            dispatcher = part
        elif part == "stagger":
            fields["stagger"] = True
        elif part == "ragged":
            fields["exchange"] = "ragged"
        elif key in ("chunks", "bucket", "batch_split", "split") and value.isdigit():
            if key in ("batch_split", "split"):
                split = int(value)
            else:
                fields[key] = int(value)
        else:
            raise ValueError(
                f"strategy {text!r}: cannot read {part!r} (parts: a mode {'/'.join(MODES)}, a "
                f"dispatcher {'/'.join(DISPATCHERS)}, chunks=N, stagger, ragged, batch_split=N, "
                "bucket=N)"
            )
    return Candidate(Strategy(mode=mode, dispatcher=dispatcher, **fields), split)


def parse_candidates(text: str) -> tuple[Candidate, ...]:
    """`parse_candidate` of each `;`-separated spec."""
    return tuple(parse_candidate(p) for p in text.split(";") if p.strip())


def default_candidates(config: MoEConfig, platform: str) -> tuple[Candidate, ...]:
    """The candidates tried by default, the default (`strategy="auto"`) first.

    Everywhere: the default, data-parallel experts (weights all-gathered, no token exchange)
    and the all-gather dispatcher. On GPU and TPU also a staggered 2-chunk pipeline and a batch
    split of 2, which only pay where collectives run beside compute: XLA:CPU runs them
    synchronously, so on CPU they only add work (and each costs a compile).
    """
    first = resolve_strategy("auto", config)
    out = [Candidate(first)]
    if platform != "cpu":
        out += [Candidate(first.replace(chunks=2, stagger=True)), Candidate(first, batch_split=2)]
    out += [Candidate(Strategy(mode="data")), Candidate(Strategy(dispatcher="allgather"))]
    return tuple(out)


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


def wanted_bucket(imbalance: float, tokens: int, top_k: int, n: int, *, margin: float = 2.0):
    """The dropless bucket that carries one step's busiest (source, destination) pair in one
    round, estimated from the layer's device-load imbalance (module docstring).

    Args:
      imbalance: busiest device's rows over the mean over the `expert` axis (>= 1).
      tokens: `T`, tokens per device in one MoE call.
      top_k: `K`.
      n: `N`, devices on the `expert` axis.
      margin: standard deviations above the mean count.

    Returns:
      `choose_bucket` of the estimate: a multiple of `balanced / 8`, at most 1.25 x balanced.
    """
    share = min(1.0, max(1.0, imbalance) / n)
    mean = tokens * top_k * share
    pair = math.ceil(mean + margin * math.sqrt(mean * (1.0 - share)))
    return choose_bucket(pair, tokens, top_k, n)


def candidate_problems(candidate: Candidate, model_cfg, train_cfg, mesh) -> list[str]:
    """Why `candidate` cannot run this model, batch and mesh (empty: it can)."""
    from moejax.parallel import mesh as mesh_lib

    if mesh is None:
        return [] if candidate.batch_split == 1 else ["batch_split needs a mesh here"]
    s, moe = candidate.strategy, model_cfg.moe
    rows = train_cfg.batch_size // mesh_lib.token_shards(mesh) // train_cfg.microbatches
    seq_len = train_cfg.seq_len or model_cfg.max_seq_len
    n, m = mesh_lib.axis_size(mesh, "expert"), mesh_lib.axis_size(mesh, "model")
    problems = []
    if rows % candidate.batch_split:
        problems.append(
            f"batch_split={candidate.batch_split} does not divide the {rows} sequences of a "
            f"token shard"
        )
    elif (rows // candidate.batch_split * seq_len) % s.chunks:
        problems.append(f"chunks={s.chunks} does not divide a shard's tokens")
    if s.mode == "tensor" and (moe.d_ff // m) % n:
        problems.append(f"tensor mode needs d_ff/model={moe.d_ff // m} divisible by expert={n}")
    capacity_routing = moe.dispatch == "capacity" or moe.router == "expert_choice"
    if s.mode == "expert" and s.dispatcher == "capacity":
        if not capacity_routing:
            problems.append("the capacity dispatcher needs a capacity config")
        if train_cfg.expert_slots_per_device:
            problems.append("the capacity dispatcher does not take an expert placement")
    return problems


def candidate_space(model_cfg, train_cfg, mesh, candidates=None) -> tuple[Candidate, ...]:
    """The candidates (default: `default_candidates` for the mesh's platform) that fit the run,
    duplicates dropped, order kept.

    Raises:
      ValueError: if none fits (naming each one's problem).
    """
    if candidates is None:
        platform = "cpu" if mesh is None else mesh.devices.flat[0].platform
        candidates = default_candidates(model_cfg.moe, platform)
    out, why = [], []
    for c in candidates:
        problems = candidate_problems(c, model_cfg, train_cfg, mesh)
        if problems:
            why.append(f"{c.label}: {'; '.join(problems)}")
        elif c not in out:
            out.append(c)
    if not out:
        raise ValueError("no candidate strategy fits the run: " + " | ".join(why))
    return tuple(out)


def choose_by_cost(candidates: Sequence[Candidate], cost: Callable[[Candidate], float]):
    """`(fastest, {candidate: seconds})` by a cost function (e.g. a schedule model of the
    candidate's compiled program for a target you do not have); ties go to the earlier one."""
    times = {c: float(cost(c)) for c in candidates}
    return min(candidates, key=times.__getitem__), times


def schedule_cost(model_cfg, train_cfg, target_mesh, hardware=None):
    """A `cost` (`Candidate -> seconds`) for a target you do not have: the candidate's train
    step compiled for `target_mesh` (a deviceless mesh, `moejax.aot.mesh`) and its schedule
    replayed on `hardware` (`moejax.schedule_model`; default: `H100_SXM` for a GPU mesh,
    `TPU_V5E` for a TPU one). Each candidate compiles once (cached); compiling the `tiny` step
    for 8 H100s takes ~17 s on a 2-core CPU. The model ranks schedules (how much communication
    stays exposed), it does not predict wall time (`moejax.schedule_model`)."""
    from moejax import aot, schedule_model

    if hardware is None:
        platform = aot.platform_of(target_mesh)
        hardware = schedule_model.TPU_V5E if platform == "tpu" else schedule_model.H100_SXM
    cache: dict[Candidate, float] = {}

    def cost(candidate: Candidate) -> float:
        if candidate not in cache:
            fn, args = aot.train_step_program(
                model_cfg,
                train_cfg,
                target_mesh,
                strategy=candidate.strategy,
                batch_split=candidate.batch_split,
            )
            compiled = aot.compile_program(fn, args, donate_argnums=(0,))
            # Data-dependent loops are the dropless leftover rounds: none in the steady state
            # (the bucket follows the load), so they are replayed zero times.
            est = schedule_model.estimate(compiled, hardware, default_trip_count=0)
            cache[candidate] = est.step_s
        return cache[candidate]

    return cost


def plan_strategy(
    model_cfg, train_cfg, target_mesh, *, candidates=None, hardware=None, bucket=None
):
    """The candidate to train with on a target you do not have, by `schedule_cost`.

    Args:
      model_cfg, train_cfg: the run's configs.
      target_mesh: a deviceless mesh of the target (`moejax.aot.mesh("cuda", (8,), ("expert",))`).
      candidates: to rank (default: `default_candidates` for the target's platform); those that
        do not fit are left out.
      hardware: a `moejax.schedule_model.Hardware` (default by platform).
      bucket: the dropless bucket to compile with (None: the balanced share).

    Returns:
      `(best, {candidate: modelled step seconds})`.
    """
    space = candidate_space(model_cfg, train_cfg, target_mesh, candidates)
    if bucket is not None:
        space = tuple(
            dataclasses.replace(c, strategy=c.strategy.replace(bucket=bucket)) if c.bucketed else c
            for c in space
        )
    return choose_by_cost(space, schedule_cost(model_cfg, train_cfg, target_mesh, hardware))


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


class StepRunner:
    """The loop's side of the strategy: which jitted train step runs each step.

    Fixed (`strategy` a `Strategy`, `"auto"` or a `Candidate`): one step function, dispatched
    asynchronously, as before. Tuned (a `TuningConfig`, `"tune"` or a `StrategyTuner`; on a mesh
    only: one device has nothing to choose and runs the default): asks the tuner per step, keeps
    one jitted step per candidate here (so `make_train_step`'s small cache never forces a
    recompile), and times the steps the tuner asks for (waits for the previous step, runs,
    waits for the outputs). New decisions are appended to `<run_dir>/tuning_events.jsonl`
    (with `write`: process 0). A resumed single-process run continues on the strategy its log
    last chose; with several processes each starts from the default (they must agree, and
    only process 0 may see the log).

    Raises:
      ValueError: a pinned `Candidate` or a candidate space that does not fit the run.
    """

    def __init__(
        self, strategy, model_cfg, train_cfg, mesh, implementation, run_dir=None, *, write=True
    ):
        self.model_cfg, self.train_cfg, self.mesh = model_cfg, train_cfg, mesh
        self.implementation = implementation
        self.tuner: StrategyTuner | None = None
        self.note = None  # why a tuned run runs fixed
        if strategy == "tune":
            strategy = TuningConfig()
        if isinstance(strategy, TuningConfig | StrategyTuner) and mesh is None:
            strategy, self.note = "auto", "one device: no parallel strategy to choose"
        if isinstance(strategy, TuningConfig):
            strategy = tuner_for_run(model_cfg, train_cfg, mesh, strategy)
        if isinstance(strategy, StrategyTuner):
            self.tuner, self.fixed = strategy, None
        elif isinstance(strategy, Candidate):
            problems = candidate_problems(strategy, model_cfg, train_cfg, mesh)
            if problems:
                raise ValueError(f"strategy {strategy.label}: {'; '.join(problems)}")
            self.fixed = (strategy.strategy, strategy.batch_split)
        else:  # "auto" or a Strategy, exactly as before tuning existed
            self.fixed = (strategy, 1)
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
        last = decisions[-1]
        return {
            "chosen": self.tuner.current.label,
            "kind": last.kind,
            "reason": last.reason,
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
