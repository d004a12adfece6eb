"""Choosing a training run's parallel strategy: Tutel's adaptive parallelism, in training.

What is chosen is a `Candidate`: the MoE layers' `moejax.parallel.Strategy` (mode, dispatcher,
pipeline degree `chunks`, `stagger`, dropless `bucket`) and the model's `batch_split`
(`moejax.models.lm_forward`). Every candidate computes the same update (within float
tolerance); only the time differs. `train(strategy=TuningConfig())` (`train_lm.py --strategy
auto`, the CLI default) lets a `StrategyTuner` choose; a `Candidate` pins one; `"auto"` runs the
default. The candidates come from the layer's strategy space (`moejax.parallel.strategy_space`).

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

For a target you do not have, a cost function replaces the clock: `moejax.aot.ranking`'s
`schedule_cost` compiles a candidate's train step for a deviceless mesh of the target and replays
the schedule on the target's model; `plan_strategy` there ranks the target's candidates by it
(`choose_by_cost`), and `StrategyTuner(cost=...)` decides with it instead of timing steps.

>>> c = parse_candidate("dropless,chunks=2,stagger,batch_split=2")
>>> c.strategy.chunks, c.strategy.stagger, c.batch_split
(2, True, 2)
>>> parse_candidate("data").label
'data'
"""

from moejax.training.tuning.candidates import (
    Candidate,
    candidate_problems,
    candidate_space,
    default_candidates,
    parse_candidate,
    parse_candidates,
    wanted_bucket,
)
from moejax.training.tuning.cost import choose_by_cost
from moejax.training.tuning.runner import EVENTS_FILE, StepRunner, read_decisions
from moejax.training.tuning.tuner import Decision, StrategyTuner, TuningConfig, tuner_for_run

__all__ = [
    "EVENTS_FILE",
    "Candidate",
    "Decision",
    "StepRunner",
    "StrategyTuner",
    "TuningConfig",
    "candidate_problems",
    "candidate_space",
    "choose_by_cost",
    "default_candidates",
    "parse_candidate",
    "parse_candidates",
    "read_decisions",
    "tuner_for_run",
    "wanted_bucket",
]
