"""Node-aware device order for a packing: the replicas of an expert on devices of one node.

Shape letters: ``E`` experts, ``N`` devices, ``S`` slots per device, ``G`` devices per node
(``HardwareModel.devices_per_node``), ``M = N / G`` nodes.

The replica gradient all-reduce of an expert runs over the in-node link when all of its holders
share a node, else at the speed of the cross-node link (``cost_model.replica_sync_s``): on the
H100 cluster model NVLink gives 450 GB/s per direction and InfiniBand 50 GB/s, 9x less. Devices
are interchangeable for balance, so the devices of a packing can be put in any order without
changing a load; node ``m`` is devices ``m·G .. m·G + G - 1``.

``group_nodes`` orders the devices so that few replicated experts span two nodes. The replicated
experts link the devices that hold them; at ``E = 2N, S = 3`` most devices hold halves of two
experts, so the links form chains and cycles of devices.

1. **Greedy growth**: a node starts at the unplaced device with the fewest links (the end of a
   chain) and grows by the unplaced device that adds the fewest links to devices still unplaced
   net of its links into the node (ties: the most links into the node, then the lowest index),
   or starts afresh where none is linked. A chain is then cut about once per node, and a cut
   costs its two devices one cross-node gradient each.
2. **Swaps** (from the better of that grouping and the input's order, so never worse than
   the input): the step pays the *largest* cross-node share, which a few devices with two cut
   experts set. Up to ``_MAX_ROUNDS`` times, a device at the largest share trades nodes with a
   device of a node holding its cut experts, whenever that lowers (largest share, devices at
   it, total share).

At ``N = 2048`` (``H100_IB``, the simulator's Zipf trace) the largest cross-node share falls
from 3.5 gradients (devices in packing order) to about 2, for ~30 ms of host time per re-pack.

``align_nodes`` keeps that grouping when the packing is relabelled onto the current placement
(``flat.align`` does it device by device): nodes are matched to old nodes first, then devices
within each node, both by shared experts.

>>> import numpy as np
>>> table = np.array([[0, 1], [2, 3], [1, 2], [3, 4]])  # chain 0 -(1)- 2 -(2)- 1 -(3)- 3
>>> group_nodes(table, devices_per_node=2).tolist()  # nodes {0, 2}, {1, 3}: expert 2 is cut
[0, 2, 1, 3]

Plain numpy; no jax.
"""

from __future__ import annotations

import collections

import numpy as np

from moejax.placement._packing.common import match_devices, order_slots, unique_ints

_EPS = 1e-9  # shares are sums of a few 2 (d - 1) / d
_MAX_ROUNDS = 8  # rounds of device swaps between nodes at most (``_Swapper``)


