"""Placement planner: greedy moves (after FlexMoE's expand / shrink / migrate), repair, re-pack.

Shape letters: ``E`` experts, ``N`` devices, ``S`` slots per device, ``P = N·S`` slots.

The planner balances *compute*: it minimises the busiest device's rows, where an expert's rows
``n_e`` are split evenly over its ``r_e`` replicas (weight ``n_e / r_e`` per slot).

**Greedy pass** (migration-light; starts from the current placement), up to ``max_moves`` moves:

1. Take the busiest device ``d`` (load ``L``).
2. **Expand + shrink**: for each expert ``h`` on ``d``, hottest replica first, try to add a
   replica of ``h`` on a device that does not hold it yet, in a slot freed by *shrinking* an
   expert ``c`` that has ``r_c >= 2`` replicas (over-replicated, usually cold). Candidate donor
   slots are ranked by ``load(dev) - w_c + w_h' + (n_c/(r_c-1) - w_c)`` (the receiving device's
   new load plus what ``c``'s other replicas gain); the best few are checked exactly.
3. **Migrate (swap)**: otherwise swap one expert of ``d`` with one of a lightly loaded device.
4. A move is applied only if ``d``'s load drops and every device it touches stays strictly
   below ``L``; so the maximum never rises and the number of devices at the maximum falls,
   which makes the loop terminate. It stops early once ``L <= (1 + tolerance) · mean``.

**Re-pack** (``_packing.flat``, vectorised, ~20 ms at ``P = 6144``): replica counts by
highest-averages apportionment, also trying splits of the coldest experts (which pack better
into exactly ``S`` slots), packed by balanced largest differencing and pairwise rebalancing (and
from an EPLB-style greedy start, kept when its busiest device is strictly lighter or, with
``hardware``, its modeled step strictly lower), the devices then relabelled onto the current
placement so that experts stay where they are.

**Order**: a short greedy pass (``_QUICK_MOVES``) first, when the input is within
``_REPACK_FIRST`` x the mean; if it reaches tolerance, done. Otherwise the re-pack sets the
target (its balance, plus ``_GLOBAL_MARGIN``), and two migration-light ways to reach it are
tried before taking it: the **repair** (``_packing.flat.rebalance``: the busiest device swaps
replicas with its best partner device, a few dozen rounds at most, replica counts unchanged;
skipped when too many devices are above the target), then more greedy moves, at most as many
as the re-pack sends expert copies (and none when more devices than that are above the target:
a move lowers the busiest device and, at most, the other holders of one expert).

**Replica sync** (when ``plan`` is given the ``hardware`` and ``workload``): a replica on
another device is not free, its gradients are combined with the others' every step
(``cost_model.replica_sync_s``), so the result above, which balances rows alone, is weighed by
the full modeled step time (compute + all-to-all + sync) against a sync-aware re-pack: replica
counts scored by packed rows plus the busiest device's sync in rows
(``cost_model.rows_per_gradient``), with candidates that replicate fewer experts across devices
and fill the spare slots with same-device duplicates (free); the packed replicas are then moved
between device pairs (``_packing.sync.limit_sync``) so that the largest per-device sync share
falls while neither it nor the busiest load rises. The re-pack must beat a candidate
that sends fewer expert copies by ``_GLOBAL_MARGIN``. On hardware with nodes
(``HardwareModel.devices_per_node`` dividing ``N``), the packed devices are then ordered into
nodes so that the holders of a replicated expert share one where they can
(``_packing.node_order.group_nodes``: their all-reduce then runs over the in-node link), and
relabelled onto the current placement node by node (``_packing.node_order.align_nodes``). There,
the hierarchical packing (``_packing.by_node.pack_by_node``: experts dealt to nodes, replicas packed
inside their node, so no replica sync leaves a node) is a further candidate, taken when its
modeled step is lower (of its two node dealings, differencing and greedy, the one of lower
modeled step; greedy only when strictly lower).

**Expert groups** (``Workload.num_groups > 1`` with group-limited routing, on hardware with
nodes): the cost model charges the all-to-all per destination node (``groups.py``), so a
group spread over many nodes costs cross-node traffic, and the node-aware candidate is the
group-aware packing instead (``_packing.by_group.pack_by_group``: whole groups dealt to nodes,
each group on as few nodes as the layout allows, replicas packed inside their group's nodes),
tried at a few spill levels (hot nodes' replicas placed on other nodes) and taken at the level
of the lowest modeled step; so a replica leaves its group's nodes only when the cost model
says the balance it buys pays for its cross-node traffic and sync.

Guarantees (tested with hypothesis): every expert keeps >= 1 replica, each device keeps exactly
``S`` slots, and the returned placement's busiest-device rows (with ``hardware`` and
``workload``: its modeled step time) are strictly lower than the input's, or the input object
itself is returned.

Plain numpy; no jax.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.placement._packing import (
    SPILL_LEVELS,
    align,
    align_nodes,
    apportion,
    fill_spare,
    group_nodes,
    limit_sync,
    pack,
    pack_by_group,
    pack_by_node_starts,
    pack_starts,
    rebalance,
    replica_counts,
    sync_shares,
)
from moejax.placement.cost_model import (
    HardwareModel,
    Workload,
    copies_needed,
    has_group_nodes,
    rows_per_gradient,
    step_cost,
)
from moejax.placement.table import Placement, check_counts

__all__ = ["apportion", "plan"]  # apportion lives in _packing/flat.py; re-exported here

_CANDIDATES = 8  # donor slots / light devices checked exactly per move
_LIGHT = 64  # least-loaded devices searched first for donor slots
_DEFAULT_MAX_MOVES = 256  # greedy moves per pass; bounds planner time at thousands of slots
_REPACK_FIRST = 1.5  # above this imbalance the greedy pass from the input is skipped
_QUICK_MOVES = 16  # greedy moves tried before the re-pack
_REPAIR_ROUNDS = 64  # most pairwise swaps of the repair (each: 2 devices exchange replicas)
_GLOBAL_MARGIN = 0.02  # a full re-pack must beat the greedy result by 2% to be chosen
_REL_TOL = 1e-12  # relative tolerance on "strictly lower" for float loads


class _State:
    """Mutable working copy of a placement with incrementally updated loads and indexes."""

    def __init__(self, placement: Placement, counts: np.ndarray):
        self.s = placement.slots_per_device
        self.n_dev = placement.num_devices
        self.table = placement.slot_to_expert.copy()  # [P]
        self.dev = placement.slot_devices()  # [P]
        self.n = counts  # [E] float64
        self.r = placement.expert_replica_counts().astype(np.int64)  # [E]
        self.r_slot = self.r[self.table]  # [P] replica count of each slot's expert
        self.slots_of: dict[int, list[int]] = {}  # expert -> its slots
        for slot, e in enumerate(self.table.tolist()):
            self.slots_of.setdefault(e, []).append(slot)
        weights = self.n[self.table] / self.r_slot
        self.loads = weights.reshape(self.n_dev, self.s).sum(axis=1)  # [N]
        self.tol = _REL_TOL * max(float(counts.sum()), 1.0)

    def weights_on(self, devices: np.ndarray) -> np.ndarray:
        """``[len(devices), S]`` rows of every slot of ``devices``."""
        slots = devices[:, None] * self.s + np.arange(self.s)
        return self.n[self.table[slots]] / self.r_slot[slots]

    def _set_replicas(self, expert: int, count: int) -> None:
        self.r[expert] = count
        self.r_slot[self.slots_of[expert]] = count

    # -- expand + shrink --------------------------------------------------------------------------

    def try_expand(self, busiest: int, limit: float) -> bool:
        weights = self.weights_on(np.array([busiest]))[0]
        slots = busiest * self.s + np.argsort(-weights)
        for hot in dict.fromkeys(self.table[slots].tolist()):
            if self.n[hot] > 0 and self._expand(hot, limit):
                return True
        return False

    def _expand(self, hot: int, limit: float) -> bool:
        table, dev, n, r = self.table, self.dev, self.n, self.r
        hot_devs = dev[self.slots_of[hot]]
        has_hot = np.zeros(self.n_dev, bool)
        has_hot[hot_devs] = True
        donors = self._donors(has_hot)
        if donors.size == 0:
            return False
        w_new = n[hot] / (r[hot] + 1)
        c = table[donors]
        w_c = n[c] / r[c]
        gain_c = n[c] / (r[c] - 1) - w_c  # what each other replica of c gains
        score = self.loads[dev[donors]] - w_c + w_new + gain_c
        if donors.size > _CANDIDATES:
            keep = np.argpartition(score, _CANDIDATES)[:_CANDIDATES]
            donors, score = donors[keep], score[keep]
        # The hot expert's current replicas shed rows to the new one.
        after_hot = self.loads.copy()
        np.add.at(after_hot, hot_devs, w_new - n[hot] / r[hot])
        hot_worst = float(after_hot[hot_devs].max())
        best, best_max = None, limit - self.tol
        for j in donors[np.argsort(score)].tolist():
            worst, change = self._shrink(j, w_new, after_hot)
            worst = max(worst, hot_worst)
            if worst < best_max:
                best, best_max, best_change = j, worst, change
        if best is None:
            return False
        for device, delta in best_change.items():
            after_hot[device] += delta
        self.loads = after_hot
        donor = int(table[best])
        self.slots_of[donor].remove(best)
        self.slots_of[hot].append(best)
        table[best] = hot
        self._set_replicas(donor, r[donor] - 1)
        self._set_replicas(hot, r[hot] + 1)
        return True

    def _donors(self, has_hot: np.ndarray) -> np.ndarray:
        """Slots whose expert has ``r >= 2`` on devices without the hot expert; looked for on
        the ``_LIGHT`` least-loaded devices first (where the best donors are), then everywhere."""
        if self.n_dev > 2 * _LIGHT:
            light = np.argpartition(self.loads, _LIGHT)[:_LIGHT]
            light = light[~has_hot[light]]
            slots = (light[:, None] * self.s + np.arange(self.s)).reshape(-1)
            slots = slots[self.r_slot[slots] >= 2]
            if slots.size:
                return slots
        return np.flatnonzero((self.r_slot >= 2) & ~has_hot[self.dev])

    def _shrink(self, j: int, w_new: float, loads: np.ndarray) -> tuple[float, dict[int, float]]:
        """Slot ``j`` gives its expert ``c`` (``r_c >= 2``) up for a new replica of weight
        ``w_new``: returns the largest resulting load among touched devices and the per-device
        load changes (pure Python: ``c`` has few replicas, numpy calls would cost more)."""
        c = int(self.table[j])
        w_c = self.n[c] / self.r[c]
        gain = self.n[c] / (self.r[c] - 1) - w_c
        change = {j // self.s: w_new - w_c}
        for slot in self.slots_of[c]:
            if slot != j:
                device = slot // self.s
                change[device] = change.get(device, 0.0) + gain
        return max(float(loads[d]) + v for d, v in change.items()), change

    # -- migrate (swap) ---------------------------------------------------------------------------

    def try_swap(self, busiest: int, limit: float) -> bool:
        k = min(_CANDIDATES, self.n_dev - 1)
        if k < 1:
            return False
        order = np.argpartition(self.loads, k)[: k + 1]
        targets = order[order != busiest][:k]
        w_a = self.weights_on(np.array([busiest]))[0][:, None]  # [S, 1] leaves the busiest
        w_b = self.weights_on(targets)[:, None, :]  # [k, 1, S] comes back
        new_busy = self.loads[busiest] - w_a + w_b  # [k, S, S]
        new_target = self.loads[targets][:, None, None] + w_a - w_b
        worst = np.maximum(new_busy, new_target)
        t, a, b = np.unravel_index(np.argmin(worst), worst.shape)
        if not worst[t, a, b] < limit - self.tol:
            return False
        slot_a, slot_b = busiest * self.s + int(a), int(targets[t]) * self.s + int(b)
        e_a, e_b = int(self.table[slot_a]), int(self.table[slot_b])
        self.slots_of[e_a].remove(slot_a)
        self.slots_of[e_b].remove(slot_b)
        self.slots_of[e_a].append(slot_b)
        self.slots_of[e_b].append(slot_a)
        self.table[slot_a], self.table[slot_b] = e_b, e_a
        self.r_slot[slot_a], self.r_slot[slot_b] = self.r[e_b], self.r[e_a]
        self.loads[busiest] = new_busy[t, a, b]
        self.loads[targets[t]] = new_target[t, a, b]
        return True


def plan(
    placement: Placement,
    counts: np.ndarray,
    *,
    max_moves: int | None = None,
    tolerance: float = 0.01,
    hardware: HardwareModel | None = None,
    workload: Workload | None = None,
) -> Placement:
    """Re-placement that lowers the busiest device's rows (or the modeled step time).

    Args:
      placement: the current placement (``N`` devices, ``S`` slots each).
      counts: ``[E]`` expected rows per expert (e.g. an EMA of observed counts); float or int.
      max_moves: most expand/swap moves per greedy pass (default 256). Each expand sends one expert
        copy, each swap two.
      tolerance: stop once the busiest device is within ``1 + tolerance`` of the mean load
        (further moves would buy almost nothing and cost migration).
      hardware: with ``workload``, weigh replica gradient sync against balance (module
        docstring) and return a placement of strictly lower ``step_cost``; None: rows alone.
      workload: the layer shape for ``hardware``.

    Returns:
      A placement whose busiest device computes strictly fewer rows than in ``placement`` (with
      ``hardware``: whose modeled step time is strictly lower), or ``placement`` itself when
      nothing helps.

    >>> p = Placement.identity(num_experts=4, num_devices=2, slots_per_device=3)
    >>> counts = np.array([90.0, 2.0, 4.0, 4.0])
    >>> p.device_load(counts).tolist(), plan(p, counts).device_load(counts).tolist()
    ([92.0, 8.0], [49.0, 51.0])
    """
    counts = np.asarray(check_counts(counts, placement.num_experts), np.float64)
    max_moves = _DEFAULT_MAX_MOVES if max_moves is None else max_moves
    if max_moves < 0:
        raise ValueError(f"max_moves must be >= 0, got {max_moves!r}")
    if (hardware is None) != (workload is None):
        raise ValueError(
            f"hardware and workload must be given together, got hardware={hardware!r}, "
            f"workload={workload!r}"
        )
    if counts.sum() <= 0 or placement.num_devices == 1:
        return placement
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    if hardware is None:
        return _balance_rows(placement, counts, max_moves, tolerance)
    sync_rows = rows_per_gradient(hardware, workload, placement.num_devices)
    g = hardware.devices_per_node  # nodes: consecutive blocks of g devices
    g = g if 1 < g < placement.num_devices and placement.num_devices % g == 0 else 1
    nodes, by_node = None, None
    if g > 1:  # a node-aware packing: a candidate, and the bar a flat one must clear
        if has_group_nodes(placement.num_devices, hardware, workload):
            by_node = _by_group(placement, counts, hardware, workload)  # groups on few nodes
        else:
            by_node = _by_node(placement, counts, hardware, workload)
        bar = np.inf if by_node is None else step_cost(by_node, counts, hardware, workload).total_s
        nodes = _Nodes(g, hardware, workload, bar)
    candidate = _balance_rows(
        placement, counts, max_moves, tolerance, sync_rows, nodes, workload, hardware
    )
    candidate = _weigh_sync(placement, candidate, counts, hardware, workload, sync_rows, nodes)
    if by_node is None:
        return candidate
    limit = step_cost(candidate, counts, hardware, workload).total_s
    if candidate is placement:  # a re-pack must save _GLOBAL_MARGIN of the step
        limit *= 1.0 - _GLOBAL_MARGIN
    return by_node if nodes.bar < limit else candidate


def _by_group(
    placement: Placement, counts: np.ndarray, hw: HardwareModel, wl: Workload
) -> Placement | None:
    """The group-aware packing (``_packing.by_group.pack_by_group``) at the spill level the cost
    model prices lowest (the lowest level on ties), relabelled onto ``placement`` node by
    node; None when the shapes do not split into nodes."""
    g = hw.devices_per_node
    best = None
    for spill in SPILL_LEVELS:
        packed = pack_by_group(
            counts, placement.num_devices, placement.slots_per_device, g, wl.num_groups, spill
        )
        if packed is None:
            return None
        new = placement.with_table(
            align_nodes(placement.device_table(), packed, placement.num_experts, g)
        )
        cost = step_cost(new, counts, hw, wl).total_s
        if best is None or cost < best[1]:
            best = (new, cost)
    return best[0]


def _balance_rows(
    placement,
    counts,
    max_moves: int,
    tolerance: float,
    sync_rows: float = 0.0,
    nodes: _Nodes | None = None,
    wl: Workload | None = None,
    hw: HardwareModel | None = None,
):
    """Greedy pass, repair and re-pack (module docstring; the re-pack weighs replica sync at
    ``sync_rows`` as ``wl.replica_sync`` says and groups replicas into ``nodes``): a placement
    of strictly
    fewer rows on the busiest device, or ``placement``."""
    good_enough = (1.0 + tolerance) * counts.sum() / placement.num_devices
    before = placement.device_load(counts).max()
    if before <= good_enough:
        return placement
    greedy = before <= _REPACK_FIRST * counts.sum() / placement.num_devices
    candidate, after = placement, before
    if greedy:  # a few migration-light moves may be all it takes
        candidate = _greedy(placement, counts, min(max_moves, _QUICK_MOVES), good_enough)
        after = candidate.device_load(counts).max()
    if after > good_enough:
        model = None if hw is None else (hw, wl)
        repacked = _repack(placement, counts, sync_rows, nodes, _sync_mode(wl), model)
        packed_max = repacked.device_load(counts).max()
        target = max(good_enough, packed_max / (1.0 - _GLOBAL_MARGIN))
        if after > target:  # swap replicas between busy and idle devices, counts unchanged
            repaired = _repair(candidate, counts, target)
            repaired_max = repaired.device_load(counts).max()
            if repaired_max < after:
                candidate, after = repaired, repaired_max
        budget = min(max_moves, int(copies_needed(placement, repacked).sum())) - _QUICK_MOVES
        # A greedy move lowers the busiest device (and the other holders of one expert): with
        # more devices above the target than the budget, it would not get there.
        above = int(np.sum(candidate.device_load(counts) > target))
        if greedy and 0 < above <= budget:  # it may still be the lighter migration
            candidate = _greedy(candidate, counts, budget, target)
            after = candidate.device_load(counts).max()
        if after > target:
            candidate, after = repacked, packed_max
    tol = _REL_TOL * counts.sum()
    return candidate if after < before - tol else placement


def _sync_mode(wl: Workload | None) -> str:
    return "holders" if wl is None else wl.replica_sync


def _weigh_sync(placement, candidate, counts, hw, wl, sync_rows: float, nodes) -> Placement:
    """``candidate`` if its modeled step time (sync included) is strictly below the input's.
    When rows alone found nothing to do but the input pays replica sync, the sync-aware
    re-pack is tried instead, and kept if it saves ``_GLOBAL_MARGIN`` of the step."""
    now = step_cost(placement, counts, hw, wl).total_s
    limit = now * (1.0 - _REL_TOL)
    if candidate is placement:
        if step_cost(placement, counts, hw, wl).replica_sync_s == 0:
            return placement  # balanced within tolerance (or stuck) with nothing to sync
        candidate = _repack(placement, counts, sync_rows, nodes, wl.replica_sync, (hw, wl))
        limit = now * (1.0 - _GLOBAL_MARGIN)
    return candidate if step_cost(candidate, counts, hw, wl).total_s < limit else placement


@dataclasses.dataclass(frozen=True)
class _Nodes:
    """Nodes of ``size`` devices for the re-pack. Grouping a flat packing into nodes only
    relabels devices, which changes its replica sync but not its compute or all-to-all; so it
    is skipped when those two alone reach ``bar``, the modeled step of the hierarchical
    packing (which the flat packing then cannot beat)."""

    size: int
    hw: HardwareModel
    wl: Workload
    bar: float


def _by_node(
    placement: Placement, counts: np.ndarray, hw: HardwareModel, wl: Workload
) -> Placement | None:
    """``_packing.by_node.pack_by_node`` relabelled onto ``placement`` node by node (None when the
    shapes do not split into nodes); of its two starts (``pack_by_node_starts``), the greedy
    one when its modeled step is strictly lower."""
    g = hw.devices_per_node
    starts = pack_by_node_starts(counts, placement.num_devices, placement.slots_per_device, g)
    if starts is None:
        return None
    best = None
    for packed, _ in starts:
        new = placement.with_table(
            align_nodes(placement.device_table(), packed, placement.num_experts, g)
        )
        cost = step_cost(new, counts, hw, wl).total_s
        if best is None or cost < best[1] * (1.0 - _REL_TOL):
            best = (new, cost)
    return best[0]


def _repack(
    placement: Placement,
    counts: np.ndarray,
    sync_rows: float = 0.0,
    nodes: _Nodes | None = None,
    sync: str = "holders",
    model: tuple[HardwareModel, Workload] | None = None,
) -> Placement:
    """Global re-pack (``_packing.flat``): apportioned replica counts (weighing replica sync at
    ``sync_rows``, modeled as ``sync``, a ``Workload.replica_sync``; spare slots left over are
    duplicated in place), balanced packing, devices grouped into ``nodes``
    (``_packing.node_order``; None: no nodes) and relabelled onto the current placement to keep
    experts in place. Of the packing's two starts (``_packing.flat.pack_starts``), the greedy one
    is kept when its busiest device is strictly lighter or, with ``model`` (hardware, workload),
    when its finished packing's modeled step is strictly lower."""
    n_dev = placement.num_devices
    r = replica_counts(counts, n_dev, placement.slots_per_device, sync_rows, sync)
    experts = np.repeat(np.arange(placement.num_experts), r)
    spare = placement.num_slots - experts.size  # 0 unless sync_rows > 0
    ids = np.concatenate([experts, -1 - np.arange(spare)])  # [P]; distinct ids < 0: empty
    weights = np.concatenate([counts[experts] / r[experts], np.zeros(spare)])
    if model is None:
        starts = [pack(weights, ids, n_dev)]  # [N, S]; the lighter busiest device
    else:
        starts = [table for table, _ in pack_starts(weights, ids, n_dev)]
    best = None
    for packed in starts:
        packed, grouped = _finish(placement, counts, packed, r, sync_rows, nodes, sync)
        cost = 0.0
        if len(starts) > 1:  # device order within nodes: the same cost once aligned
            cost = step_cost(placement.with_table(packed.reshape(-1)), counts, *model).total_s
        if best is None or cost < best[2] * (1.0 - _REL_TOL):
            best = (packed, grouped, cost)
    packed, grouped, _ = best
    old, e = placement.device_table(), placement.num_experts
    if grouped:
        return placement.with_table(align_nodes(old, packed, e, nodes.size))
    return placement.with_table(align(old, packed, e))


