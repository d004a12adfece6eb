"""Analytic cost model: predicted MoE-layer step time of a placement for observed expert counts.

Shape letters: ``E`` experts, ``N`` devices, ``P`` slots, ``D`` d_model, ``F`` d_ff, ``T`` tokens
per device, ``K`` top-k.

One layer's step (forward + backward) is modeled as

* compute: the busiest device's rows x ``flops_per_row`` / device FLOP/s (peak, so a lower bound);
* all-to-all: ``passes`` exchanges (dispatch + combine, forward + backward) of ``D``-wide rows;
  each device's time is ``max(rows sent, rows received)`` x ``D`` x bytes / link bandwidth, split
  between the in-node and the cross-node link, and the slowest device sets the time; with
  expert groups (``Workload.num_groups > 1``) on hardware with nodes, the cross-node part counts
  one copy per token and destination node instead (``step_cost``, ``groups.py``);
* replica gradient sync: the gradients of an expert replicated on several devices are combined
  every step (``replica_sync_s``), as ``Workload.replica_sync`` says: ``"holders"``, a ring
  all-reduce among each expert's holders (over the in-node link when they share a node, else
  over the cross-node link); ``"packed"``, what ``moejax.training`` runs: one ring all-reduce
  over all ``N`` devices of a buffer sized by the number of experts held on two devices or
  more. The part not hidden behind the backward pass (``Workload.replica_sync_overlap``,
  default none) is charged;
* no overlap between compute and all-to-all (the Lancet overlap is modeled elsewhere; placement
  only changes how big each part is).

Token sources are assumed uniform over devices: each device produces ``total/N`` rows, and the
rows of an expert that has a replica on the source device stay there (``n_e/N`` per device
holding ``e``). Migration from placement A to B sends one copy of an expert's parameters and
optimizer state to every slot whose new expert was not already on that device.

Plain numpy; no jax.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax import hardware
from moejax.placement.groups import cross_node_copies
from moejax.placement.table import Placement, check_counts


@dataclasses.dataclass(frozen=True)
class HardwareModel:
    """Per-device compute and interconnect figures.

    Attributes:
      name: label used in tables.
      flops_per_s: dense bf16 peak FLOP/s of one device.
      link_bytes_per_s: bytes/s per device per direction on the link used between nodes (or
        between all devices when ``devices_per_node == 1``).
      devices_per_node: devices sharing the faster in-node link (1: one flat network).
      node_link_bytes_per_s: bytes/s per device per direction inside a node (ignored when
        ``devices_per_node == 1``).
    """

    name: str
    flops_per_s: float
    link_bytes_per_s: float
    devices_per_node: int = 1
    node_link_bytes_per_s: float = 0.0

    def __post_init__(self):
        for field in ("flops_per_s", "link_bytes_per_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)!r}")
        if self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node!r}")
        if self.devices_per_node > 1 and not self.node_link_bytes_per_s > 0:
            raise ValueError(
                f"node_link_bytes_per_s must be > 0 when devices_per_node > 1, "
                f"got {self.node_link_bytes_per_s!r}"
            )

    def transfer_s(self, nbytes: np.ndarray, num_devices: int) -> np.ndarray:
        """Seconds for each device to move ``nbytes`` spread uniformly over its ``N - 1`` peers."""
        nbytes = np.asarray(nbytes, np.float64)
        group = min(self.devices_per_node, num_devices)
        if group <= 1 or num_devices <= 1:
            return nbytes / self.link_bytes_per_s
        in_node = (group - 1) / (num_devices - 1)
        return np.maximum(
            nbytes * in_node / self.node_link_bytes_per_s,
            nbytes * (1.0 - in_node) / self.link_bytes_per_s,
        )


def hardware_model(device: hardware.Device, name: str, *, nodes: bool) -> HardwareModel:
    """The cost model's view of a `moejax.hardware.Device`: its dense bf16 FLOP/s and links.

    Args:
      device: a row of the device table.
      name: the view's label.
      nodes: model nodes of `device.node_size` devices joined by the network; False: one flat
        domain at the in-node link (exact for one 8-GPU node, optimistic for a large TPU slice,
        whose torus bisection is not modelled).
    """
    if nodes and device.node_size > 1:
        return HardwareModel(
            name,
            flops_per_s=device.peak("bf16"),
            link_bytes_per_s=device.network_bytes_per_s,
            devices_per_node=device.node_size,
            node_link_bytes_per_s=device.link_bytes_per_s,
        )
    return HardwareModel(name, device.peak("bf16"), device.link_bytes_per_s)


# Datasheet figures and their sources: `moejax.hardware`.
H100_NVLINK = hardware_model(hardware.H100_SXM, "h100-nvlink", nodes=False)
H100_IB = hardware_model(hardware.H100_SXM, "h100-ib", nodes=True)
TPU_V5P_ICI = hardware_model(hardware.TPU_V5P, "tpu-v5p-ici", nodes=False)


REPLICA_SYNC = ("holders", "packed")


@dataclasses.dataclass(frozen=True)
class Workload:
    """Shape of one MoE layer's expert work, per device and per step.

    Attributes:
      tokens_per_device: ``T`` tokens each device routes per step.
      top_k: ``K`` experts per token.
      d_model: ``D``.
      d_ff: ``F`` of one expert.
      matmuls_per_expert: weight matrices of ``D x F`` per expert (3 for SwiGLU).
      activation_bytes: bytes per exchanged activation element (2 for bf16).
      param_bytes: bytes per parameter as used in the step (2 for bf16).
      state_bytes_per_param: bytes per parameter moved on migration: bf16 params (2) + fp32
        master copy (4) + Adam moments (8) = 14.
      all_to_all_passes: exchanges per step (dispatch + combine, forward + backward = 4).
      replica_sync_overlap: fraction in ``[0, 1]`` of the replica gradient all-reduce hidden
        behind the rest of the backward pass (0: none hidden, the honest upper bound; the
        gradients of an expert are ready only after its backward GEMMs, so the real figure
        depends on the schedule).
      num_groups: expert groups of group-limited routing (``MoEConfig.num_groups``; group
        ``j`` is experts ``j·E/num_groups ..``, ``groups.py``); 1: no groups. With groups and
        nodes, ``step_cost`` charges cross-node traffic per destination node
        (``groups.cross_node_copies``) and ``planner.plan`` keeps each group on few nodes.
      topk_groups: groups each token keeps (``MoEConfig.topk_groups``), ``<= num_groups``.
      replica_sync: how replica gradients are combined (``replica_sync_s``): ``"holders"``
        (each replicated expert all-reduced among the devices holding it: the simulator's
        model of an ideal implementation) or ``"packed"`` (``moejax.training``'s step: one
        all-reduce over the whole expert axis of ``packed_sync_gradients`` expert gradients).
    """

    tokens_per_device: int = 8192
    top_k: int = 8
    d_model: int = 4096
    d_ff: int = 2048
    matmuls_per_expert: int = 3
    activation_bytes: int = 2
    param_bytes: int = 2
    state_bytes_per_param: int = 14
    all_to_all_passes: int = 4
    replica_sync_overlap: float = 0.0
    num_groups: int = 1
    topk_groups: int = 1
    replica_sync: str = "holders"

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.name in ("replica_sync_overlap", "replica_sync"):
                continue
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field.name} must be a positive int, got {value!r}")
        if not 0.0 <= self.replica_sync_overlap <= 1.0:
            raise ValueError(
                f"replica_sync_overlap must lie in [0, 1], got {self.replica_sync_overlap!r}"
            )
        if self.topk_groups > self.num_groups:
            raise ValueError(
                f"topk_groups must be <= num_groups={self.num_groups}, got {self.topk_groups!r}"
            )
        if self.replica_sync not in REPLICA_SYNC:
            raise ValueError(
                f"replica_sync must be one of {REPLICA_SYNC}, got {self.replica_sync!r}"
            )

    @property
    def picks_per_group(self) -> float:
        """``c = max(1, K / topk_groups)``: experts a token picks in each group it reaches (with
        ``K < topk_groups`` a token reaches ``K`` groups at most, one expert in each)."""
        return max(1.0, self.top_k / self.topk_groups)

    @property
    def expert_params(self) -> int:
        """Parameters of one expert."""
        return self.matmuls_per_expert * self.d_model * self.d_ff

    @property
    def flops_per_row(self) -> float:
        """Forward + backward FLOPs of one routed row (backward = 2x forward)."""
        return 3.0 * 2.0 * self.expert_params

    @property
    def expert_state_bytes(self) -> int:
        """Bytes sent to migrate one expert copy (parameters + optimizer state)."""
        return self.expert_params * self.state_bytes_per_param

    @property
    def rows_per_step(self) -> int:
        """Rows routed per device per step, ``T·K``."""
        return self.tokens_per_device * self.top_k

    @property
    def expert_grad_bytes(self) -> int:
        """Bytes of one expert's gradient as combined across replicas (``param_bytes`` each)."""
        return self.expert_params * self.param_bytes


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Modeled time of one layer step, in seconds.

    Attributes:
      compute_s: the busiest device's expert FLOPs (forward + backward) at peak.
      all_to_all_s: dispatch + combine exchanges, forward + backward.
      replica_sync_s: the exposed part of the per-step all-reduce of the gradients of experts
        replicated across devices (``replica_sync_s``); 0 without such replicas.
    """

    compute_s: float
    all_to_all_s: float
    replica_sync_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Step time: the three parts one after the other (each set by its slowest device)."""
        return self.compute_s + self.all_to_all_s + self.replica_sync_s


