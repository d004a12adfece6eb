"""Offline replay of a run's routing trace through a placement controller, as training fed it.

Shape letters: ``L`` layers, ``E`` experts.

A placed training run writes ``placement_controller.json`` (``PlacementController.spec``: the
hardware figures, the layer shape, the controller's knobs and the initial tables) beside its
``routing_trace.npy`` (``[steps, L, E]`` expert counts). ``PlacementController.from_spec``
rebuilds that controller, with knobs overridden if asked (``config_overrides``), and ``replay``
feeds it the trace the way the training loop does: the counts of step ``t`` are observed after
step ``t + apply_lag - 1`` and a decision runs from step ``t + apply_lag`` on. Each step's
device imbalance is the one its layout gives on that step's counts, which is exactly what
training measures (a step's loads are ``Placement.device_load`` of its counts), so with the
run's own knobs the replay makes the run's decisions, and with others it answers "what would
this controller have done on this routing?" (the routing itself would move slightly with a
different layout, by float rounding only).

Its events are the training loop's (``decision.event_record``, as ``placement_events.jsonl``
holds them); ``moejax.training.placement_runtime.measured_effect`` and ``mean_fall`` analyse
replayed and recorded events alike.

Plain numpy; no jax.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from moejax.placement.controller import ControllerConfig, PlacementController
from moejax.placement.decision import event_record


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
      controller: a fresh controller (``PlacementController.from_spec``); it is advanced in
        place.
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
                events.append(event_record(d, trace[seen - 1], seen, step, controller))
    return Replay(records, events, static_imb, placed_imb)
