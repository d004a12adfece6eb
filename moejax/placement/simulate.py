"""Replays routing traces through the cost model to compare placement strategies.

Shape letters: ``L`` layers, ``E`` experts, ``N`` devices, ``S`` slots per device.

Strategies, all with the same ``S`` slots per device (the same expert memory):

* ``static``: ``Placement.identity`` (expert ``e`` on device ``e // (E/N)``), never changed.
* ``shadowing``: FasterMoE-style; each step, from the previous step's counts, the ``k`` hottest
  experts are replicated on every device in the spare slots. Their tokens stay local, but every
  step pays a broadcast of their parameters and a reduction of their gradients (its own
  figure; ``step_cost``'s replica sync is not charged on top).
* ``controller``: ``PlacementController`` fed the counts one step late (its default planner
  weighs replica sync against balance); accepted re-placements take effect at
  the next step and pay their modeled migration time, and every step pays the replica gradient
  sync of its placements (in ``step_cost``).
* ``perfect``: the perfect-balance bound (``total rows / N`` on every device, no replicas).

Modeled time is the sum over steps and layers of ``step_cost`` plus migration/sync time.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.placement.controller import ControllerConfig, PlacementController
from moejax.placement.cost_model import (
    HardwareModel,
    Workload,
    perfect_cost,
    step_cost,
)
from moejax.placement.table import Placement


@dataclasses.dataclass(frozen=True)
class MethodResult:
    """Modeled outcome of one strategy on one trace.

    Attributes:
      name: strategy name.
      step_s: ``[steps]`` modeled step time summed over layers (seconds), excluding migration,
        including the replica gradient sync of ``step_cost``.
      migration_s: modeled time spent moving experts (or syncing shadowed experts).
      decision_wall_s: measured host wall time of the controller's checks.
      replacements: accepted re-placements (summed over layers).
      replica_sync_s: the part of ``step_s`` spent combining the gradients of experts
        replicated across devices (``StepCost.replica_sync_s``), summed over steps and layers
        (0 for shadowing, whose per-step sync is its ``migration_s``).
    """

    name: str
    step_s: np.ndarray
    migration_s: float = 0.0
    decision_wall_s: float = 0.0
    replacements: int = 0
    replica_sync_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Modeled time of the whole trace, migration included."""
        return float(self.step_s.sum()) + self.migration_s

    @property
    def overhead_fraction(self) -> float:
        """(decision wall time + migration time) / total modeled time (0 when both are 0, inf
        when only the modeled time is: a trace without rows)."""
        return _ratio(self.decision_wall_s + self.migration_s, self.total_s, 0.0)


def _ratio(a: float, b: float, empty: float) -> float:
    """`a / b`; `empty` when both are 0 (a trace without rows models no time at all), inf when
    only `b` is."""
    if b > 0:
        return a / b
    return empty if a == 0 else float("inf")


def _layer_costs(trace: np.ndarray, placements: list[Placement], hw, wl) -> list:
    """``StepCost`` of each layer's placement for its counts ``trace [L, E]``."""
    return [step_cost(p, c, hw, wl) for p, c in zip(placements, trace, strict=True)]


def run_static(trace: np.ndarray, placement: Placement, hw: HardwareModel, wl: Workload):
    """Static placement on every layer. ``trace``: ``[steps, L, E]``. Returns a MethodResult."""
    costs = [_layer_costs(c, [placement] * len(c), hw, wl) for c in trace]
    steps = np.array([sum(c.total_s for c in layers) for layers in costs])
    sync = sum(c.replica_sync_s for layers in costs for c in layers)  # 0 without spare slots
    return MethodResult("static", steps, replica_sync_s=sync)


def run_perfect(trace: np.ndarray, num_devices: int, hw: HardwareModel, wl: Workload):
    """Perfect-balance bound. ``trace``: ``[steps, L, E]``. Returns a MethodResult."""
    steps = np.array(
        [sum(perfect_cost(c, num_devices, hw, wl).total_s for c in layers) for layers in trace]
    )
    return MethodResult("perfect", steps)  # no replicas: no sync


def shadow_placement(base: Placement, counts: np.ndarray, k: int) -> Placement:
    """``base`` (an identity placement) with the ``k`` hottest experts in every device's spare
    slots (slot ``j >= E/N`` of each device). ``counts``: ``[E]``."""
    home = base.num_experts // base.num_devices
    if not 0 <= k <= base.slots_per_device - home:
        raise ValueError(f"k must lie in [0, {base.slots_per_device - home}], got {k}")
    table = base.device_table().copy()  # [N, S]
    hot = np.argsort(-np.asarray(counts), kind="stable")[:k]
    table[:, home : home + k] = hot[None, :]
    return base.with_table(table.reshape(-1))