def _a2a_s(load, local, total, num_devices, hw, wl, copies=None) -> float:
    sent = total / num_devices - local  # [N]
    received = load - local  # [N]
    row_bytes = wl.d_model * wl.activation_bytes
    nbytes = np.maximum(sent, received) * row_bytes
    if copies is None:
        return float(wl.all_to_all_passes * hw.transfer_s(nbytes, num_devices).max())
    # Groups: every row leaving or entering a device crosses the in-node link once; token
    # copies cross nodes once per destination node (``groups.cross_node_copies``), each node's
    # devices sharing its copies, sent (the mean, sources uniform) or received.
    g = hw.devices_per_node
    cross = np.repeat(np.maximum(copies, copies.mean()) / g, g) * row_bytes  # [N]
    seconds = np.maximum(nbytes / hw.node_link_bytes_per_s, cross / hw.link_bytes_per_s)
    return float(wl.all_to_all_passes * seconds.max())


def has_group_nodes(num_devices: int, hw: HardwareModel, wl: Workload) -> bool:
    """Whether groups shape the traffic: ``wl.num_groups > 1`` and ``N`` splits into two or
    more nodes of ``hw.devices_per_node > 1`` devices."""
    g = hw.devices_per_node
    return wl.num_groups > 1 and 1 < g < num_devices and num_devices % g == 0


