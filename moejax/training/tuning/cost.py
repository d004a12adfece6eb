"""Deciding by a cost function instead of a clock (for a target you do not have:
`moejax.aot.ranking.schedule_cost`, a candidate's deviceless compile replayed on the target's
schedule model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from moejax.training.tuning.candidates import Candidate


def choose_by_cost(candidates: Sequence[Candidate], cost: Callable[[Candidate], float]):
    """`(fastest, {candidate: seconds})` by a cost function (e.g. a schedule model of the
    candidate's compiled program for a target you do not have); ties go to the earlier one."""
    times = {c: float(cost(c)) for c in candidates}
    return min(candidates, key=times.__getitem__), times
