"""Dynamic expert placement (after FlexMoE): placement tables, cost model, planner, controller.

Plain Python over numpy: nothing here imports jax or touches device arrays, so the controller
runs on the host beside the training loop and is testable without a device.

Shape letters (docs/design.md): ``L`` layers, ``E`` experts, ``N`` devices, ``S`` slots per
device, ``P = N·S`` physical slots.

>>> import numpy as np
>>> from moejax import placement
>>> p = placement.Placement.identity(num_experts=8, num_devices=4, slots_per_device=3)
>>> q = placement.plan(p, np.array([400.0, 10, 10, 10, 10, 10, 10, 10]))
>>> q.imbalance(np.array([400.0, 10, 10, 10, 10, 10, 10, 10])) < p.imbalance(
...     np.array([400.0, 10, 10, 10, 10, 10, 10, 10]))
True
"""

from moejax.placement._packing import apportion as apportion
from moejax.placement._packing import greedy_pack as greedy_pack
from moejax.placement._packing import pack as pack
from moejax.placement._packing import pack_by_group as pack_by_group
from moejax.placement._packing import replica_counts as replica_counts
from moejax.placement.controller import ControllerConfig as ControllerConfig
from moejax.placement.controller import PlacementController as PlacementController
from moejax.placement.cost_model import H100_IB as H100_IB
from moejax.placement.cost_model import H100_NVLINK as H100_NVLINK
from moejax.placement.cost_model import TPU_V5P_ICI as TPU_V5P_ICI
from moejax.placement.cost_model import HardwareModel as HardwareModel
from moejax.placement.cost_model import StepCost as StepCost
from moejax.placement.cost_model import Workload as Workload
from moejax.placement.cost_model import copies_needed as copies_needed
from moejax.placement.cost_model import migration_bytes as migration_bytes
from moejax.placement.cost_model import migration_s as migration_s
from moejax.placement.cost_model import perfect_cost as perfect_cost
from moejax.placement.cost_model import step_cost as step_cost
from moejax.placement.decision import Decision as Decision
from moejax.placement.planner import plan as plan
from moejax.placement.table import Placement as Placement
from moejax.placement.table import migration_sources as migration_sources
from moejax.placement.traces import balanced as balanced
from moejax.placement.traces import drifting_zipf as drifting_zipf
from moejax.placement.traces import load_trace as load_trace
from moejax.placement.traces import save_trace as save_trace
from moejax.placement.traces import synthetic_traces as synthetic_traces
from moejax.placement.traces import zipf as zipf

__all__ = [
    "H100_IB",
    "H100_NVLINK",
    "TPU_V5P_ICI",
    "ControllerConfig",
    "Decision",
    "HardwareModel",
    "Placement",
    "PlacementController",
    "StepCost",
    "Workload",
    "apportion",
    "balanced",
    "copies_needed",
    "drifting_zipf",
    "greedy_pack",
    "load_trace",
    "migration_bytes",
    "migration_s",
    "migration_sources",
    "pack",
    "pack_by_group",
    "perfect_cost",
    "plan",
    "replica_counts",
    "save_trace",
    "step_cost",
    "synthetic_traces",
    "zipf",
]