def step_cost(
    placement: Placement, counts: np.ndarray, hw: HardwareModel, wl: Workload
) -> StepCost:
    """Modeled compute + all-to-all + exposed replica gradient sync of one layer step.

    With expert groups (``wl.num_groups > 1``) on hardware with nodes (``has_group_nodes``),
    the all-to-all is node-deduplicated, as DeepSeek-V3 dispatches: per pass, a device's time
    is ``max(b_d / B_node, (max(X_m, mean X) / G) · D · bytes / B_link)``, where ``b_d`` is the
    bytes of its rows that leave or enter it (each crosses the in-node link once: directly, or
    forwarded inside the destination node) and ``X_m`` the token copies its node ``m``
    receives from other nodes (``groups.cross_node_copies``: ``(1 - 1/M) · sum_j T_j · (1 -
    (1 - p_jm)^c)``, which grows as group ``j``'s rows spread over more nodes). Without groups,
    rows go uniformly to every device (``HardwareModel.transfer_s``).

    Args:
      placement: the layer's placement (``N`` devices, ``P`` slots).
      counts: ``[E]`` rows routed to each expert in this step, summed over all devices.
      hw: hardware figures.
      wl: layer shape.

    Returns:
      The ``StepCost``.
    """
    counts = np.asarray(check_counts(counts, placement.num_experts), np.float64)
    n = placement.num_devices
    load = placement.device_load(counts)  # [N]
    keys = placement.device_expert_keys()
    e = placement.num_experts
    # [N] rows whose source device holds a replica of their expert stay local.
    local = np.bincount(keys // e, weights=counts[keys % e], minlength=n) / n
    compute = float(load.max()) * wl.flops_per_row / hw.flops_per_s
    sync = (1.0 - wl.replica_sync_overlap) * replica_sync_s(placement, hw, wl)
    copies = None
    if has_group_nodes(n, hw, wl):
        copies = cross_node_copies(
            placement, counts, wl.num_groups, wl.picks_per_group, hw.devices_per_node
        )
    return StepCost(compute, _a2a_s(load, local, counts.sum(), n, hw, wl, copies), sync)


def rows_per_gradient(hw: HardwareModel, wl: Workload, num_devices: int) -> float:
    """Rows of the busiest device worth one expert gradient sent in the replica all-reduce.

    The planner balances rows; this converts replica gradient sync into rows so that it can
    weigh both: a device sending ``x`` expert gradients (``x = sum 2 (d_e - 1) / d_e`` over the
    replicated experts it holds, ``replica_sync_s``) costs as much as ``x`` times this many
    extra rows on the busiest device, whose time per row is its compute plus the all-to-all of
    receiving the row (the receiving side sets the busiest device's exchange time).

    Args:
      hw: hardware figures.
      wl: layer shape.
      num_devices: ``N``.

    Returns:
      Rows per exposed expert gradient (0.0 when the sync is fully overlapped).
    """
    per_byte = float(hw.transfer_s(1.0, num_devices))  # transfer time is linear in bytes
    packed = wl.replica_sync == "packed"  # the gradient goes round the ring over all N devices
    sync_per_byte = _packed_per_byte(hw, num_devices) if packed else per_byte
    row_s = wl.flops_per_row / hw.flops_per_s
    row_s += wl.all_to_all_passes * wl.d_model * wl.activation_bytes * per_byte
    grad_s = (1.0 - wl.replica_sync_overlap) * wl.expert_grad_bytes * sync_per_byte
    return grad_s / row_s


def perfect_cost(counts: np.ndarray, num_devices: int, hw: HardwareModel, wl: Workload) -> StepCost:
    """Perfect-balance bound: every device computes ``total/N`` rows, ``1/N`` of them local.

    No expert is replicated, so no replica gradient sync is charged (``replica_sync_s = 0``),
    which keeps it a lower bound on compute + sync for every placement of the same counts
    (compute is at least ``total/N`` rows, sync at least 0). Its all-to-all is the one of a
    device holding each expert's rows in ``1/N``: a placement with many replicas keeps more
    rows local and can undercut it (negative gaps with several spare slots per device).
    Its exchange is the one without expert groups (``Workload.num_groups`` is not used).

    Args:
      counts: ``[E]`` rows per expert in this step.
      num_devices: ``N``.
      hw: hardware figures.
      wl: layer shape.

    Returns:
      The ``StepCost`` of a perfectly balanced step.
    """
    total = float(np.sum(counts))
    load = np.full(num_devices, total / num_devices)
    local = load / num_devices
    compute = total / num_devices * wl.flops_per_row / hw.flops_per_s
    return StepCost(compute, _a2a_s(load, local, total, num_devices, hw, wl))


def copies_needed(old: Placement, new: Placement) -> np.ndarray:
    """``[P]`` bool: slots of ``new`` whose expert must be sent from another device.

    A slot needs a copy when its expert changed and the device held no replica of the new
    expert before (a local duplicate is copied in device memory, which is free here).
    """
    if (old.num_experts, old.num_devices, old.slots_per_device) != (
        new.num_experts,
        new.num_devices,
        new.slots_per_device,
    ):
        raise ValueError(f"placements differ in shape: old={old!r}, new={new!r}")
    changed = old.slot_to_expert != new.slot_to_expert
    new_keys = new.slot_devices() * new.num_experts + new.slot_to_expert
    had = np.isin(new_keys, old.device_expert_keys())
    return changed & ~had


def migration_bytes(old: Placement, new: Placement, wl: Workload) -> int:
    """Total bytes sent to go from ``old`` to ``new`` (0 for identical placements)."""
    return int(copies_needed(old, new).sum()) * wl.expert_state_bytes


def migration_s(old: Placement, new: Placement, hw: HardwareModel, wl: Workload) -> float:
    """Modeled seconds to migrate: the device receiving the most expert copies sets the time.

    Copies to different devices go in parallel; a device receives its copies back to back.
    """
    received = copies_needed(old, new).reshape(new.num_devices, -1).sum(axis=1)
    nbytes = received.astype(np.float64) * wl.expert_state_bytes
    return float(hw.transfer_s(nbytes, new.num_devices).max())


def replica_sync_s(placement: Placement, hw: HardwareModel, wl: Workload) -> float:
    """Modeled seconds per step to combine the gradients of experts replicated across devices.

    Training sums each expert's replica gradients and hands the sum to every replica (so the
    math is the unreplicated model's). Replicas on one device cost nothing in both models; the
    busiest device sets the time, nothing overlapped. ``step_cost`` charges it, less the part
    ``Workload.replica_sync_overlap`` hides behind the backward pass.

    ``Workload.replica_sync == "holders"``: a ring all-reduce of the gradients among the ``d_e``
    devices holding expert ``e``: each of them sends ``2 (d_e - 1) / d_e`` x the expert's
    gradient bytes. A ring runs at its slowest hop, so an expert whose holders all sit in one
    node (``HardwareModel.devices_per_node``; device ``i`` is in node ``i // devices_per_node``)
    syncs over the in-node link and one spanning nodes over the cross-node link; a device's two
    links work in parallel.

    ``"packed"`` (``moejax.parallel.slots.combine_replica_grads``): one ring all-reduce over all
    ``N`` devices of ``B = packed_sync_gradients(placement)`` expert gradients; every device sends
    ``2 (N - 1) / N · B`` gradients, over the in-node link when the ``N`` devices fit in one
    node, else at the cross-node link's speed.

    Args:
      placement: the layer's placement.
      hw: hardware figures.
      wl: layer shape.

    Returns:
      Seconds per step (0.0 when no expert spans two devices).
    """
    return placement.memo(("replica_sync_s", hw, wl), lambda: _replica_sync_s(placement, hw, wl))


def packed_sync_gradients(placement: Placement) -> int:
    """``B``: expert gradients in the buffer the training step all-reduces for ``placement``
    (``packed_buffer`` of its experts held on two devices or more)."""
    expert = placement.device_expert_keys() % placement.num_experts
    m = int(np.sum(np.bincount(expert, minlength=placement.num_experts) >= 2))
    return packed_buffer(m, placement.num_slots, placement.num_experts)


def packed_buffer(synced: int, num_slots: int, num_experts: int) -> int:
    """``B`` for ``synced`` experts across devices: the smallest of 0, the powers of two below
    ``min(P - E, E)`` and that bound that is ``>= synced`` (the training step compiles one branch
    per size: ``moejax.parallel.slots.sync_buffer_sizes``, the same rule)."""
    if synced <= 0:
        return 0
    return min(1 << (synced - 1).bit_length(), min(num_slots - num_experts, num_experts))


def _packed_per_byte(hw: HardwareModel, num_devices: int) -> float:
    """Seconds per byte a device sends in the packed ring over all ``N`` devices: the in-node
    link when they fit in one node, else the cross-node link (the ring's slowest hop)."""
    one_node = 1 < num_devices <= hw.devices_per_node
    return 1.0 / (hw.node_link_bytes_per_s if one_node else hw.link_bytes_per_s)


def _packed_sync_s(placement: Placement, hw: HardwareModel, wl: Workload) -> float:
    n = placement.num_devices
    nbytes = 2.0 * (n - 1) / n * packed_sync_gradients(placement) * wl.expert_grad_bytes
    return nbytes * _packed_per_byte(hw, n)


def _replica_sync_s(placement: Placement, hw: HardwareModel, wl: Workload) -> float:
    if wl.replica_sync == "packed":
        return _packed_sync_s(placement, hw, wl)
    keys = placement.device_expert_keys()  # (device, expert) pairs present
    e, n = placement.num_experts, placement.num_devices
    device, expert = keys // e, keys % e
    holders = np.bincount(expert, minlength=e)[expert]  # devices holding each pair's expert
    share = 2.0 * (holders - 1) / holders * wl.expert_grad_bytes
    group = min(hw.devices_per_node, n)
    if group <= 1:  # one flat network
        return float(np.bincount(device, weights=share, minlength=n).max() / hw.link_bytes_per_s)
    in_node = placement.nodes_holding(group)[expert] == 1  # [pairs] holders share one node
    inside = np.bincount(device, weights=np.where(in_node, share, 0.0), minlength=n)
    across = np.bincount(device, weights=np.where(in_node, 0.0, share), minlength=n)
    seconds = np.maximum(inside / hw.node_link_bytes_per_s, across / hw.link_bytes_per_s)
    return float(seconds.max())
