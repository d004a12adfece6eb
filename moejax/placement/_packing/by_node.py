"""Hierarchical packing: experts dealt to nodes first, then packed inside each node.

Shape letters: ``E`` experts, ``N`` devices, ``S`` slots per device, ``G`` devices per node,
``M = N / G`` nodes, ``Q = E / M`` experts per node.

On hardware whose nodes have a fast in-node link (``HardwareModel.devices_per_node``), an
expert whose replicas all sit in one node syncs its gradients over that link (9x the cross-node
bandwidth on ``H100_IB``). ``packing_nodes.group_nodes`` orders a flat packing into nodes, but a
flat packing links most devices into long chains of replicated experts, so some replicas stay
cut. Here no replica crosses a node (an expert gets at most ``G`` replicas):

1. **Nodes**: ``packing.pack_starts`` deals the ``E`` experts, whole, into ``M`` nodes of
   exactly ``Q`` experts each, balancing the nodes' rows (balanced largest differencing, and
   EPLB-style greedy, each + pairwise rebalancing); steps 2 and 3 run for both dealings
   (``pack_by_node_starts``), and ``pack_by_node`` keeps the greedy one when its busiest device
   is strictly lighter (the planner: when its modeled step is strictly lower).
2. **Replica counts per node**: the node's ``G·S`` slots among its ``Q`` experts. Candidates,
   all nodes at once: the ``j`` coldest experts split two or three ways and the other spare
   slots by highest averages (largest ``n_e / r_e`` first, at most ``G`` replicas), for every
   ``j`` whose splits take at most two thirds of the spare slots; the split cold experts give
   each device small pieces to fill up with (``packing.replica_counts`` explains why they
   pack better).
3. **Devices per node**: each candidate is packed into the node's ``G`` devices of ``S``
   slots, all nodes at once: largest first, each round of ``G`` items with the lightest to the
   busiest device so far, then pairwise re-splits of the heaviest and lightest devices of each
   node (``packing._splits``); each node keeps its best candidate.

On the simulator's Zipf traces (``H100_IB``, nodes of 8, expected counts of the first 20
steps) the modeled step is 1.8% / 3.5% / 4.6% over the perfect bound at ``N = 64 / 512 /
2048``, against 5.9% / 6.2% / 7.3% for the flat packing grouped into nodes: the busiest device
carries more (2.3% / 2.8% / 4.0% over the mean, against 0.7% / 1.4% / 2.9%: 16 experts and 24
slots per node leave coarse pieces), but replica sync falls from 4.4-5.5% of the step to 0.7%.
The planner takes whichever models faster (``planner.plan``); 10-40 ms at ``P = 6144``.

Plain numpy; no jax.
"""

from __future__ import annotations

import numpy as np

from moejax.placement.packing import _has_duplicates, _splits, pack_starts

_PASSES = 16  # pairwise re-split passes per node at most


def pack_by_node(
    counts: np.ndarray, num_devices: int, slots_per_device: int, devices_per_node: int
) -> np.ndarray | None:
    """Replicas packed node by node (module docstring).

    Args:
      counts: ``[E]`` rows per expert (float64).
      num_devices: ``N``, a multiple of ``G``.
      slots_per_device: ``S``.
      devices_per_node: ``G`` (2 <= ``G`` < ``N``).

    Returns:
      ``[N, S]`` int64 experts per device, node ``m`` in rows ``m·G .. m·G + G - 1``, every
      expert on at least one slot; None when the shapes do not split into nodes (``E`` not a
      multiple of ``M``, more experts per node than slots, or fewer than ``S``: then some
      expert would need more than ``G`` replicas).
    """
    starts = pack_by_node_starts(counts, num_devices, slots_per_device, devices_per_node)
    if starts is None:
        return None
    (first, first_max), (second, second_max) = starts
    return second if second_max < first_max * (1.0 - 1e-12) else first


def pack_by_node_starts(
    counts: np.ndarray, num_devices: int, slots_per_device: int, devices_per_node: int
) -> list[tuple[np.ndarray, float]] | None:
    """``pack_by_node``'s candidates: for each start of the node dealing (``packing.pack_starts``:
    differencing, then greedy), ``[N, S]`` experts per device and the busiest device's rows;
    None as ``pack_by_node``. The planner weighs them by modeled step time."""
    e, g, s = counts.shape[0], devices_per_node, slots_per_device
    m = num_devices // g
    if num_devices % g or e % m or not s <= e // m <= g * s:
        return None
    # Both dealings packed at once (stacked, ``2M`` nodes): the same per node as one by one.
    starts = pack_starts(counts, np.arange(e), m)  # [M, Q] experts per node, each start
    table, worst = _pack_dealt(counts, np.concatenate([nodes for nodes, _ in starts]), g, s)
    table, worst = table.reshape(len(starts), num_devices, s), worst.reshape(len(starts), m)
    return [(table[i], float(worst[i].max())) for i in range(len(starts))]


