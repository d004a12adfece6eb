"""Host-side placement controller: watches routing counts, decides when to re-place experts.

Shape letters: ``L`` MoE layers, ``E`` experts, ``N`` devices, ``P`` slots.

The training loop calls ``observe(step, counts)`` with the per-layer expert counts ``[L, E]`` of
a step, read back one step late and asynchronously (the controller never touches device
arrays, never blocks on them, and never imports jax). The controller keeps an exponential moving
average of the counts per layer; every ``decide_every`` observed steps it checks each layer.
The planner runs only when the layer's modeled step time on the EMA (compute of the busiest
device, all-to-all and replica gradient sync), over the perfect-balance bound, exceeds
``(1 + min_relative_gain)`` times what the last plan left (1.0 at the start), so a settled
layer costs almost no host time (and replicas that only cost sync once routing moved on are
re-planned, though the imbalance did not rise). A change detector (``react_gain``,
``detector.py``) also tests every step, in O(P) per layer, whether the current placement is far
more imbalanced on the raw counts than the last plan left it and than on the EMA; confirmed
over ``react_steps`` steps, the layer's EMA is re-seeded from those steps' counts and the layer
is checked at once, so an abrupt routing shift is re-placed as soon as it is confirmed instead
of after the EMA catches up.

A candidate is accepted only when

* the predicted per-step gain (cost model, on the EMA counts) is at least
  ``min_relative_gain`` of the current predicted step time,
* the gain summed over ``horizon_steps`` exceeds the modeled migration time,
* the calibrated forecast (below) says it pays: its forecast gain per step
  (``forecast_gain``: the in-sample gain on each step of the forecast window, the part that
  depends on the routing scaled by ``realized_ratio`` as the forecast imbalance fall is) is
  positive and repays the migration over ``horizon_steps``,
* at least ``warmup_steps`` steps have been observed and ``min_calibration`` candidates
  measured (the forecast calibrated on the run's own routing; both 0 by default, training's
  controller sets 10 and 1),
* all of it held for ``patience`` consecutive checks (hysteresis; skipped when the gain is at
  least ``urgent_gain`` of the step time), and
* at least ``min_interval`` steps passed since this layer's last re-placement.

Every check is logged as a ``Decision`` (``decision.py``: accepted or declined, with the reason
and, for a candidate the forecast judged, its forecast). Accepted decisions are returned by
``observe``; the training loop applies them and logs every check (``Decision.record``) and every
re-placement (``decision.event_record``). ``spec`` describes the controller as built, in
``SPEC_FILE`` beside a training run, and ``from_spec`` rebuilds it (``replay.py``).

Forecasts (``forecast``): the imbalance a re-placement will measure step by step. The planner's
candidate is scored on the steps it was planned on, which overstates its fall when routing drifts
(on the tiny LM, about 2x: BENCHMARKS.md, "Placement in training"). So the controller follows
every candidate the forecast judged, applied or not, over the ``forecast_window``
steps it runs or would have run (from ``apply_lag`` steps after its last counts), measures its
fall as the logs will (the old table's per-step imbalance before against the new one's after),
and scales new forecasts by the measured over the in-sample fall of the ``calibration_events``
last measured candidates (``realized_ratio``): an online calibration from the run's own
routing, with nothing fitted offline. A declined candidate is measured exactly as if it had run:
a layout's device loads on a step are a function of that step's counts, and the routing does not
depend on the layout. Following the declined ones too keeps the calibration learning while the
forecast declines everything (a ratio that turned negative would otherwise never recover).

Applying a decision (done by the JAX side): the physical expert weights of a layer are
``w_phys = w[new.slot_to_expert]`` with shape ``[P, ...]``, slot ``p`` on device ``p // S``;
optimizer state is gathered the same way (or kept per logical expert ``[E, ...]`` and only the
``[P, ...]`` copies re-gathered). Tokens routed to expert ``e`` are split evenly over
``new.replicas_of(e)`` (``Placement.slot_rows``); replica gradients are summed back per expert
before the optimizer update, so the math is unchanged (in ``moejax.training``: local duplicates
on their device, experts held on several devices in one packed all-reduce over the expert axis,
which ``Workload(replica_sync="packed")`` charges).
In ``moejax.training`` the slot tables are arguments of the compiled step, so a new table needs
no recompilation (``moejax.training.placement_runtime``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import numpy as np

from moejax.placement.cost_model import (
    HardwareModel,
    Workload,
    migration_bytes,
    migration_s,
    perfect_cost,
    replica_sync_s,
)
from moejax.placement.cost_model import step_cost as _step_cost
from moejax.placement.decision import Decision
from moejax.placement.detector import ChangeDetector
from moejax.placement.planner import plan as _plan
from moejax.placement.realized import FallTracker
from moejax.placement.table import Placement
from moejax.records import record_from_json, record_to_json


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """Controller knobs.

    Attributes:
      decide_every: observed steps between planner calls.
      ema_decay: weight of the old average per observation (window ~ 1 / (1 - decay) steps).
      horizon_steps: steps over which a re-placement must repay its migration time.
      min_relative_gain: smallest predicted per-step gain, as a fraction of the current step
        time, that counts as an improvement (noise guard).
      patience: consecutive passing checks required before accepting a marginal gain.
      urgent_gain: a predicted gain of at least this fraction of the step time is accepted at
        the first passing check (noise does not produce such gains; waiting would cost more).
      min_interval: fewest steps between two re-placements of one layer.
      max_moves: move budget handed to the planner (None: the planner's default).
      forecast_window: raw per-step counts kept for ``per_step_imbalance`` (the prediction
        of the imbalance a layout will measure step by step); by default about the EMA's
        effective window (``(1 + decay) / (1 - decay)`` = 9 steps at 0.8), the steps the
        decision saw.
      react_gain: change detector (None: off). A layer whose current placement is more than
        ``1 + react_gain`` times as imbalanced on the raw counts of each of ``react_steps``
        consecutive steps as the last plan left it, and as on the EMA before those steps, is
        checked at once, off the ``decide_every`` schedule, with its EMA re-seeded from the
        mean of those steps' counts (so an abrupt routing shift is not fitted on a lagging
        average; a router drifting at the EMA's pace stays with the schedule). An O(P) test per
        layer and step; per-step noise moves a device's load by a few percent, far below it.
      react_steps: consecutive shifted steps that confirm a change (a one-step spike does not).
      react_urgent: None (default), or a shift of more than ``1 + react_urgent`` times that base
        on a single step's counts confirms a change at once, without waiting for
        ``react_steps`` steps. Opt-in: it reacts a step sooner to an abrupt routing shift (the
        simulator's rotating hot set: BENCHMARKS.md), and so also to a one-step spike that
        large, whose layout then stays for ``min_interval`` steps.
      apply_lag: steps from the last counts a decision saw to the first step that runs its
        layout; the training loop reads counts one step late and migrates after the next step
        (2). Only where the controller follows a re-placement's measured fall
        (``realized_ratio``) depends on it.
      calibration_events: the most recent measured candidates whose falls calibrate the
        forecast (``realized_ratio``, ``realized.FallTracker``), which gates decisions.
      warmup_steps: observed steps in which checks accept nothing; they still plan, forecast
        and follow their candidates, so the calibration learns from the first steps (training
        sets 10: an untrained router's routing moves fastest in the first steps, and on the tiny
        LM a re-placement decided on the first two steps' counts measured a rise of the
        imbalance).
      min_calibration: candidates that must have been measured (``realized.matured``) before a
        check may accept; 0: the first decisions may rest on the uncalibrated forecast
        (``realized_ratio`` 1.0). Training sets 1: never apply a layout on a forecast the run's
        own routing has not calibrated.
    """

    decide_every: int = 5
    ema_decay: float = 0.8
    horizon_steps: int = 200
    min_relative_gain: float = 0.05
    patience: int = 2
    urgent_gain: float = 0.25
    min_interval: int = 10
    max_moves: int | None = None
    forecast_window: int = 10
    react_gain: float | None = 0.25
    react_steps: int = 2
    react_urgent: float | None = None
    calibration_events: int = 5
    apply_lag: int = 2
    warmup_steps: int = 0
    min_calibration: int = 0

    def __post_init__(self):
        names = ("decide_every", "horizon_steps", "patience", "forecast_window", "react_steps")
        for name in (*names, "apply_lag", "calibration_events"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("min_interval", "warmup_steps", "min_calibration"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must lie in [0, 1), got {self.ema_decay!r}")
        if self.urgent_gain < self.min_relative_gain:
            raise ValueError(
                f"urgent_gain must be >= min_relative_gain={self.min_relative_gain}, "
                f"got {self.urgent_gain!r}"
            )
        if self.react_gain is not None and not self.react_gain > 0:
            raise ValueError(f"react_gain must be > 0 or None, got {self.react_gain!r}")
        if self.react_urgent is not None and not self.react_urgent > (self.react_gain or 0.0):
            raise ValueError(
                f"react_urgent must be None or > react_gain={self.react_gain}, "
                f"got {self.react_urgent!r}"
            )
        if self.min_relative_gain < 0:
            raise ValueError(f"min_relative_gain must be >= 0, got {self.min_relative_gain!r}")


SPEC_FILE = "placement_controller.json"  # a training run's controller ``spec``, in its run dir
_SHAPE = ("num_experts", "num_devices", "slots_per_device")


class PlacementController:
    """Decides per-layer re-placements from asynchronously observed expert counts.

    Args:
      placements: the initial placement of each of the ``L`` layers (or one, for ``L = 1``).
      hardware: hardware figures for the cost model.
      workload: layer shape for the cost model.
      config: thresholds and intervals.
      planner: ``(placement, counts [E], max_moves=) -> Placement``; default ``plan`` given
        ``hardware`` and ``workload`` (weighing replica gradient sync against balance).

    >>> p = Placement.identity(num_experts=4, num_devices=2, slots_per_device=3)
    >>> from moejax.placement.cost_model import H100_NVLINK, Workload
    >>> ctl = PlacementController(p, H100_NVLINK, Workload(), ControllerConfig(decide_every=1,
    ...     patience=1, min_interval=0))
    >>> [d.accepted for d in ctl.observe(0, np.array([9000, 100, 400, 500]))]
    [True]
    """

    def __init__(
        self,
        placements: Placement | Sequence[Placement],
        hardware: HardwareModel,
        workload: Workload,
        config: ControllerConfig = ControllerConfig(),
        planner: Callable[..., Placement] | None = None,
    ):
        self._default_planner = planner is None
        if planner is None:
            planner = functools.partial(_plan, hardware=hardware, workload=workload)
        if isinstance(placements, Placement):
            placements = [placements]
        self.placements: list[Placement] = list(placements)  # [L] current placements
        if not self.placements:
            raise ValueError("placements must hold at least one layer, got 0")
        self.hardware, self.workload, self.config, self.planner = (
            hardware,
            workload,
            config,
            planner,
        )
        num_layers = len(self.placements)
        self.log: list[Decision] = []
        self.decision_wall_s = 0.0  # host time spent in checks (planner + cost model)
        self.migration_s = 0.0  # modeled migration time of accepted decisions
        self.bytes_moved = 0
        self._ema: np.ndarray | None = None  # [L, E] float64
        self._recent = collections.deque(maxlen=config.forecast_window)  # of [L, E] raw counts
        self._since_check = 0
        self._observed = 0  # steps observed (warmup_steps)
        # Per layer, the observed steps before this many are not in its forecast window: the
        # routing changed then (the change detector).
        self._window_start = [0] * num_layers
        self._streak = [0] * num_layers
        self._last_change = [None] * num_layers
        self._settled = [1.0] * num_layers  # imbalance left by the last plan of each layer
        self._settled_cost = [1.0] * num_layers  # its modeled step over the perfect bound
        self._detector = ChangeDetector(
            num_layers, config.react_gain, config.react_steps, config.react_urgent
        )
        # Accepted re-placements, followed over the steps after them.
        self.realized = FallTracker(config.calibration_events)

    def spec(self) -> dict:
        """JSON-serialisable description of this controller as built (``from_spec``).

        Returns:
          ``{"hardware", "workload", "config", "placements"}``: the first three as dataclass
          fields, the last a list of ``{"num_experts", "num_devices", "slots_per_device",
          "table"}`` per layer (the current tables: take it before the first observation).
        """
        return {
            "hardware": record_to_json(self.hardware),
            "workload": record_to_json(self.workload),
            "config": record_to_json(self.config),
            "placements": [
                {
                    "num_experts": p.num_experts,
                    "num_devices": p.num_devices,
                    "slots_per_device": p.slots_per_device,
                    "table": p.slot_to_expert.tolist(),
                }
                for p in self.placements
            ],
        }

    @classmethod
    def from_spec(cls, spec: dict, **overrides) -> PlacementController:
        """The controller ``spec`` describes (with the default planner), ``ControllerConfig``
        fields replaced by ``overrides`` (e.g. ``react_steps=1``).

        Raises:
          ValueError: an override names no ``ControllerConfig`` field (or has a bad value).
        """
        fields = {f.name for f in dataclasses.fields(ControllerConfig)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown ControllerConfig fields {unknown}; known: {sorted(fields)}")
        placements = [
            Placement(np.asarray(p["table"], np.int64), *(p[k] for k in _SHAPE))
            for p in spec["placements"]
        ]
        config = record_from_json(ControllerConfig, spec["config"])
        config = dataclasses.replace(config, **overrides)
        hardware = record_from_json(HardwareModel, spec["hardware"])
        return cls(placements, hardware, record_from_json(Workload, spec["workload"]), config)

    @property
    def num_layers(self) -> int:
        return len(self.placements)

    @property
    def accepted(self) -> list[Decision]:
        """Accepted decisions (re-placements), oldest first."""
        return [d for d in self.log if d.accepted]

    @property
    def ema(self) -> np.ndarray | None:
        """``[L, E]`` smoothed counts, or None before the first observation."""
        return None if self._ema is None else self._ema.copy()

    def per_step_imbalance(self, layer: int, placement: Placement) -> float:
        """Predicted per-step imbalance of ``placement`` for ``layer``: the mean, over the last
        ``forecast_window`` observed steps, of its imbalance on each step's own counts.

        After a routing change the change detector confirmed, the window holds the steps since
        the change only (as the EMA is re-seeded from them).

        Decisions use the EMA, which smooths per-step noise away; every real step sees that
        noise, and the busiest device is a maximum, so a step's imbalance is on average above
        the imbalance of the averaged counts. This is the figure to compare with the
        imbalance measured step by step after a re-placement, assuming routing stays as it
        was over the window (a drifting router makes the measured one higher). On the steps
        the planner fitted, it is optimistic for the planner's candidate (which fits their
        noise) and pessimistic for the old layout (checks fire on bad excursions, which
        revert): on the tiny LM's training runs this in-sample fall was about twice the
        measured one (BENCHMARKS.md, "Placement in training"); ``forecast`` calibrates it.
        """
        return float(np.mean([placement.imbalance(c) for c in self._window(layer)]))

    def _window(self, layer: int) -> list[np.ndarray]:
        """``layer``'s ``[E]`` counts of the steps its forecasts rest on, oldest first."""
        if not self._recent:
            raise ValueError("per_step_imbalance needs at least one observed step")
        # After a confirmed routing change, only the steps since (at least one is kept).
        keep = max(1, min(len(self._recent), self._observed - self._window_start[layer]))
        return [c[layer] for c in list(self._recent)[-keep:]]

    @property
    def realized_ratio(self) -> float:
        """Measured over in-sample imbalance fall of the last ``calibration_events``
        candidates (applied or not) measured to the end of their window
        (``FallTracker.ratio``; 1.0 before the first)."""
        return self.realized.ratio

    def forecast(self, layer: int, old: Placement, new: Placement) -> tuple[float, float]:
        """Forecast per-step imbalance of ``layer`` over the steps after replacing ``old`` by
        ``new``: ``(before, after)``.

        ``before`` is ``old``'s mean per-step imbalance over the last ``forecast_window``
        steps; the in-sample fall ``before - per_step_imbalance(layer, new)`` is scaled by
        ``realized_ratio``, the share of such falls that this run's last candidates measured
        on the steps after them (routing drifts away from the steps a plan fitted).
        """
        before, after = self.per_step_imbalance(layer, old), self.per_step_imbalance(layer, new)
        # after + (1 - r) fall, not before - r fall: exactly the in-sample figure while r = 1.
        return before, after + (1.0 - self.realized_ratio) * (before - after)

    def forecast_gain(self, layer: int, old: Placement, new: Placement) -> float:
        """Forecast modeled seconds per step that replacing ``old`` by ``new`` saves on
        ``layer``: what the acceptance of a candidate is weighed on.

        The part that depends on the routing (compute of the busiest device and all-to-all,
        ``step_cost`` on each step of the forecast window, in sample) is scaled by
        ``realized_ratio``, as ``forecast`` scales the imbalance fall; the replica gradient sync
        a layout pays does not depend on the routing and counts in full. So a layout that drops
        replicas whose sync costs more than the balance they buy can pay although its imbalance
        rises, and a balance gain that the run's last candidates did not measure does not pay.
        """
        hw, wl = self.hardware, self.workload

        def routed(placement, counts):
            cost = _step_cost(placement, counts, hw, wl)
            return cost.compute_s + cost.all_to_all_s

        balance = float(np.mean([routed(old, n) - routed(new, n) for n in self._window(layer)]))
        sync = replica_sync_s(old, hw, wl) - replica_sync_s(new, hw, wl)
        return self.realized_ratio * balance + (1.0 - wl.replica_sync_overlap) * sync

    def observe(self, step: int, counts: np.ndarray) -> list[Decision]:
        """Feeds the expert counts of ``step``; returns the decisions accepted now.

        Args:
          step: the training step the counts belong to (may lag the current step).
          counts: ``[L, E]`` (or ``[E]`` when ``L = 1``) rows routed to each expert, a host
            numpy array.

        Returns:
          Accepted ``Decision``s (at most one per layer); the caller applies each
          ``decision.new`` to ``decision.layer``.
        """
        counts = np.asarray(counts, np.float64)
        if counts.ndim == 1:
            counts = counts[None]
        expected = (self.num_layers, self.placements[0].num_experts)
        if counts.shape != expected:
            raise ValueError(f"counts must have shape [L, E] = {expected}, got {counts.shape}")
        if not np.all(np.isfinite(counts)) or np.any(counts < 0):
            raise ValueError("counts must be finite and >= 0")
        self._recent.append(counts)
        self._observed += 1
        start = time.perf_counter()
        self.realized.observe(step, counts)
        # {layer: the confirmed streak's counts [n, E]}, against the EMA so far
        shifts = self._detector.update(self.placements, counts, self._ema, self._settled)
        decay = self.config.ema_decay
        self._ema = counts.copy() if self._ema is None else decay * self._ema + (1 - decay) * counts
        for layer, streak in shifts.items():
            # The routing changed: the EMA and the forecast window start with the streak.
            self._ema[layer] = streak.mean(axis=0)
            self._window_start[layer] = self._observed - len(streak)
        layers = list(shifts)  # checked now, off schedule
        self._since_check += 1
        if self._since_check >= self.config.decide_every:
            self._since_check = 0
            layers = range(self.num_layers)
        elif not layers:
            self.decision_wall_s += time.perf_counter() - start
            return []
        decisions = [self._check(step, layer) for layer in layers]
        self.decision_wall_s += time.perf_counter() - start
        self.log.extend(decisions)
        for d in decisions:
            if d.forecast_before is not None:  # judged by the forecast: measured, run or not
                first = step + self.config.apply_lag
                before = self.per_step_imbalance(d.layer, d.old)
                fall = before - self.per_step_imbalance(d.layer, d.new)
                last = first + self.config.forecast_window - 1
                self.realized.follow(
                    d.layer, d.new, first=first, last=last, before=before, forecast_fall=fall
                )
        accepted = [d for d in decisions if d.accepted]
        for d in accepted:
            self.placements[d.layer] = d.new
            self.migration_s += d.migration_s
            self.bytes_moved += d.bytes_moved
            self._last_change[d.layer] = step
            self._detector.reset(d.layer)
        return accepted

    def state_dict(self) -> dict:
        """The controller's state as JSON-serialisable data, for checkpoints.

        Everything later decisions depend on: the hardware figures, current tables, EMA, the
        forecast window, the check schedule, per-layer streaks, last re-placement steps and
        settled figures, the change detector's streaks and the followed re-placements, and the
        modeled migration totals. Not the decision ``log`` (history: the training loop keeps
        an event file) nor ``decision_wall_s`` (host time of this process). ``load_state_dict``
        of it in a controller built with the same config makes the same decisions from then
        on.
        """
        return {
            "hardware": record_to_json(self.hardware),
            "tables": [p.slot_to_expert.tolist() for p in self.placements],
            "ema": None if self._ema is None else self._ema.tolist(),
            "recent": [c.tolist() for c in self._recent],
            "since_check": self._since_check,
            "observed": self._observed,
            "window_start": list(self._window_start),
            "streak": list(self._streak),
            "last_change": list(self._last_change),
            "settled": list(self._settled),
            "settled_cost": list(self._settled_cost),
            **self._detector.state_dict(),  # "shifted", "shift_base"
            "realized": self.realized.state_dict(),
            "migration_s": self.migration_s,
            "bytes_moved": self.bytes_moved,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` (of a controller with the same layers, experts and slots).

        Raises:
          ValueError: the state is for another number of layers or placement shape.
        """
        tables = [np.asarray(t, np.int64) for t in state["tables"]]
        shapes = [t.shape for t in tables]
        want = [(p.num_slots,) for p in self.placements]
        if shapes != want:
            raise ValueError(f"controller state holds tables of shapes {shapes}, expected {want}")
        self.placements = [p.with_table(t) for p, t in zip(self.placements, tables, strict=True)]
        # The figures decided on so far (a measured model would be timed anew on resume).
        self.hardware = record_from_json(HardwareModel, state["hardware"])
        if self._default_planner:
            self.planner = functools.partial(_plan, hardware=self.hardware, workload=self.workload)
        self._ema = None if state["ema"] is None else np.asarray(state["ema"], np.float64)
        self._recent.clear()
        self._recent.extend(np.asarray(c, np.float64) for c in state["recent"])
        self._since_check = int(state["since_check"])
        # A state written before the warm-up existed is of a run long past it.
        self._observed = int(state.get("observed", self.config.warmup_steps))
        self._window_start = [int(x) for x in state.get("window_start", [0] * self.num_layers)]
        self._streak = [int(x) for x in state["streak"]]
        self._last_change = list(state["last_change"])
        self._settled = [float(x) for x in state["settled"]]
        self._settled_cost = [float(x) for x in state["settled_cost"]]
        self._detector.load_state_dict(state)
        self.realized.load_state_dict(state["realized"], self.placements)
        self.migration_s = float(state["migration_s"])
        self.bytes_moved = int(state["bytes_moved"])

    def _check(self, step: int, layer: int) -> Decision:
        cfg, hw, wl = self.config, self.hardware, self.workload
        old, ema = self.placements[layer], self._ema[layer]
        last = self._last_change[layer]
        record = dict(step=step, layer=layer, old=old, new=old, gain_s=0.0)
        record.update(bytes_moved=0, migration_s=0.0)

        def decline(outcome: str, reason: str) -> Decision:
            self._streak[layer] = 0
            return Decision(**record, accepted=False, reason=reason, outcome=outcome)

        if last is not None and step - last < cfg.min_interval:
            return decline(
                "min_interval", f"min_interval: {step - last} < {cfg.min_interval} steps"
            )
        perfect = perfect_cost(ema, old.num_devices, hw, wl).total_s
        if not perfect > 0:  # no rows routed to this layer (yet): nothing to balance
            return decline("no_rows", "no rows routed to this layer: nothing to balance")
        imbalance = old.imbalance(ema)
        now = _step_cost(old, ema, hw, wl).total_s
        over = now / perfect
        floor = self._settled_cost[layer] * (1.0 + cfg.min_relative_gain)
        if over < floor:
            # Cheap trigger: the planner only runs once the modeled step (replica sync
            # included) degraded noticeably, relative to the perfect-balance bound, since the
            # last plan for this layer, which keeps host time small.
            return decline(
                "trigger", f"modeled step {over:.3f}x perfect, below re-plan trigger {floor:.3f}"
            )
        new = self.planner(old, ema, max_moves=cfg.max_moves)
        if new == old:
            self._settled[layer], self._settled_cost[layer] = imbalance, over
            return decline("no_candidate", "planner found no better placement")
        gain = now - _step_cost(new, ema, hw, wl).total_s
        move_s = migration_s(old, new, hw, wl)
        record.update(
            new=new, gain_s=gain, bytes_moved=migration_bytes(old, new, wl), migration_s=move_s
        )
        if gain < cfg.min_relative_gain * now:
            self._settled[layer], self._settled_cost[layer] = imbalance, over
            return decline(
                "small_gain",
                f"gain {gain / now:.1%} of step < min_relative_gain {cfg.min_relative_gain}",
            )
        horizon = cfg.horizon_steps
        if gain * horizon <= move_s:
            return decline(
                "migration",
                f"gain over {horizon} steps {gain * horizon:.3g}s <= migration {move_s:.3g}s",
            )
        # The forecast's verdict: what the run's own candidates say survives of the in-sample
        # figures. Never apply a layout it says does not pay (observe follows it either way).
        before, after = self.forecast(layer, old, new)
        expected = self.forecast_gain(layer, old, new)
        record.update(forecast_before=before, forecast_after=after, forecast_gain_s=expected)
        forecast = (
            f"forecast per-step imbalance {before:.3f} -> {after:.3f} (realized ratio "
            f"{self.realized_ratio:.2f})"
        )
        if expected <= 0:
            return decline(
                "forecast", f"{forecast}: forecast gain {expected / now:.1%} of step does not pay"
            )
        if expected * horizon <= move_s:
            return decline(
                "forecast",
                f"{forecast}: forecast gain over {horizon} steps {expected * horizon:.3g}s "
                f"<= migration {move_s:.3g}s",
            )
        if self._observed < cfg.warmup_steps:
            return decline(
                "warmup",
                f"{forecast}: warm-up, {self._observed} of {cfg.warmup_steps} steps observed",
            )
        if self.realized.matured < cfg.min_calibration:
            return decline(
                "warmup",
                f"{forecast}: forecast not calibrated yet, {self.realized.matured} of "
                f"{cfg.min_calibration} candidates measured",
            )
        self._streak[layer] += 1
        if self._streak[layer] < cfg.patience and gain < cfg.urgent_gain * now:
            return Decision(
                **record,
                accepted=False,
                reason=f"patience {self._streak[layer]}/{cfg.patience}",
                outcome="patience",
            )
        self._streak[layer] = 0
        self._settled[layer] = new.imbalance(ema)
        self._settled_cost[layer] = over * (now - gain) / now
        reason = (
            f"{forecast}: forecast gain {expected / now:.1%} of step (in sample {gain / now:.1%}) "
            f"repays migration {move_s:.3g}s in {move_s / expected:.3g} steps"
        )
        return Decision(**record, accepted=True, reason=reason, outcome="accepted")
