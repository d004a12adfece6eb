"""Group-aware packing: each expert group kept on as few nodes as the layout allows.

Shape letters: ``E`` experts, ``N`` devices, ``S`` slots per device, ``G`` devices per node,
``M = N / G`` nodes, ``Q = E / M`` experts per node, ``C = G·S`` slots per node.

With group-limited routing a token reaches the nodes of its ``topk_groups`` groups only if
each group lives on few nodes (``groups.py``: the all-to-all crosses nodes once per destination
node). ``by_node.pack_by_node`` deals single experts to nodes and so spreads every group
over all of them. Here, as in DeepSeek's EPLB hierarchy, whole groups go to nodes first:

1. **Homes** (``group_homes``): every node holds ``Q`` experts once. When ``M`` divides the
   number of groups, ``flat.pack`` deals whole groups, ``num_groups / M`` per node, balancing
   the nodes' rows (1 node per group). Otherwise the groups are laid out in id order, ``Q``
   experts per node (``groups.min_nodes_per_group`` nodes each: ``M / num_groups`` when that
   divides), and each group's experts are dealt, hottest first, to the least loaded of its
   nodes with room for them.
2. **Spill** (``spill`` in ``[0, 1]``): a node's ``C`` slots hold replicas of its own experts
   only, so a node whose groups are hot stays hot. With ``spill > 0`` the nodes are given
   ``spill`` x the slots they are short of (or have in excess) against a global apportionment
   (``flat.apportion``, at most ``N`` replicas); a hot node's extra slots are one replica
   each of its hottest replicated experts (by rows per replica), placed on the least loaded
   nodes with room. Spilled replicas take their group's rows off its nodes, which costs
   cross-node traffic (``groups.cross_node_copies``): ``planner.plan`` tries a few ``spill``
   levels and keeps the one the cost model prices lowest, 0 when nothing pays.
3. **Replica counts and devices per node**: as ``by_node`` steps 2 and 3 (the ``j``
   coldest experts split two or three ways, the rest by highest averages, ``j`` on a coarser
   grid (0-3, then quarters of the most) to bound the time; packed into the
   node's ``G`` devices by rounds, and pairwise re-splits for the ``_FINALISTS`` best before
   them; ``common.candidate_replicas`` and ``common.pack_nodes``); the candidate whose busiest
   device is lightest over all nodes is kept (spilled replicas couple the nodes).

Plain numpy; no jax.
"""

from __future__ import annotations

import numpy as np

from moejax.placement._packing.common import candidate_replicas, pack_nodes
from moejax.placement._packing.flat import apportion, pack
from moejax.placement.groups import experts_per_group, min_nodes_per_group

SPILL_LEVELS = (0.0, 0.5, 1.0)  # spill fractions the planner tries (0: groups kept whole)
_FINALISTS = 3  # replica-count candidates re-split in full (by their balance before re-splits)


def pack_by_group(
    counts: np.ndarray,
    num_devices: int,
    slots_per_device: int,
    devices_per_node: int,
    num_groups: int,
    spill: float = 0.0,
) -> np.ndarray | None:
    """Replicas packed node by node with each group on its home nodes (module docstring).

    Args:
      counts: ``[E]`` rows per expert (float64).
      num_devices: ``N``, a multiple of ``G``.
      slots_per_device: ``S``.
      devices_per_node: ``G`` (2 <= ``G`` < ``N``).
      num_groups: expert groups (divides ``E``; group ``j`` is experts ``j·E/num_groups ..``).
      spill: in ``[0, 1]``, the share of a hot node's shortfall of slots it may take from
        other nodes (0: every replica on its group's home nodes).

    Returns:
      ``[N, S]`` int64 experts per device, node ``m`` in rows ``m·G .. m·G + G - 1``, every
      expert on at least one slot; None when the shapes do not split into nodes (``E`` not a
      multiple of ``M``, fewer than ``S`` or more than ``G·S`` experts per node).

    >>> counts = np.array([8.0, 1, 1, 1, 4, 1, 1, 1])  # 2 groups of 4, 2 nodes of 2 devices
    >>> pack_by_group(counts, 4, 3, 2, num_groups=2).tolist()  # node 0: 4 + 1 + 0.5 rows each
    [[0, 3, 1], [0, 2, 1], [4, 7, 5], [4, 6, 5]]
    """
    if not 0.0 <= spill <= 1.0:
        raise ValueError(f"spill must lie in [0, 1], got {spill!r}")
    e, g, s = counts.shape[0], devices_per_node, slots_per_device
    m = num_devices // g
    experts_per_group(e, num_groups)  # validates num_groups
    if num_devices % g or m < 2 or e % m or not s <= e // m <= g * s:
        return None
    homes = group_homes(counts, num_groups, m)  # [M, Q]
    node_counts = counts[homes]
    out, into = _spill_slots(counts, homes, num_devices, g * s, spill)
    budget = g * s + out - into  # [M] replicas of each node's own experts
    filled = [
        _fill_nodes(homes, node_counts, r, out, into)
        for r in candidate_replicas(node_counts, budget, g + out)
    ]
    # Every candidate dealt to devices (no re-splits), the best few re-split in full.
    rough = [pack_nodes(w, ids, g, s, passes=0)[1].sum(axis=2).max() for ids, w in filled]
    best_table, best_max = None, np.inf
    for k in np.argsort(rough, kind="stable")[:_FINALISTS].tolist():
        table, slot_w = pack_nodes(filled[k][1], filled[k][0], g, s)
        worst = float(slot_w.sum(axis=2).max())
        if worst < best_max:
            best_table, best_max = table, worst
    return best_table.reshape(num_devices, s)