def _pack_dealt(counts: np.ndarray, nodes: np.ndarray, g: int, s: int):
    """Steps 2 and 3 for experts dealt to nodes (``[K, Q]``, ``K / M`` dealings of ``M`` nodes
    each stacked): ``[K, G, S]`` experts per device and ``[K]`` each node's busiest device, of
    the best replica-count candidate per node."""
    k, m = nodes.shape[0], counts.shape[0] // nodes.shape[1]
    node_counts = counts[nodes]
    best_table, best_max = None, None
    for r in _candidate_replicas(node_counts, g, s):  # each node keeps its best candidate
        ids = np.repeat(nodes.reshape(-1), r.reshape(-1)).reshape(k, g * s)
        weights = np.repeat((node_counts / r).reshape(-1), r.reshape(-1)).reshape(k, g * s)
        table, slot_w = _pack_nodes(weights, ids, g, s, k // m)
        worst = slot_w.sum(axis=2).max(axis=1)  # [K] each node's busiest device
        if best_table is None:
            best_table, best_max = table, worst
        else:
            better = worst < best_max
            best_table[better], best_max = table[better], np.minimum(worst, best_max)
    return best_table, best_max


def _candidate_replicas(node_counts: np.ndarray, g: int, s: int) -> list[np.ndarray]:
    """``[M, Q]`` replica counts per candidate (step 2 of the module docstring)."""
    m, q = node_counts.shape
    spare = g * s - q
    rows = np.arange(m)
    coldest = np.argsort(node_counts, axis=1, kind="stable")
    out = []
    for ways in (2, 3):
        # Cold splits take at most two thirds of the spare slots: beyond, the hottest experts
        # keep too few replicas (on the simulator's traces no node ever chose more).
        first = 0 if ways == 2 else 1  # (j = 0 is the same candidate for both)
        for j in range(first, min(2 * spare // (3 * (ways - 1)), q) + 1):
            r = np.ones((m, q), np.int64)
            r[rows[:, None], coldest[:, :j]] = ways
            for _ in range(spare - j * (ways - 1)):
                priority = np.where(r < g, node_counts / r, -np.inf)
                r[rows, np.argmax(priority, axis=1)] += 1
            out.append(r)
    return out


def _pack_nodes(
    weights: np.ndarray, ids: np.ndarray, g: int, s: int, blocks: int = 1, passes: int = _PASSES
):
    """``[K, G·S]`` replicas into ``[K, G, S]`` devices per node (step 3, at most ``passes``
    re-split passes); returns the experts and the rows of every slot. The ``K`` nodes are
    ``blocks`` independent packings of ``K / blocks`` consecutive nodes each: a block stops
    after the first pass that does not lower its busiest device, as if packed alone."""
    k = weights.shape[0]
    order = np.argsort(-weights, axis=1, kind="stable")
    weights, ids = np.take_along_axis(weights, order, 1), np.take_along_axis(ids, order, 1)
    rows = np.arange(k)[:, None]
    table, slot_w = np.empty((k, g, s), np.int64), np.empty((k, g, s))
    for j in range(s):  # round j: the j-th heaviest G items, the lightest to the busiest device
        busiest = np.argsort(-slot_w[:, :, :j].sum(axis=2), axis=1, kind="stable")
        table[rows, busiest, j] = ids[:, (j + 1) * g - 1 : j * g - 1 if j else None : -1]
        slot_w[rows, busiest, j] = weights[:, (j + 1) * g - 1 : j * g - 1 if j else None : -1]

    def block_max(slot_w):  # [blocks] busiest device of each block
        return slot_w.sum(axis=2).reshape(blocks, -1).max(axis=1)

    best = block_max(slot_w)
    active = np.ones(blocks, bool)  # blocks still improving
    out_table, out_w = table, slot_w
    for shift in range(passes):
        table, slot_w = _resplit_pairs(table, slot_w, shift)
        keep = np.repeat(active, k // blocks)  # [K] nodes of the blocks this pass counts for
        out_table = np.where(keep[:, None, None], table, out_table)
        out_w = np.where(keep[:, None, None], slot_w, out_w)
        top = block_max(slot_w)
        active &= top < best
        if not active.any():
            break
        best = np.where(active, top, best)
    return out_table, out_w


def _resplit_pairs(table: np.ndarray, slot_w: np.ndarray, shift: int):
    """In every node, its ``G / 2`` heaviest devices paired with its lightest (rotated by
    ``shift``), each pair's ``2S`` replicas re-split to the smallest larger load (a split that
    puts one expert twice on a device only if the current one does)."""
    m, g, s = table.shape
    half = g // 2
    order = np.argsort(slot_w.sum(axis=2), axis=1, kind="stable")
    heavy, light = order[:, ::-1][:, :half], np.roll(order[:, :half], shift, axis=1)
    rows = np.arange(m)[:, None]
    items = np.concatenate([table[rows, heavy], table[rows, light]], axis=2).reshape(-1, 2 * s)
    item_w = np.concatenate([slot_w[rows, heavy], slot_w[rows, light]], axis=2).reshape(-1, 2 * s)
    mask = _splits(s)  # [C, 2S]
    side_a = item_w @ mask.T  # [M·G/2, C]
    worst = np.maximum(side_a, item_w.sum(axis=1, keepdims=True) - side_a)
    grouped = np.sort(items, axis=1)
    repeated = np.flatnonzero(np.any(grouped[:, 1:] == grouped[:, :-1], axis=1))
    if repeated.size:
        worst[repeated] += np.where(_has_duplicates(items[repeated], mask), np.inf, 0.0)
    worst[:, 0] = np.maximum(side_a[:, 0], item_w.sum(axis=1) - side_a[:, 0])  # always allowed
    pick = mask[np.argmin(worst, axis=1)]  # [M·G/2, 2S]
    table, slot_w = table.copy(), slot_w.copy()
    table[rows, heavy] = items[pick].reshape(m, half, s)
    table[rows, light] = items[~pick].reshape(m, half, s)
    slot_w[rows, heavy] = item_w[pick].reshape(m, half, s)
    slot_w[rows, light] = item_w[~pick].reshape(m, half, s)
    return table, slot_w