def run_shadowing(trace, base: Placement, hw: HardwareModel, wl: Workload, k: int = 1):
    """FasterMoE-style shadowing of the ``k`` hottest experts (decided from the previous step).

    Args:
      trace: ``[steps, L, E]`` counts.
      base: identity placement with at least ``k`` spare slots per device.
      hw: hardware figures.
      wl: layer shape.
      k: experts shadowed per layer and step.

    Returns:
      A MethodResult; ``migration_s`` holds the per-step parameter broadcast + gradient reduction.
    """
    steps, num_layers = trace.shape[0], trace.shape[1]
    # Each device receives k experts' bf16 params and sends k experts' gradients every step.
    sync_bytes = 2.0 * k * wl.expert_params * wl.param_bytes
    sync_s = float(hw.transfer_s(sync_bytes, base.num_devices)) * num_layers
    step_s = np.empty(steps)
    for t in range(steps):
        previous = trace[max(t - 1, 0)]
        placements = [shadow_placement(base, previous[layer], k) for layer in range(num_layers)]
        costs = _layer_costs(trace[t], placements, hw, wl)
        step_s[t] = sum(c.compute_s + c.all_to_all_s for c in costs)  # sync: below
    return MethodResult("shadowing", step_s, migration_s=sync_s * steps if k else 0.0)


def run_controller(
    trace,
    base: Placement,
    hw: HardwareModel,
    wl: Workload,
    config: ControllerConfig | None = None,
):
    """Our controller, fed each step's counts one step late, planning with replica sync weighed.

    Args:
      trace: ``[steps, L, E]`` counts.
      base: initial placement of every layer.
      hw: hardware figures.
      wl: layer shape.
      config: controller thresholds (default ``ControllerConfig()``).

    Returns:
      A MethodResult with the controller's migration and decision bookkeeping.
    """
    config = ControllerConfig() if config is None else config
    config = dataclasses.replace(config, apply_lag=1)  # counts of step t - 1 run at step t
    ctl = PlacementController([base] * trace.shape[1], hw, wl, config)
    step_s = np.empty(trace.shape[0])
    sync_s = 0.0
    for t in range(trace.shape[0]):
        if t > 0:
            ctl.observe(t - 1, trace[t - 1])  # read one step late; applies from step t on
        costs = _layer_costs(trace[t], ctl.placements, hw, wl)
        step_s[t] = sum(c.total_s for c in costs)
        sync_s += sum(c.replica_sync_s for c in costs)
    return MethodResult(
        "controller",
        step_s,
        migration_s=ctl.migration_s,
        decision_wall_s=ctl.decision_wall_s,
        replacements=len(ctl.accepted),
        replica_sync_s=sync_s,
    )


def compare(
    trace: np.ndarray,
    num_devices: int,
    slots_per_device: int,
    hw: HardwareModel,
    wl: Workload,
    config: ControllerConfig | None = None,
    shadow_k: int | None = None,
) -> dict[str, MethodResult]:
    """Runs every strategy on one trace.

    Args:
      trace: ``[steps, L, E]`` counts, ``E`` a multiple of ``num_devices``.
      num_devices: ``N``.
      slots_per_device: ``S`` (>= ``E/N``); the spare ``S - E/N`` slots per device are what
        shadowing and the controller may use.
      hw: hardware figures.
      wl: layer shape.
      config: controller thresholds (default ``ControllerConfig()``).
      shadow_k: experts shadowed (default: all spare slots).

    Returns:
      ``{name: MethodResult}`` for static, shadowing, controller and perfect.
    """
    base = Placement.identity(trace.shape[2], num_devices, slots_per_device)
    spare = slots_per_device - trace.shape[2] // num_devices
    return {
        "static": run_static(trace, base, hw, wl),
        "shadowing": run_shadowing(trace, base, hw, wl, spare if shadow_k is None else shadow_k),
        "controller": run_controller(trace, base, hw, wl, config),
        "perfect": run_perfect(trace, num_devices, hw, wl),
    }


def summarize(results: dict[str, MethodResult]) -> list[dict]:
    """One row per strategy: mean step ms, speedup vs static, gap to perfect, overhead (host
    decision + migration) and its migration-only part, as fractions of the modeled time, and
    the measured host decision time in seconds; ``replica_sync``: replica gradient combination
    as a fraction of the modeled time (included in it, see ``MethodResult``). A trace without
    any rows models no time: a method that models none either is then 1.0x static, 0 from
    perfect, 0 overhead (one that does, e.g. shadowing's sync: 0x static, inf from perfect)."""
    static, perfect = results["static"].total_s, results["perfect"].total_s
    rows = []
    for name, r in results.items():
        rows.append(
            dict(
                method=name,
                step_ms=1e3 * _ratio(r.total_s, len(r.step_s), 0.0),
                speedup=_ratio(static, r.total_s, 1.0),
                gap=_ratio(r.total_s, perfect, 1.0) - 1.0,
                overhead=r.overhead_fraction,
                migration=_ratio(r.migration_s, r.total_s, 0.0),
                host_s=r.decision_wall_s,
                replica_sync=_ratio(r.replica_sync_s, r.total_s, 0.0),
                replacements=r.replacements,
            )
        )
    return rows