def group_homes(counts: np.ndarray, num_groups: int, num_nodes: int) -> np.ndarray:
    """``[M, Q]`` int64 experts homed on each node, each expert once (step 1)."""
    e = counts.shape[0]
    z, q = e // num_groups, e // num_nodes
    if num_groups % num_nodes == 0:  # whole groups per node, balanced
        group_rows = counts.reshape(num_groups, z).sum(axis=1)
        nodes = pack(group_rows, np.arange(num_groups), num_nodes)  # [M, groups per node]
        return (nodes[:, :, None] * z + np.arange(z)).reshape(num_nodes, q)
    spans = min_nodes_per_group(e, num_groups, num_nodes)  # groups in id order
    homes: list[list[int]] = [[] for _ in range(num_nodes)]
    loads = np.zeros(num_nodes)
    for j in range(num_groups):
        first = j * z // q
        nodes = np.arange(first, first + spans[j])
        # Room of each of the group's nodes: its overlap with the group's id range.
        room = np.minimum((nodes + 1) * q, (j + 1) * z) - np.maximum(nodes * q, j * z)
        ids = j * z + np.argsort(-counts[j * z : (j + 1) * z], kind="stable")
        for x in ids.tolist():
            open_ = np.flatnonzero(room > 0)
            k = open_[np.argmin(loads[nodes[open_]])]
            homes[nodes[k]].append(x)
            room[k] -= 1
            loads[nodes[k]] += counts[x]
    return np.asarray(homes, np.int64)


def _spill_slots(counts, homes, num_devices: int, node_slots: int, spill: float):
    """``[M]`` slots each node's experts take from other nodes (``out``) and slots each node
    gives to others' experts (``into``); both sum to the same (step 2)."""
    m = homes.shape[0]
    zero = np.zeros(m, np.int64)
    if spill == 0.0:
        return zero, zero
    ideal = apportion(counts, m * node_slots, max_replicas=num_devices)[homes].sum(axis=1)
    short = np.maximum(ideal - node_slots, 0)
    free = np.maximum(node_slots - ideal, 0)
    total = int(round(spill * short.sum()))
    if total == 0:
        return zero, zero
    return _largest_remainder(total, short), _largest_remainder(total, free)


def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """``[M]`` int64 shares of ``total`` in proportion to ``weights`` (Hamilton's method)."""
    quota = total * weights / weights.sum()
    share = np.floor(quota).astype(np.int64)
    rest = total - int(share.sum())
    share[np.argsort(-(quota - share), kind="stable")[:rest]] += 1
    return share


def _fill_nodes(homes, node_counts, r, out, into):
    """``[M, C]`` expert ids and rows of the replicas each node holds: its own, less ``out``
    spilled ones (one each of its hottest replicated experts, by rows per replica, round after
    round), plus ``into`` of the others' spilled ones (heaviest first to the least loaded
    node with room)."""
    m, q = homes.shape
    weights = node_counts / r  # [M, Q]
    keep = r.copy()
    spilled = []  # (rows, expert)
    for node in np.flatnonzero(out > 0).tolist():
        order = np.argsort(-weights[node], kind="stable").tolist()
        need = int(out[node])
        while need:  # sum(r - 1) >= out: a node short of slots got none from others
            before = need
            for k in order:
                if need and keep[node, k] >= 2:
                    keep[node, k] -= 1
                    spilled.append((float(weights[node, k]), int(homes[node, k])))
                    need -= 1
            assert need < before, "no replica left to spill"
    ids = [np.repeat(homes[i], keep[i]).tolist() for i in range(m)]
    rows = [np.repeat(weights[i], keep[i]).tolist() for i in range(m)]
    load = np.array([sum(w) for w in rows])
    room = into.copy()
    for w, x in sorted(spilled, key=lambda t: -t[0]):
        open_ = np.flatnonzero(room > 0)
        node = int(open_[np.argmin(load[open_])])
        ids[node].append(x)
        rows[node].append(w)
        load[node] += w
        room[node] -= 1
    return np.asarray(ids, np.int64), np.asarray(rows, np.float64)
