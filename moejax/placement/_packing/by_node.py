"""Hierarchical packing: experts dealt to nodes first, then packed inside each node.

Shape letters: ``E`` experts, ``N`` devices, ``S`` slots per device, ``G`` devices per node,
``M = N / G`` nodes, ``Q = E / M`` experts per node.

On hardware whose nodes have a fast in-node link (``HardwareModel.devices_per_node``), an
expert whose replicas all sit in one node syncs its gradients over that link (9x the cross-node
bandwidth on ``H100_IB``). ``node_order.group_nodes`` orders a flat packing into nodes, but a
flat packing links most devices into long chains of replicated experts, so some replicas stay
cut. Here no replica crosses a node (an expert gets at most ``G`` replicas):

1. **Nodes**: ``flat.pack_starts`` deals the ``E`` experts, whole, into ``M`` nodes of
   exactly ``Q`` experts each, balancing the nodes' rows (balanced largest differencing, and
   EPLB-style greedy, each + pairwise rebalancing); steps 2 and 3 run for both dealings
   (``pack_by_node_starts``), and ``pack_by_node`` keeps the greedy one when its busiest device
   is strictly lighter (the planner: when its modeled step is strictly lower).
2. **Replica counts per node**: the node's ``G·S`` slots among its ``Q`` experts. Candidates,
   all nodes at once: the ``j`` coldest experts split two or three ways and the other spare
   slots by highest averages (largest ``n_e / r_e`` first, at most ``G`` replicas), for every
   ``j`` whose splits take at most two thirds of the spare slots; the split cold experts give
   each device small pieces to fill up with (``flat.replica_counts`` explains why they
   pack better); ``common.candidate_replicas``.
3. **Devices per node**: each candidate is packed into the node's ``G`` devices of ``S``
   slots, all nodes at once: largest first, each round of ``G`` items with the lightest to the
   busiest device so far, then pairwise re-splits of the heaviest and lightest devices of each
   node (``common.pack_nodes``); each node keeps its best candidate.

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

from moejax.placement._packing.common import candidate_replicas, pack_nodes
from moejax.placement._packing.flat import pack_starts


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
    """``pack_by_node``'s candidates: for each start of the node dealing (``flat.pack_starts``:
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
    full = np.full(node_counts.shape[0], g * s)  # every node's slots, at most G replicas each
    for r in candidate_replicas(node_counts, full, np.full_like(full, g), every_split=True):
        ids = np.repeat(nodes.reshape(-1), r.reshape(-1)).reshape(k, g * s)
        weights = np.repeat((node_counts / r).reshape(-1), r.reshape(-1)).reshape(k, g * s)
        table, slot_w = pack_nodes(weights, ids, g, s, k // m)
        worst = slot_w.sum(axis=2).max(axis=1)  # [K] each node's busiest device
        if best_table is None:
            best_table, best_max = table, worst
        else:
            better = worst < best_max
            best_table[better], best_max = table[better], np.minimum(worst, best_max)
    return best_table, best_max
