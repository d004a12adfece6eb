"""The training loop's side of dynamic expert placement: tables, controller, migrations, events.

`PlacementRuntime` holds the current placement of every MoE layer, hands the step its slot
tables, feeds the controller the expert counts the loop fetched one step late, applies accepted
decisions by gathering the expert parameters and Adam moments into the new slots, and logs every
re-placement (`placement_events.jsonl`, one JSON object per event):

- `step`: the step whose counts triggered it (the controller sees counts one step late);
  `applied_after_step`: the state after this step is migrated, so steps after it run on the
  new layout;
- `layer`, `old`, `new` (`slot_to_expert` tables), `reason`;
- predicted by the cost model on the controller's smoothed counts: `predicted_gain_s` (per
  step), `predicted_gain_fraction` (of the modeled step), `imbalance_before`, `imbalance_after`
  (busiest device over the mean), `modeled_migration_s`, `bytes_moved` (parameters and
  optimizer state, at the cost model's byte sizes);
- forecast per step: `per_step_before/after` (old and new table on the steps planned on, in
  sample), `forecast_before/after` (the same fall scaled by `realized_ratio`, the share of
  the in-sample fall the run's last re-placements measured: `PlacementController.forecast`);
- measured: `migration_wall_s` (the gathers of this step's moved layers on this machine,
  timed alone; events of one step share it) and
  `decision_wall_s` (host time of the controller's checks so far).

Every check of the controller, accepted or declined, is a line of `placement_decisions.jsonl`
(`moejax.placement.Decision.record`: the step, the layer, the outcome and the reason, and for a
candidate its predicted and forecast gain, its forecast imbalance and the migration it would
cost), so a layer that was never re-placed says why. Both formats are the controller's
(`moejax.placement.decision`).

A run with a `PlacementController` also writes `placement_controller.json` at its start
(`PlacementController.spec`), from which `experiments/replay_placement.py` replays its
`routing_trace.npy` through the same controller, or one with other knobs.

With several processes (`jax.distributed`) only process 0's controller observes and decides:
each step it shares what it decided (every check's record and every accepted re-placement, as
JSON: `moejax.training.agree.from_process_0`, through the coordination service) and every
process applies exactly those tables and logs the same records in memory (process 0 writes the
files); the controller's `"measured"` hardware figures are process 0's too
(`placed.measure_hardware`). Each process's own: `migration_wall_s`, and in `summary` the
measured falls (from the metrics records, which process 0 keeps).

Each layer's migration gather takes its index as an argument (`moejax.training.placed.migrate_fn`)
and donates the state, so it compiles once per layer, in a background thread at start, while
training goes on, and writes only the moved layer; the step never recompiles for a new layout
(its slot tables are arguments too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.placement import Placement, PlacementController, migration_sources
from moejax.placement.controller import SPEC_FILE
from moejax.placement.decision import event_record
from moejax.records import record_to_json
from moejax.training import placed
from moejax.training.agree import from_process_0

# With several processes, the key of the decisions shared this many observations back is
# deleted; each step's collectives keep every process within two observations of process 0.
_KEEP = 8
EVENTS_FILE = "placement_events.jsonl"
DECISIONS_FILE = "placement_decisions.jsonl"


@dataclasses.dataclass
class PlacementRuntime:
    """See the module docstring; built by `start`."""

    enabled: bool
    placements: tuple  # [Lm] current `moejax.placement.Placement`s
    controller: object | None = None
    model_cfg: object = None
    train_cfg: object = None
    mesh: object = None
    events: list = dataclasses.field(default_factory=list)
    decisions: list = dataclasses.field(default_factory=list)  # `Decision.record`s of this run
    migration_wall_s: float = 0.0
    decision_wall_s: float = 0.0  # the controller's host time (process 0's), `decide`'s
    _slot_tables: tuple = ()
    _events_path: str | None = None
    _decisions_path: str | None = None
    _logged: int = 0  # the controller's log entries written so far
    _compile: threading.Thread | None = None
    _migrate: object = None
    _unobserved: tuple | None = None  # (step, counts [Lm, E]) saved unobserved by a checkpoint

    @classmethod
    def start(
        cls, state, placements, controller, model_cfg, train_cfg, mesh, run_dir, resumed=None
    ):
        """Set up for a run starting from the logical `state`; returns `(runtime, state)`, the
        state to train on (physical when placement is enabled).

        Args:
          state: the initial or restored `TrainState` (experts in logical order).
          placements: the placement of every MoE layer (`placed.initial_placements` or resumed).
          controller: None, or a factory `placements -> controller`; needs
            `train_cfg.expert_slots_per_device > 0`.
          model_cfg, train_cfg, mesh: the run's.
          run_dir: where to write `placement_events.jsonl` (None: not written, e.g. on processes
            other than 0).
          resumed: the checkpoint's `checkpoint_state` when `placements` are its tables: the
            controller continues from its state, as if the run had not stopped (None: a fresh
            controller).
        """
        enabled = train_cfg.expert_slots_per_device > 0
        if controller is not None and not enabled:
            raise ValueError(
                "a placement controller needs TrainConfig.expert_slots_per_device > 0 "
                "(slots for the replicas), got 0"
            )
        runtime = cls(
            enabled=enabled,
            placements=tuple(placements),
            model_cfg=model_cfg,
            train_cfg=train_cfg,
            mesh=mesh,
        )
        if not enabled:
            return runtime, state
        step = int(jax.device_get(state.step))
        state = placed.to_physical(state, placements, model_cfg, train_cfg, mesh)
        runtime._slot_tables = placed.slot_tables(placements)
        if controller is not None:
            runtime.controller = controller(list(placements))
            if resumed is not None and hasattr(runtime.controller, "load_state_dict"):
                runtime.controller.load_state_dict(resumed["controller"])
                if resumed["unobserved_step"] is not None:
                    counts = np.asarray(resumed["unobserved_counts"], np.float64)
                    runtime._unobserved = (resumed["unobserved_step"], counts)
            runtime.decision_wall_s = float(getattr(runtime.controller, "decision_wall_s", 0.0))
            runtime._start_compile(state)
            if run_dir is not None:
                if resumed is None and isinstance(runtime.controller, PlacementController):
                    # What `moejax.placement.replay` needs to replay this run's routing trace.
                    with open(os.path.join(run_dir, SPEC_FILE), "w") as f:
                        json.dump(runtime.controller.spec(), f)
                runtime._events_path = os.path.join(run_dir, EVENTS_FILE)
                runtime._decisions_path = os.path.join(run_dir, DECISIONS_FILE)
                # Events after a resumed step are re-made by this run; earlier ones are kept.
                runtime.events = _keep(runtime._events_path, step)
                runtime.decisions = _keep(runtime._decisions_path, step)
        return runtime, state

    @property
    def step_args(self) -> tuple:
        """Extra arguments of the jitted step: `(slot_tables,)` with placement, else `()`."""
        return (self._slot_tables,) if self.enabled else ()

    def logical(self, state):
        """`state` with experts in logical order (what checkpoints hold)."""
        if not self.enabled:
            return state
        return placed.to_logical(state, self.placements, self.model_cfg, self.train_cfg, self.mesh)

    def observe(self, state, step: int, counts: np.ndarray, applied_after_step: int):
        """Feed step `step`'s expert counts `[Lm, E]` to the controller; apply its decisions to
        `state` (the state after `applied_after_step`). Returns the state to train on."""
        if self.controller is None:
            return state
        decided = self._decide(step, counts, applied_after_step)
        decided = from_process_0("placement/decisions", decided, keep=_KEEP)
        self.decision_wall_s = decided["decision_wall_s"]
        for record in decided["checks"]:  # every check, accepted or declined
            self.decisions.append(record)
            _append(self._decisions_path, record)
        if not decided["events"]:
            return state
        new = list(self.placements)
        migrate = self._migrators()
        jax.block_until_ready(state)  # time the migration alone, not the step before it
        t0 = time.perf_counter()
        for event in decided["events"]:  # one donated gather per moved layer
            layer, old = event["layer"], new[event["layer"]]
            table = Placement(np.asarray(event["new"], np.int64), old.num_experts,
                              old.num_devices, old.slots_per_device)  # fmt: skip
            sources = migration_sources(old, table)[None]
            state = migrate[layer](state, jnp.asarray(sources, jnp.int32))
            new[layer] = table
        state = jax.block_until_ready(state)
        wall = time.perf_counter() - t0
        self.migration_wall_s += wall
        self.placements = tuple(new)
        self._slot_tables = placed.slot_tables(new)
        for event in decided["events"]:
            self._log({**event, "migration_wall_s": wall})
        return state

    def _decide(self, step: int, counts, applied_after_step: int) -> dict | None:
        """What the controller decides on step `step`'s counts, as JSON: `checks` (the
        `Decision.record` of every check), `events` (`event_record` of each accepted one, without
        the migration's wall time) and `decision_wall_s` (its host time so far). With several
        processes only process 0 runs the controller (None elsewhere: `observe` shares process
        0's), so every process applies the same re-placements."""
        if jax.process_index() != 0:
            return None
        decisions = self.controller.observe(step, np.asarray(counts))
        log = getattr(self.controller, "log", [])
        checks = [d.record(applied_after_step) for d in log[self._logged :]]
        self._logged = len(log)
        # A scripted controller (tests) has no forecasts: its events are on the step's counts.
        ctl = self.controller if isinstance(self.controller, PlacementController) else None
        decision_wall_s = float(getattr(self.controller, "decision_wall_s", 0.0))
        events = [
            {**event_record(d, counts, step, applied_after_step, ctl),
             "decision_wall_s": decision_wall_s}
            for d in decisions
        ]  # fmt: skip
        return {"checks": checks, "events": events, "decision_wall_s": decision_wall_s}

    def take_unobserved(self) -> tuple | None:
        """`(step, counts)` a resumed checkpoint saved before the controller saw them, once
        (the loop feeds them where the stopped run would have: after the first step)."""
        out, self._unobserved = self._unobserved, None
        return out

    def checkpoint_state(self, unobserved: tuple | None) -> dict | None:
        """The controller's state for a checkpoint (None without a controller that has one).

        Args:
          unobserved: `(step, counts [Lm, E])` of the step the loop fetched but has not fed to
            the controller yet (counts arrive one step late), or None.
        """
        if not hasattr(self.controller, "state_dict") or jax.process_index() != 0:
            return None  # (processes other than 0 do not run theirs; 0 writes the metadata)
        step, counts = unobserved if unobserved is not None else (None, None)
        return {
            "controller": self.controller.state_dict(),
            "unobserved_step": step,
            "unobserved_counts": None if counts is None else np.asarray(counts).tolist(),
        }

    def close(self) -> None:
        if self._compile is not None:
            self._compile.join()

    def summary(self, wall_s: float, records: list[dict] | None = None) -> dict | None:
        """Re-placements, the controller's host overhead and, given the run's per-step
        `records`, the mean predicted vs measured imbalance fall per event (None without a
        controller)."""
        if self.controller is None:
            return None
        decide = self.decision_wall_s
        overhead = decide + self.migration_wall_s
        hw = getattr(self.controller, "hardware", None)
        walls = {e["applied_after_step"]: e["migration_wall_s"] for e in self.events}
        return {
            "hardware": None if hw is None else record_to_json(hw),
            "platform": None if self.mesh is None else self.mesh.devices.flat[0].platform,
            "replacements": len(self.events),
            # Migrations as priced by the cost model and as timed here (one gather per step).
            "modeled_migration_s": float(sum(e["modeled_migration_s"] for e in self.events)),
            "measured_migration_s": float(sum(walls.values())),
            "decision_wall_s": decide,
            "migration_wall_s": self.migration_wall_s,
            "overhead_fraction": overhead / wall_s if wall_s > 0 else None,
            **check_summary(self.decisions, len(self.placements)),
            **mean_fall(measured_effect(records or [], self.events)),
        }

    # -- internals ----------------------------------------------------------------------------

    def _start_compile(self, state) -> None:
        """Compile each layer's migration gather (`[1, P]` sources) in the background."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        index = jax.ShapeDtypeStruct((1, self.placements[0].num_slots), jnp.int32)
        fns = [
            placed.migrate_fn(self.model_cfg, self.train_cfg, self.mesh, j)
            for j in range(len(self.placements))
        ]

        def compile_():
            self._migrate = [fn.lower(abstract, index).compile() for fn in fns]

        self._compile = threading.Thread(target=compile_, name="compile-migration", daemon=True)
        self._compile.start()

    def _migrators(self) -> list:
        self._compile.join()  # normally long done: it started with the run
        return self._migrate

    def _log(self, event: dict) -> None:
        self.events.append(event)
        _append(self._events_path, event)


def _keep(path: str, up_to_step: int) -> list[dict]:
    """Rewrite the JSON-lines file `path` with its records applied after steps up to
    `up_to_step` (a resumed run re-makes the later ones); returns them."""
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            kept = [json.loads(line) for line in f if line.strip()]
        kept = [e for e in kept if e["applied_after_step"] <= up_to_step]
    with open(path, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in kept)
    return kept


def _append(path: str | None, record: dict) -> None:
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def check_summary(decisions: list[dict], num_layers: int) -> dict:
    """What `placement_decisions.jsonl` records say in sum: `checks`, `{outcome: count}` of
    every check, and `never_replaced`, for each layer no check accepted, its last check's
    `{layer, step, outcome, reason}` (why it stayed). Empty without records."""
    if not decisions:
        return {}
    checks: dict[str, int] = {}
    for d in decisions:
        checks[d["outcome"]] = checks.get(d["outcome"], 0) + 1
    last = {d["layer"]: d for d in decisions}  # the last check of each layer
    moved = {d["layer"] for d in decisions if d["accepted"]}
    never = [
        {k: last[j][k] for k in ("layer", "step", "outcome", "reason")}
        for j in range(num_layers)
        if j not in moved and j in last
    ]
    return {"checks": checks, "never_replaced": never}


def read_events(run_dir: str) -> list[dict]:
    """The events of `run_dir/placement_events.jsonl` ([] if none)."""
    path = os.path.join(run_dir, EVENTS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def measured_effect(records: list[dict], events: list[dict], window: int = 10) -> list[dict]:
    """Per event: the predicted imbalance change next to the measured one.

    Measured: the mean device-load imbalance of the event's layer over the `window` steps up to
    `applied_after_step` (old layout) and the `window` steps after it (new layout), from the
    per-step records (each step's counts under the placement it ran with). Also, on the same
    `window` steps after the event: `counterfactual_before`, the old layout's imbalance on
    those steps' own counts (the device loads the old table would have given; the runtime's
    loads are exactly `Placement.device_load` of the step's counts), so `counterfactual_before
    - measured_after` is the fall caused by the re-placement alone, with the routing drift of
    the before/after comparison taken out.

    Predicted: `predicted_before/after` on the controller's EMA (what it decided on),
    `per_step_before/after`, the mean per-step imbalance over its forecast window
    (`PlacementController.per_step_imbalance`, in sample) and `forecast_before/after`, the
    calibrated forecast (`PlacementController.forecast`); None for controllers without them.
    """
    by_step = {r["step"]: r for r in records}
    rows = []
    for e in events:
        t, layer = e["applied_after_step"], e["layer"]
        after = [by_step[s] for s in range(t + 1, t + window + 1) if s in by_step]

        def mean(steps, layer=layer):
            vals = [
                by_step[s]["device_imbalance"][layer]
                for s in steps
                if s in by_step and by_step[s]["device_imbalance"][layer] is not None
            ]
            return float(np.mean(vals)) if vals else None

        counterfactual = None
        if "num_devices" in e and after and all("expert_counts" in r for r in after):
            old = _placement(e["old"], e["num_devices"], len(after[0]["expert_counts"][layer]))
            counterfactual = float(
                np.mean([old.imbalance(np.asarray(r["expert_counts"][layer])) for r in after])
            )
        rows.append(
            {
                "applied_after_step": t,
                "layer": layer,
                "predicted_before": e["imbalance_before"],
                "predicted_after": e["imbalance_after"],
                "per_step_before": e.get("per_step_before"),
                "per_step_after": e.get("per_step_after"),
                "forecast_before": e.get("forecast_before"),
                "forecast_after": e.get("forecast_after"),
                "measured_before": mean(range(t - window + 1, t + 1)),
                "measured_after": mean(range(t + 1, t + window + 1)),
                "counterfactual_before": counterfactual,
            }
        )
    return rows


def mean_fall(rows: list[dict]) -> dict:
    """Mean imbalance fall per event over `measured_effect` rows that have every figure:
    `predicted_fall` (the controller's calibrated forecast), `in_sample_fall` (the per-step
    forecast on the steps planned on), `measured_fall` (window before -> after) and
    `counterfactual_fall` (old -> new table on the same steps after); `fall_events` counts
    the rows used. Empty when no row qualifies."""
    keys = (
        "forecast_before",
        "forecast_after",
        "per_step_before",
        "per_step_after",
        "measured_before",
        "measured_after",
        "counterfactual_before",
    )
    rows = [r for r in rows if all(r.get(k) is not None for k in keys)]
    if not rows:
        return {}

    def fall(before, after):
        return float(np.mean([r[before] - r[after] for r in rows]))

    return {
        "fall_events": len(rows),
        "predicted_fall": fall("forecast_before", "forecast_after"),
        "in_sample_fall": fall("per_step_before", "per_step_after"),
        "measured_fall": fall("measured_before", "measured_after"),
        "counterfactual_fall": fall("counterfactual_before", "measured_after"),
    }


def _placement(table: list[int], num_devices: int, num_experts: int) -> Placement:
    return Placement(
        np.asarray(table, np.int64), num_experts, num_devices, len(table) // num_devices
    )
