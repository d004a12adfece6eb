"""The training strategy for a target you do not have: each candidate's train step compiled for
a deviceless mesh of the target, and its schedule replayed on the target's model
(`moejax.aot.schedule`) instead of timed. A `schedule_cost` is a cost function for
`moejax.training.tuning` (`choose_by_cost`, `StrategyTuner(cost=...)`)."""

from __future__ import annotations

import dataclasses

from moejax.aot import programs, schedule
from moejax.training.tuning.candidates import Candidate, candidate_space
from moejax.training.tuning.cost import choose_by_cost


def schedule_cost(model_cfg, train_cfg, target_mesh, hardware=None):
    """A `cost` (`Candidate -> seconds`) for a target you do not have: the candidate's train
    step compiled for `target_mesh` (a deviceless mesh, `moejax.aot.mesh`) and its schedule
    replayed on `hardware` (`moejax.aot.schedule`; default: `H100_SXM` for a GPU mesh,
    `TPU_V5E` for a TPU one). Each candidate compiles once (cached); compiling the `tiny` step
    for 8 H100s takes ~17 s on a 2-core CPU. The model ranks schedules (how much communication
    stays exposed), it does not predict wall time (`moejax.aot.schedule`)."""
    if hardware is None:
        platform = programs.platform_of(target_mesh)
        hardware = schedule.TPU_V5E if platform == "tpu" else schedule.H100_SXM
    cache: dict[Candidate, float] = {}

    def cost(candidate: Candidate) -> float:
        if candidate not in cache:
            fn, args = programs.train_step_program(
                model_cfg,
                train_cfg,
                target_mesh,
                strategy=candidate.strategy,
                batch_split=candidate.batch_split,
            )
            compiled = programs.compile_program(fn, args, donate_argnums=(0,))
            # Data-dependent loops are the dropless leftover rounds: none in the steady state
            # (the bucket follows the load), so they are replayed zero times.
            est = schedule.estimate(compiled, hardware, default_trip_count=0)
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
      hardware: a `moejax.aot.schedule.Hardware` (default by platform).
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
