"""Measured imbalance falls of re-placements: the online calibration of the controller's forecast.

The planner scores its candidate on the counts it was planned on, which overstates the fall a
re-placement will measure when routing drifts or the plan fitted noise (BENCHMARKS.md,
"Placement in training"). A ``FallTracker`` follows every candidate the controller's forecast
judged (applied or not: a layout's device loads on a step are a function of the step's counts
alone) over the steps it runs, or would have run, and measures its fall as the layer's logs
would show it: the old table's per-step imbalance over the steps the decision saw, minus the new
table's over those steps. The
``ratio`` of measured to in-sample falls, summed over the ``recent`` candidates measured
last, scales the next forecasts. Recent ones only: the share that survives changes as training
goes (while routers form, far less of a fall survives than later). On the tiny LM, over whole
runs, the forecast with the last 5 is 0.93-1.16x the measured fall on the five traces it was
chosen on and 1.10-1.11x on two later runs; per phase 0.9-1.7x in the first 60 steps and
0.76-0.96x after (BENCHMARKS.md, "Placement in training").

Shape letters: ``L`` layers, ``E`` experts, ``P`` slots.

>>> import numpy as np
>>> from moejax.placement import Placement
>>> new = Placement(np.array([0, 2, 1, 3]), num_experts=4, num_devices=2, slots_per_device=2)
>>> tracker = FallTracker()
>>> counts = np.array([[4.0, 3, 1, 0]])  # [L, E]
>>> tracker.follow(0, new, first=1, last=2, before=2.0, forecast_fall=1.0)
>>> for step in (1, 2):
...     tracker.observe(step, counts)
>>> tracker.matured, new.imbalance(counts[0]), tracker.ratio  # measured fall 2.0 - 1.25
(1, 1.25, 0.75)
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from moejax.placement.table import Placement


@dataclasses.dataclass
class _Followed:
    """An accepted re-placement whose measured fall is still being collected."""

    layer: int
    new: Placement
    first: int  # first step run on ``new``
    last: int  # last step measured
    before: float  # the old table's per-step imbalance over the steps the decision saw
    forecast_fall: float  # in-sample: ``before`` minus the new table's on those steps
    after: list[float] = dataclasses.field(default_factory=list)  # new's, step by step


class FallTracker:
    """Follows re-placements step by step; ``ratio`` = measured over in-sample fall.

    Args:
      recent: matured re-placements ``ratio`` sums over, the most recent first.
    """

    def __init__(self, recent: int = 5):
        if recent < 1:
            raise ValueError(f"recent must be >= 1, got {recent!r}")
        self._followed: list[_Followed] = []
        self._recent = collections.deque(maxlen=recent)  # (in-sample, measured) falls
        self.matured = 0  # re-placements measured to the end of their window

    @property
    def ratio(self) -> float:
        """Measured over in-sample fall, summed over the ``recent`` last matured re-placements
        (1.0 before the first, or while their in-sample falls sum to <= 0; negative when they
        made things worse)."""
        forecast = sum(f for f, _ in self._recent)
        if forecast <= 0:
            return 1.0
        return sum(m for _, m in self._recent) / forecast

    def follow(
        self, layer: int, new: Placement, *, first: int, last: int, before: float, forecast_fall
    ) -> None:
        """Measure ``new`` on ``layer`` over steps ``first..last`` (the steps it runs) against
        ``before`` (the old table's per-step imbalance over the steps the decision saw) and its
        in-sample ``forecast_fall``."""
        if last < first:
            raise ValueError(f"last must be >= first, got first={first}, last={last}")
        followed = _Followed(layer, new, first, last, float(before), float(forecast_fall))
        self._followed.append(followed)

    def observe(self, step: int, counts: np.ndarray) -> None:
        """Score the followed re-placements on ``counts [L, E]`` of ``step``; retire those whose
        window ended (a re-placement none of whose steps was seen is dropped)."""
        going = []
        for f in self._followed:
            if f.first <= step <= f.last:
                f.after.append(f.new.imbalance(counts[f.layer]))
            if step < f.last:
                going.append(f)
            elif f.after:
                self.matured += 1
                self._recent.append((f.forecast_fall, f.before - float(np.mean(f.after))))
        self._followed = going

    def state_dict(self) -> dict:
        """JSON-serialisable state (``load_state_dict`` restores it exactly)."""
        return {
            "recent": [list(pair) for pair in self._recent],
            "matured": self.matured,
            "followed": [
                {
                    **{k: getattr(f, k) for k in ("layer", "first", "last", "before")},
                    "forecast_fall": f.forecast_fall,
                    "new": f.new.slot_to_expert.tolist(),
                    "after": list(f.after),
                }
                for f in self._followed
            ],
        }

    def load_state_dict(self, state: dict, placements: list[Placement]) -> None:
        """Restore ``state_dict()``; ``placements`` (one per layer) give the tables' shapes.

        A state written before measured falls were tracked (``forecast_sum``/``realized_sum``)
        becomes one aggregate entry, and its re-placements in flight are not followed further.
        """
        self.matured = int(state["matured"])
        self._recent.clear()
        self._followed = []
        if "recent" not in state:  # the older, cumulative format
            if self.matured:
                self._recent.append((float(state["forecast_sum"]), float(state["realized_sum"])))
            return
        self._recent.extend((float(f), float(m)) for f, m in state["recent"])
        for f in state["followed"]:
            like = placements[f["layer"]]
            self._followed.append(
                _Followed(
                    f["layer"],
                    like.with_table(np.asarray(f["new"], np.int64)),
                    f["first"],
                    f["last"],
                    f["before"],
                    f["forecast_fall"],
                    [float(x) for x in f["after"]],
                )
            )
