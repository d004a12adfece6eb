"""Realized imbalance falls of re-placements: the online calibration of the controller's forecast.

The planner scores its candidate on the counts it was planned on, which overstates the fall a
re-placement will show when routing drifts (BENCHMARKS.md, "Placement in training"). A
``FallTracker`` follows every accepted re-placement over the steps it runs, scores the old and the
new table on each of those steps' counts, and keeps the sums of the in-sample and the realized
falls of the re-placements measured to the end: ``ratio`` is the share of a forecast fall that
this run's routing lets survive.

Shape letters: ``L`` layers, ``E`` experts, ``P`` slots.

>>> import numpy as np
>>> from moejax.placement import Placement
>>> old = Placement.identity(num_experts=4, num_devices=2, slots_per_device=2)
>>> new = old.with_table(np.array([0, 2, 1, 3]))
>>> tracker = FallTracker()
>>> counts = np.array([[4.0, 3, 1, 0]])  # [L, E]
>>> tracker.follow(0, old, new, first=1, last=2, forecast_fall=1.0)
>>> for step in (1, 2):
...     tracker.observe(step, counts)
>>> tracker.matured, round(old.imbalance(counts[0]) - new.imbalance(counts[0]), 3), tracker.ratio
(1, 0.5, 0.5)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.placement.table import Placement


@dataclasses.dataclass
class _Followed:
    """An accepted re-placement whose realized fall is still being measured."""

    layer: int
    old: Placement
    new: Placement
    first: int  # first step run on ``new``
    last: int  # last step measured
    forecast_fall: float  # in-sample: per-step imbalance of old minus new on the planned steps
    falls: list[float] = dataclasses.field(default_factory=list)  # old minus new, step by step


class FallTracker:
    """Follows re-placements step by step; ``ratio`` = realized over forecast fall."""

    def __init__(self):
        self._followed: list[_Followed] = []
        self.forecast_sum = 0.0  # in-sample falls of the matured re-placements
        self.realized_sum = 0.0  # their realized falls (mean per step over their window)
        self.matured = 0  # re-placements measured to the end of their window

    @property
    def ratio(self) -> float:
        """Realized over in-sample fall, summed over the matured re-placements (1.0 before the
        first, or while their in-sample falls sum to <= 0; negative when they made things
        worse)."""
        if self.forecast_sum <= 0:
            return 1.0
        return self.realized_sum / self.forecast_sum

    def follow(
        self, layer: int, old: Placement, new: Placement, *, first: int, last: int, forecast_fall
    ) -> None:
        """Measure the re-placement of ``layer`` from ``old`` to ``new`` on steps
        ``first..last`` (the steps it runs), against its in-sample ``forecast_fall``."""
        if last < first:
            raise ValueError(f"last must be >= first, got first={first}, last={last}")
        self._followed.append(_Followed(layer, old, new, first, last, float(forecast_fall)))

    def observe(self, step: int, counts: np.ndarray) -> None:
        """Score the followed re-placements on ``counts [L, E]`` of ``step``; retire those whose
        window ended (a re-placement none of whose steps was seen is dropped)."""
        going = []
        for f in self._followed:
            if f.first <= step <= f.last:
                c = counts[f.layer]
                f.falls.append(f.old.imbalance(c) - f.new.imbalance(c))
            if step < f.last:
                going.append(f)
            elif f.falls:
                self.matured += 1
                self.forecast_sum += f.forecast_fall
                self.realized_sum += float(np.mean(f.falls))
        self._followed = going

    def state_dict(self) -> dict:
        """JSON-serialisable state (``load_state_dict`` restores it exactly)."""
        return {
            "forecast_sum": self.forecast_sum,
            "realized_sum": self.realized_sum,
            "matured": self.matured,
            "followed": [
                {
                    **{k: getattr(f, k) for k in ("layer", "first", "last", "forecast_fall")},
                    "old": f.old.slot_to_expert.tolist(),
                    "new": f.new.slot_to_expert.tolist(),
                    "falls": list(f.falls),
                }
                for f in self._followed
            ],
        }

    def load_state_dict(self, state: dict, placements: list[Placement]) -> None:
        """Restore ``state_dict()``; ``placements`` (one per layer) give the tables' shapes."""
        self.forecast_sum = float(state["forecast_sum"])
        self.realized_sum = float(state["realized_sum"])
        self.matured = int(state["matured"])
        self._followed = []
        for f in state["followed"]:
            like = placements[f["layer"]]
            self._followed.append(
                _Followed(
                    f["layer"],
                    like.with_table(np.asarray(f["old"], np.int64)),
                    like.with_table(np.asarray(f["new"], np.int64)),
                    f["first"],
                    f["last"],
                    f["forecast_fall"],
                    [float(x) for x in f["falls"]],
                )
            )