def group_nodes(table: np.ndarray, devices_per_node: int) -> np.ndarray:
    """Device order putting the holders of each replicated expert in as few nodes as it can.

    Args:
      table: ``[N, S]`` experts per device (ids < 0: empty slots, ignored).
      devices_per_node: ``G``.

    Returns:
      ``[N]`` int64 permutation: ``table[order]`` has its nodes in consecutive blocks of ``G``
      (the identity when ``G <= 1`` or ``G >= N``, one node).
    """
    n, s = table.shape
    if devices_per_node <= 1 or devices_per_node >= n:
        return np.arange(n, dtype=np.int64)
    flat = table.reshape(-1)
    valid = flat >= 0
    num_experts = int(flat.max()) + 1 if valid.any() else 1
    keys = unique_ints(np.repeat(np.arange(n), s)[valid] * num_experts + flat[valid])
    device, expert = keys // num_experts, keys % num_experts
    holders = np.bincount(expert, minlength=num_experts)
    linked = holders[expert] >= 2  # (device, expert) pairs of experts held by several devices
    if not linked.any():  # nothing to sync: every order is as good, keep the input's
        return np.arange(n, dtype=np.int64)
    device, expert = device[linked], expert[linked]
    experts_of: list[list[int]] = [[] for _ in range(n)]
    holders_of: dict[int, list[int]] = {}
    for d, x in zip(device.tolist(), expert.tolist(), strict=True):
        experts_of[d].append(x)
        holders_of.setdefault(x, []).append(d)
    links = np.bincount(device, weights=holders[expert] - 1, minlength=n)  # [N]
    free_links = links.astype(np.int64).tolist()  # links to unplaced devices
    # The same, inf once placed (for picking a node's first device). Float explicitly: bincount
    # of an empty array is int64 even with weights, and inf does not fit an int.
    seed_links = links.astype(np.float64)
    placed = [False] * n
    order: list[int] = []
    while len(order) < n:
        score: dict[int, int] = {}  # unplaced device -> replicated experts shared with the node
        for _ in range(min(devices_per_node, n - len(order))):
            if score:
                v = min(score, key=lambda u: (free_links[u] - score[u], -score[u], u))
                del score[v]
            else:  # fewest links to unplaced devices: a chain's end, or where a cut left one
                v = int(np.argmin(seed_links))
            placed[v] = True
            seed_links[v] = np.inf
            order.append(v)
            for x in experts_of[v]:
                for u in holders_of[x]:
                    if not placed[u]:
                        free_links[u] -= 1
                        seed_links[u] -= 1
                        score[u] = score.get(u, 0) + 1
    order = np.asarray(order, np.int64)
    node_of = np.empty(n, np.int64)
    node_of[order] = np.arange(n) // devices_per_node
    share = 2.0 * (holders - 1) / np.maximum(holders, 1)  # [E] gradients each holder sends

    def cross_shares(node_of: np.ndarray) -> np.ndarray:  # [N], vectorised
        spans = np.bincount(unique_ints(node_of[device] * num_experts + expert) % num_experts)
        cut = np.pad(spans, (0, num_experts - spans.size))[expert] > 1
        return np.bincount(device, weights=np.where(cut, share[expert], 0.0), minlength=n)

    # The swaps start from the better of the greedy grouping and the input's own order (the
    # greedy is a heuristic), and only ever improve: never worse than the input order.
    cross = cross_shares(node_of)
    given = np.arange(n) // devices_per_node
    given_cross = cross_shares(given)
    if (given_cross.max(), given_cross.sum()) < (cross.max(), cross.sum()):
        node_of, cross = given, given_cross
    node_of = _Swapper(node_of, cross, experts_of, holders_of, share.tolist()).run(_MAX_ROUNDS)
    return np.argsort(node_of, kind="stable")


def _better(k, than) -> bool:
    """(largest share, devices at it, total) ``k`` lexicographically below ``than``."""
    if k[0] < than[0] - _EPS:
        return True
    if k[0] > than[0] + _EPS:
        return False
    return k[1] < than[1] or (k[1] == than[1] and k[2] < than[2] - _EPS)