def _finish(placement, counts, packed, r, sync_rows: float, nodes, sync: str):
    """A packing's replicas moved to limit sync (``sync_rows > 0``, ``"holders"``), its spare
    slots filled and its devices grouped into ``nodes`` where that can beat ``nodes.bar``;
    returns ``[N, S]`` experts per device and whether it was grouped."""
    if sync_rows > 0 and sync == "holders":  # the same replicas, moved so that fewer
        # devices sync several experts (a packed sync costs the same wherever they sit)
        slot_r = np.where(packed >= 0, r[np.maximum(packed, 0)], 1)
        slot_w = np.where(packed >= 0, counts[np.maximum(packed, 0)] / slot_r, 0.0)
        packed = limit_sync(packed, slot_w, sync_shares(packed, r))
    packed = fill_spare(packed, r)
    if nodes is not None:
        # Compute and all-to-all do not depend on the order of the devices (only sync does).
        cost = step_cost(placement.with_table(packed.reshape(-1)), counts, nodes.hw, nodes.wl)
        if cost.total_s - cost.replica_sync_s < nodes.bar:
            # Replicas of an expert in one node: their sync stays on the in-node link.
            return packed[group_nodes(packed, nodes.size)], True
        # Else no grouping brings it under the hierarchical packing (``_Nodes``).
    return packed, False


def _repair(placement: Placement, counts: np.ndarray, target: float) -> Placement:
    """Replica swaps between the devices above ``target`` and their best partners
    (``_packing.flat.rebalance``); the input when too many devices are above it to repair."""
    table = placement.device_table()
    r = placement.expert_replica_counts()
    weights = counts[table] / r[table]  # [N, S]
    above = int(np.sum(weights.sum(axis=1) > target))  # a round lowers one of them
    if above > _REPAIR_ROUNDS // 2:
        return placement
    fixed = rebalance(table, weights, target, min(2 * above + _CANDIDATES, _REPAIR_ROUNDS))
    return placement.with_table(align(table, fixed, placement.num_experts))


def _greedy(placement: Placement, counts: np.ndarray, max_moves: int, good_enough: float):
    """Applies up to ``max_moves`` expand/swap moves (module docstring); returns the placement."""
    state = _State(placement, counts)
    for _ in range(max_moves):
        busiest = int(np.argmax(state.loads))
        limit = float(state.loads[busiest])
        if limit <= good_enough:
            break
        if not (state.try_expand(busiest, limit) or state.try_swap(busiest, limit)):
            break
    return placement.with_table(state.table)
