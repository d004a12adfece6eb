"""What a placement controller's check yields, and the records the training loop writes of it.

A check of one layer is a ``Decision`` (accepted or declined, with the rule that decided,
``OUTCOMES``). The training loop writes every check as a line of ``placement_decisions.jsonl``
(``Decision.record``) and every accepted one as a line of ``placement_events.jsonl``
(``event_record``); ``moejax.placement.replay`` writes the same events when it replays a run's
routing trace offline.

Shape letters: ``L`` layers, ``E`` experts.

Plain numpy; no jax.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.placement.cost_model import step_cost
from moejax.placement.table import Placement


@dataclasses.dataclass(frozen=True)
class Decision:
    """One controller check of one layer.

    Attributes:
      step: training step of the last observed counts.
      layer: MoE layer index in ``[0, L)``.
      old: placement before the check.
      new: planner candidate (``old`` when the planner found nothing).
      gain_s: predicted per-step time saved by ``new`` on the EMA counts (seconds).
      bytes_moved: expert-state bytes the migration sends.
      migration_s: modeled migration time (seconds).
      accepted: whether the training loop should switch to ``new``.
      reason: why it was accepted or not.
      forecast_before, forecast_after: ``PlacementController.forecast`` of the candidate (per-step
        imbalance of ``old`` and, calibrated, of ``new``); None when the check stopped before
        the forecast (no candidate, or one the in-sample checks already declined).
      forecast_gain_s: ``PlacementController.forecast_gain``: the per-step gain the migration
        is weighed against (accepted only when > 0 and repaying it); None as the forecast.
      outcome: which rule decided, one of ``OUTCOMES`` (None from other controllers).
    """

    step: int
    layer: int
    old: Placement
    new: Placement
    gain_s: float
    bytes_moved: int
    migration_s: float
    accepted: bool
    reason: str
    forecast_before: float | None = None
    forecast_after: float | None = None
    forecast_gain_s: float | None = None
    outcome: str | None = None

    def record(self, applied_after_step: int) -> dict:
        """This check as a JSON-serialisable line of ``placement_decisions.jsonl``.

        Args:
          applied_after_step: the training step after which it was decided.

        Returns:
          ``step`` (of the counts checked), ``applied_after_step``, ``layer``, ``accepted``,
          ``outcome`` (``OUTCOMES``), ``reason``; ``candidate`` (the planner proposed another
          table) with its ``predicted_gain_s`` (in sample, on the EMA), ``forecast_gain_s`` and
          ``forecast_before/after`` (None where the check stopped before the forecast),
          ``modeled_migration_s`` and ``bytes_moved``.
        """
        figure = lambda x: None if x is None else float(x)  # noqa: E731
        return {
            "step": int(self.step),
            "applied_after_step": int(applied_after_step),
            "layer": int(self.layer),
            "accepted": bool(self.accepted),
            "outcome": self.outcome,
            "reason": self.reason,
            "candidate": self.new != self.old,
            "predicted_gain_s": float(self.gain_s),
            "forecast_gain_s": figure(self.forecast_gain_s),
            "forecast_before": figure(self.forecast_before),
            "forecast_after": figure(self.forecast_after),
            "modeled_migration_s": float(self.migration_s),
            "bytes_moved": int(self.bytes_moved),
        }


# `Decision.outcome`, in the order `PlacementController` checks them: accepted, or the rule that
# declined (min_interval, no rows routed to the layer, the re-plan trigger, no candidate, a gain
# below min_relative_gain, a gain not repaying the migration in sample, the forecast, the
# warm-up, patience).
OUTCOMES = (
    "accepted",
    "min_interval",
    "no_rows",
    "trigger",
    "no_candidate",
    "small_gain",
    "migration",
    "forecast",
    "warmup",
    "patience",
)


def event_record(
    decision: Decision,
    counts: np.ndarray,
    step: int,
    applied_after_step: int,
    controller=None,
) -> dict:
    """One re-placement, as a line of ``placement_events.jsonl`` (without wall times).

    Args:
      decision: the accepted decision.
      counts: ``[L, E]`` counts of ``step``.
      step: the step whose counts were observed.
      applied_after_step: the last step run on the old layout.
      controller: the ``PlacementController`` that accepted ``decision``, just after its
        ``observe``: the figures are then on its smoothed counts (``counts`` before its first
        EMA), with its per-step and calibrated forecasts. None (another controller, e.g. a
        scripted one): on ``counts``, the forecasts None.

    Returns:
      A dict of JSON-serialisable figures: predicted gain, imbalance before/after on the EMA,
      per step over the forecast window and as forecast, bytes and modeled time of the
      migration, and the old and new tables.
    """
    d, layer = decision, decision.layer
    per_step = forecast = (None, None)
    fraction = ratio = None
    smoothed = np.asarray(counts)[layer]
    if controller is not None:
        if controller.ema is not None:
            smoothed = controller.ema[layer]
        per_step = tuple(controller.per_step_imbalance(layer, p) for p in (d.old, d.new))
        forecast = controller.forecast(layer, d.old, d.new)
        now = step_cost(d.old, smoothed, controller.hardware, controller.workload).total_s
        fraction = float(d.gain_s / now) if now > 0 else None
        ratio = controller.realized_ratio
    return {
        "step": int(step),
        "applied_after_step": int(applied_after_step),
        "layer": int(layer),
        "reason": d.reason,
        "predicted_gain_s": float(d.gain_s),
        "predicted_gain_fraction": fraction,
        "imbalance_before": float(d.old.imbalance(smoothed)),
        "imbalance_after": float(d.new.imbalance(smoothed)),
        "per_step_before": per_step[0],
        "per_step_after": per_step[1],
        "forecast_before": forecast[0],
        "forecast_after": forecast[1],
        "realized_ratio": ratio,
        "num_devices": int(d.new.num_devices),
        "bytes_moved": int(d.bytes_moved),
        "modeled_migration_s": float(d.migration_s),
        "old": d.old.slot_to_expert.tolist(),
        "new": d.new.slot_to_expert.tolist(),
    }
