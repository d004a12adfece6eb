"""Offline replay of a run's routing trace through a placement controller, as training fed it.

Shape letters: ``L`` layers, ``E`` experts.

A placed training run writes ``placement_controller.json`` (``controller_spec``: the hardware
figures, the layer shape, the controller's knobs and the initial tables) beside its
``routing_trace.npy`` (``[steps, L, E]`` expert counts). ``controller_from_spec`` rebuilds that
controller, with knobs overridden if asked, and ``replay`` feeds it the trace the way the
training loop does: the counts of step ``t`` are observed after step ``t + apply_lag - 1`` and a
decision runs from step ``t + apply_lag`` on. Each step's device imbalance is the one its
layout gives on that step's counts, which is exactly what training measures (a step's loads are
``Placement.device_load`` of its counts), so with the run's own knobs the replay makes the run's
decisions, and with others it answers "what would this controller have done on this routing?"
(the routing itself would move slightly with a different layout, by float rounding only).

``event_record`` is the one format of a re-placement event, shared with the training loop's
``placement_events.jsonl``; ``moejax.training.placement_runtime.measured_effect`` and
``mean_fall`` analyse replayed and recorded events alike.

Plain numpy; no jax.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from moejax.placement.controller import ControllerConfig, Decision, PlacementController
from moejax.placement.cost_model import HardwareModel, Workload, step_cost
from moejax.placement.table import Placement

SPEC_FILE = "placement_controller.json"


def controller_spec(controller: PlacementController) -> dict:
    """JSON-serialisable description of ``controller`` as built (for ``controller_from_spec``).

    Args:
      controller: a ``PlacementController`` with the default planner.

    Returns:
      ``{"hardware", "workload", "config", "placements"}``: the first three as dataclass
      fields, the last a list of ``{"num_experts", "num_devices", "slots_per_device",
      "table"}`` per layer (the current tables: take it before the first observation).
    """
    return {
        "hardware": dataclasses.asdict(controller.hardware),
        "workload": dataclasses.asdict(controller.workload),
        "config": dataclasses.asdict(controller.config),
        "placements": [
            {
                "num_experts": p.num_experts,
                "num_devices": p.num_devices,
                "slots_per_device": p.slots_per_device,
                "table": p.slot_to_expert.tolist(),
            }
            for p in controller.placements
        ],
    }


def config_overrides(pairs: list[str]) -> dict:
    """``ControllerConfig`` overrides from ``KEY=VALUE`` strings (the scripts' ``--set``).

    Values are parsed as JSON where they are (``1``, ``0.5``, ``null``), else kept as strings.

    Raises:
      ValueError: a pair is not ``KEY=VALUE`` or names no ``ControllerConfig`` field.
    """
    fields = {f.name for f in dataclasses.fields(ControllerConfig)}
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        if key not in fields:
            raise ValueError(f"unknown ControllerConfig field {key!r}; known: {sorted(fields)}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def controller_from_spec(spec: dict, **overrides) -> PlacementController:
    """The controller ``spec`` describes, with ``ControllerConfig`` fields replaced by
    ``overrides`` (e.g. ``react_steps=1``).

    Raises:
      ValueError: an override names no ``ControllerConfig`` field (or has a bad value).
    """
    fields = {f.name for f in dataclasses.fields(ControllerConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown ControllerConfig fields {unknown}; known: {sorted(fields)}")
    config = ControllerConfig(**{**spec["config"], **overrides})
    placements = [
        Placement(
            np.asarray(p["table"], np.int64),
            p["num_experts"],
            p["num_devices"],
            p["slots_per_device"],
        )
        for p in spec["placements"]
    ]
    return PlacementController(
        placements, HardwareModel(**spec["hardware"]), Workload(**spec["workload"]), config
    )


def event_record(
    controller: PlacementController,
    decision: Decision,
    counts: np.ndarray,
    step: int,
    applied_after_step: int,
) -> dict:
    """One re-placement event, as ``placement_events.jsonl`` holds it (without wall times).

    Args:
      controller: the controller that accepted ``decision`` (just after its ``observe``).
      decision: the accepted decision.
      counts: ``[L, E]`` counts of ``step`` (used where the controller has no EMA yet).
      step: the step whose counts were observed.
      applied_after_step: the last step run on the old layout.

    Returns:
      A dict of JSON-serialisable figures: predicted gain, imbalance before/after on the EMA,
      per step over the forecast window and as forecast, bytes and modeled time of the
      migration, and the old and new tables.
    """
    smoothed = np.asarray(counts if controller.ema is None else controller.ema)[decision.layer]
    before, after = controller.forecast(decision.layer, decision.old, decision.new)
    now = step_cost(decision.old, smoothed, controller.hardware, controller.workload).total_s
    return {
        "step": int(step),
        "applied_after_step": int(applied_after_step),
        "layer": int(decision.layer),
        "reason": decision.reason,
        "predicted_gain_s": float(decision.gain_s),
        "predicted_gain_fraction": float(decision.gain_s / now) if now > 0 else None,
        "imbalance_before": float(decision.old.imbalance(smoothed)),
        "imbalance_after": float(decision.new.imbalance(smoothed)),
        "per_step_before": controller.per_step_imbalance(decision.layer, decision.old),
        "per_step_after": controller.per_step_imbalance(decision.layer, decision.new),
        "forecast_before": before,
        "forecast_after": after,
        "realized_ratio": controller.realized_ratio,
        "num_devices": int(decision.new.num_devices),
        "bytes_moved": int(decision.bytes_moved),
        "modeled_migration_s": float(decision.migration_s),
        "old": decision.old.slot_to_expert.tolist(),
        "new": decision.new.slot_to_expert.tolist(),
    }


@dataclasses.dataclass(frozen=True)
class Replay:
    """What ``replay`` saw.

    Attributes:
      records: per step (1-based ``step``): ``expert_counts`` ``[L][E]`` and
        ``device_imbalance`` ``[L]`` under the layouts that ran, as the training loop's
        ``metrics.jsonl`` records them.
      events: ``event_record`` of every accepted re-placement, in order.
      static_imbalance: ``[steps, L]`` imbalance the initial layouts would have given.
      placed_imbalance: ``[steps, L]`` imbalance of the layouts that ran.
    """

    records: list[dict]
    events: list[dict]
    static_imbalance: np.ndarray
    placed_imbalance: np.ndarray


def replay(controller: PlacementController, trace: np.ndarray) -> Replay:
    """Feeds ``trace`` to ``controller`` as the training loop does (module docstring).

    Args:
      controller: a fresh controller (``controller_from_spec``); it is advanced in place.
      trace: ``[steps, L, E]`` expert counts, row ``i`` being step ``i + 1``.

    Returns:
      A ``Replay``.

    Raises:
      ValueError: ``trace`` does not match the controller's layers and experts.
    """
    trace = np.asarray(trace, np.float64)
    layers = controller.num_layers
    experts = controller.placements[0].num_experts
    if trace.ndim != 3 or trace.shape[1:] != (layers, experts):
        raise ValueError(f"trace must have shape [steps, {layers}, {experts}], got {trace.shape}")
    lag = controller.config.apply_lag
    static = list(controller.placements)
    records, events = [], []
    static_imb = np.empty(trace.shape[:2])
    placed_imb = np.empty(trace.shape[:2])
    for i, counts in enumerate(trace):
        step = i + 1
        ran = list(controller.placements)  # the layouts step `step` runs on
        placed_imb[i] = [p.imbalance(c) for p, c in zip(ran, counts, strict=True)]
        static_imb[i] = [p.imbalance(c) for p, c in zip(static, counts, strict=True)]
        records.append(
            {
                "step": step,
                "expert_counts": counts.tolist(),
                "device_imbalance": placed_imb[i].tolist(),
            }
        )
        seen = step - lag + 1  # observed now, so that its decisions run from step seen + lag
        if seen >= 1:
            for d in controller.observe(seen, trace[seen - 1]):
                events.append(event_record(controller, d, trace[seen - 1], seen, step))
    return Replay(records, events, static_imb, placed_imb)