class _Swapper:
    """Device swaps between nodes that lower the largest cross-node gradient share.

    A device's cross-node share (``cs``) is the sum of ``share[x]`` (gradients it sends, ``2 (d
    - 1) / d`` for ``d`` holders) over its experts ``x`` whose holders span nodes. State is kept
    incrementally: ``spread[x]`` counts the nodes of ``x``'s holders (built when first needed),
    and a swap recomputes the shares of the holders of the two devices' experts only.
    """

    def __init__(self, node_of, cs, experts_of, holders_of, share):
        self.node_of, self.cs, self.share = node_of, cs, share
        self.experts_of, self.holders_of = experts_of, holders_of
        self.spread: dict[int, collections.Counter] = {}
        self.members = collections.defaultdict(set)  # node -> its devices
        for d, m in enumerate(node_of.tolist()):
            self.members[m].add(d)

    def run(self, max_rounds: int) -> np.ndarray:
        """Applies the first improving swap found (``_try_swaps``), round after round, until
        none improves or ``max_rounds`` rounds; returns ``[N]`` node of each device."""
        for _ in range(max_rounds):
            now = self._key()
            if now[0] == 0 or not self._try_swaps(now):
                break
        return self.node_of

    def _try_swaps(self, now) -> bool:
        """Candidates: each device at the largest share, with the devices of the nodes holding
        its cut experts (most of their holders first; devices sharing an expert with it
        first). Applies the first swap that improves ``now``; False when none does."""
        for a in np.flatnonzero(self.cs > now[0] - _EPS).tolist():
            cut = [x for x in self.experts_of[a] if len(self._spread(x)) > 1]
            votes = collections.Counter(
                int(self.node_of[u]) for x in cut for u in self.holders_of[x]
            )
            votes.pop(int(self.node_of[a]), None)
            linked = {u for x in self.experts_of[a] for u in self.holders_of[x]}
            for m, _ in votes.most_common():
                for b in sorted(self.members[m], key=lambda b: (b not in linked, b)):
                    touched = list(
                        {
                            u
                            for x in self.experts_of[a] + self.experts_of[b]
                            for u in self.holders_of[x]
                        }
                    )
                    olds = [float(self.cs[u]) for u in touched]
                    self._swap(a, b, touched)
                    if _better(self._key_after(now, olds, touched), now):
                        return True
                    self._swap(a, b, touched)  # undo
        return False

    def _spread(self, x: int) -> collections.Counter:
        if x not in self.spread:
            self.spread[x] = collections.Counter(self.node_of[self.holders_of[x]].tolist())
        return self.spread[x]

    def _cross(self, d: int) -> float:
        return sum(self.share[x] for x in self.experts_of[d] if len(self._spread(x)) > 1)

    def _move(self, d: int, m: int) -> None:
        here = int(self.node_of[d])
        for x in self.experts_of[d]:
            c = self._spread(x)
            c[here] -= 1
            if not c[here]:
                del c[here]
            c[m] += 1
        self.members[here].discard(d)
        self.members[m].add(d)
        self.node_of[d] = m

    def _swap(self, a: int, b: int, touched: list[int]) -> None:
        ma, mb = int(self.node_of[a]), int(self.node_of[b])
        self._move(a, mb)
        self._move(b, ma)
        for u in touched:
            self.cs[u] = self._cross(u)

    def _key(self) -> tuple[float, int, float]:
        top = float(self.cs.max())
        return (top, int(np.sum(self.cs > top - _EPS)), float(self.cs.sum()))

    def _key_after(self, now, olds: list[float], touched: list[int]) -> tuple[float, int, float]:
        """``_key()`` after a swap that changed the shares of ``touched`` only (from ``olds``);
        no full scan unless every device at the largest share was touched."""
        news = [float(self.cs[u]) for u in touched]
        top, count, total = now
        untouched = count - sum(v > top - _EPS for v in olds)
        if untouched == 0:
            return self._key()
        total += sum(news) - sum(olds)
        high = max(top, max(news))
        if high > top:
            return (high, sum(v > high - _EPS for v in news), total)
        return (top, untouched + sum(v > top - _EPS for v in news), total)


def align_nodes(
    old_table: np.ndarray, new: np.ndarray, num_experts: int, devices_per_node: int
) -> np.ndarray:
    """``flat.align`` that keeps ``new``'s nodes (consecutive blocks of ``G`` devices) whole.

    Args:
      old_table: ``[N, S]`` current experts per device.
      new: ``[N, S]`` packed experts per device, grouped into nodes (``group_nodes``).
      num_experts: ``E``.
      devices_per_node: ``G``; ``N`` a multiple of it (else ``flat.align`` is the one to use).

    Returns:
      ``[P]`` int64 slot-to-expert table: ``new``'s nodes permuted onto old nodes, its devices
      permuted within their node, slots ordered (staying experts keep their slot).
    """
    n, s = new.shape
    g = devices_per_node
    if n % g:
        raise ValueError(f"N={n} is not a multiple of devices_per_node={g}")
    m = n // g
    node = match_devices(old_table.reshape(m, g * s), new.reshape(m, g * s), num_experts)
    placed = np.empty_like(new).reshape(m, g, s)
    placed[node] = new.reshape(m, g, s)  # packed node b now sits in old node node[b]
    placed = placed.reshape(n, s)
    # Devices within their node: experts renamed per node so that only same-node ones match.
    groups = np.arange(n) // g
    offset = (groups * num_experts)[:, None]
    pairs = np.stack([old_table + offset, placed + offset])  # [2, N, S] (node, expert) ids
    ids = unique_ints(pairs)
    dense = np.searchsorted(ids, pairs)  # renumbered 0 .. #pairs - 1
    device = match_devices(dense[0], dense[1], ids.size, groups)
    return order_slots(old_table, placed, device)
