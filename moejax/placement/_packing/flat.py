"""Global re-pack for the planner: replica counts, a balanced packing, and a sticky relabelling.

Shape letters: ``E`` experts, ``N`` devices, ``S`` slots per device, ``P = N·S`` slots, ``C``
candidate splits of a device pair.

Every function here is vectorised numpy over all devices at once (no per-slot Python loop), so a
re-pack of ``P = 6144`` slots takes milliseconds:

1. ``replica_counts``: replica counts ``r_e``, the best-packing of a few apportionments
   (``apportion``: highest averages, smallest largest ``n_e / r_e``; other divisor methods; the
   coldest experts split ``k`` ways).
2. ``pack``: the ``P`` replicas, of weight ``n_e / r_e`` each, into ``N`` devices of exactly ``S``
   slots: balanced largest differencing (Karmarkar-Karp for a fixed number of items per device),
   then pairwise rebalancing passes (the busiest devices paired with the least busy; each pair's
   ``2S`` replicas re-split optimally, vectorised over all pairs). A second start, EPLB-style
   greedy (after DeepSeek EPLB's balanced packing: heaviest replica first into the least loaded
   open device; a heap, ~1 us per replica), gets the same passes and is kept when its busiest
   device is strictly lighter (``pack_starts`` gives both to the planner, which weighs them by
   modeled step). Over 24 Zipf shapes (``experiments/bench_planner.py --compare-greedy``) the
   refined greedy start was lighter on 4, differencing on 18; greedy alone on none.
3. ``align``: permutes the packed devices (and the slots within a device) onto the current
   placement so that as many slots as possible keep their expert (less migration).

Plain numpy; no jax.
"""

from __future__ import annotations

import heapq
from typing import Literal

import numpy as np

from moejax.placement._packing.common import (
    duplicate_splits,
    larger_side,
    match_devices,
    movable_first,
    order_slots,
    splits,
    take_pairs,
)
from moejax.placement.cost_model import packed_buffer

_REFINE = 3  # cold-split counts tried between the best grid point's neighbours
_MAX_PASSES = 16  # pairwise rebalancing passes at most
_STALL_PASSES = 2  # stop after this many passes without a lower maximum


def apportion(counts: np.ndarray, num_slots: int, max_replicas: int | None = None) -> np.ndarray:
    """Replica counts ``[E]`` (each >= 1, summing to ``P``) minimising the largest ``n_e / r_e``.

    Highest-averages apportionment: the ``P - E`` spare slots go one by one to the expert with
    the largest current rows per replica, which is optimal for that objective. Computed at once:
    the ``k``-th spare slot of expert ``e`` has priority ``n_e / k``, and the spare slots are the
    ``P - E`` highest priorities (ties to the lowest expert id). With ``max_replicas`` (the
    planner passes ``N``: more replicas than devices cannot all sit on distinct devices),
    experts at the cap get no more slots unless every expert is capped.

    Args:
      counts: ``[E]`` rows per expert.
      num_slots: ``P >= E``.
      max_replicas: optional cap on any ``r_e``.

    Returns:
      ``[E]`` int64 replica counts.
    """
    counts = np.asarray(counts, np.float64)
    if num_slots < counts.shape[0]:
        raise ValueError(f"num_slots must be >= E={counts.shape[0]}, got {num_slots}")
    return _divisor_method(counts, num_slots, num_slots if max_replicas is None else max_replicas)


def _divisor_method(counts: np.ndarray, num_slots: int, cap: int, offset: float = 0.0):
    """Divisor-method apportionment: spare slot ``k`` of expert ``e`` has priority
    ``n_e / (k + offset)`` (offset 0: smallest largest replica; 0.5: Sainte-Lague; 1: D'Hondt).
    Returns ``[E]`` int64 replica counts, capped at ``cap`` unless every expert is capped."""
    num_experts = counts.shape[0]
    spare = num_slots - num_experts
    total = float(counts.sum())
    r = np.ones(num_experts, np.int64)
    if spare > 0 and total > 0:
        # Every priority above the threshold is taken and sum_e (n_e / t - offset - 1) = spare
        # at t = floor, so the threshold is >= floor: list the priorities >= floor, pick the
        # spare-th largest.
        floor = total / (num_slots + offset * num_experts)
        most = np.clip(np.floor(counts / floor - offset), 0, cap - 1).astype(np.int64)  # [E]
        owner = np.repeat(np.arange(num_experts), most)
        k = np.arange(owner.size) - np.repeat(np.cumsum(most) - most, most) + 1  # 1..most_e
        priority = counts[owner] / (k + offset)
        if priority.size > spare:
            threshold = np.partition(priority, priority.size - spare)[priority.size - spare]
            r += np.bincount(owner[priority > threshold], minlength=num_experts)
        else:
            r += most
    while r.sum() < num_slots:  # ties at the threshold, caps, zero counts: next priority first
        open_ = np.flatnonzero(r < cap)
        if open_.size == 0:
            r[np.argmin(r)] += 1
            continue
        order = open_[np.argsort(-counts[open_] / (r[open_] + offset), kind="stable")]
        r[order[: num_slots - r.sum()]] += 1
    return r


def replica_counts(
    counts: np.ndarray,
    num_devices: int,
    slots_per_device: int,
    sync_rows: float = 0.0,
    sync: str = "holders",
) -> np.ndarray:
    """Replica counts ``[E]`` for ``pack``, chosen among a few apportionments by packed balance.

    ``apportion`` minimises the largest replica, which is not the same as packing well into
    exactly ``S`` slots per device. With ``E = 2N`` and ``S = 3`` it leaves more unsplit experts
    than devices, so some device holds two of them plus a third replica (5% to 13% over the mean
    at ``N = 2048``); that device balances only if its third replica is small, which splitting
    one of the coldest experts ``k`` ways provides. Candidates, each packed by balanced
    differencing alone (about a millisecond at ``P = 6144``), the best one kept:

    * ``apportion`` itself, and the Sainte-Lague and D'Hondt divisor methods;
    * the ``c`` coldest experts split ``k`` ways and the rest apportioned, for ``k = 2`` and the
      ``k`` that makes a replica of the coldest expert fit beside two of the smallest unsplit
      experts, ``c`` on a doubling grid up to ``N / 4``, refined around the best.

    Replicas on different devices are not free: their gradients are combined every step. With
    ``sync_rows > 0`` a candidate's score is its packed maximum plus ``sync_rows`` x the busiest
    device's share of the ring all-reduces, ``sum 2 (r_e - 1) / r_e`` over the replicated
    experts it holds (``sync="packed"``: every device's share is ``2 (N - 1) / N`` x the packed
    buffer of the ``m`` experts with ``r_e > 1``, ``cost_model.packed_buffer``: the training
    step's all-reduce); and candidates that leave spare slots to ``fill_spare`` (a duplicate on
    the same device, no sync) are tried too: the ``B`` highest apportionment priorities only,
    ``B`` on a doubling grid below ``P - E``.

    Args:
      counts: ``[E]`` rows per expert (float64).
      num_devices: ``N``.
      slots_per_device: ``S``.
      sync_rows: rows the busiest device computes and exchanges in the time one device sends
        a whole expert gradient in the replica all-reduce (``cost_model.rows_per_gradient``);
        0 to balance rows alone.
      sync: ``Workload.replica_sync``, ``"holders"`` or ``"packed"``.

    Returns:
      ``[E]`` int64 replica counts, each in ``[1, N]`` unless every expert is capped, summing to
      ``P`` (always when ``sync_rows == 0``) or less (the rest of the slots for ``fill_spare``).
    """
    num_experts, num_slots = counts.shape[0], num_devices * slots_per_device
    coldest = np.argsort(counts, kind="stable")

    def packed_max(r: np.ndarray) -> float:
        # The replicas heaviest first, ties by expert id: sorting the E experts and repeating
        # each r_e times is that order (a stable sort of the P replicas, at 2/3 of the cost).
        per_replica = counts / r
        order = np.argsort(-per_replica, kind="stable")
        weights = np.repeat(per_replica[order], r[order])
        spare = np.zeros(num_slots - weights.size)  # fill_spare's slots, last among equals
        table, loads = _differencing(np.concatenate([weights, spare]), num_devices)
        if sync_rows <= 0:
            return float(loads.max())
        if sync == "packed":  # replicas of one expert land on distinct devices when balanced
            b = packed_buffer(int(np.sum(r > 1)), num_slots, num_experts)
            return float(loads.max() + sync_rows * 2.0 * (num_devices - 1) / num_devices * b)
        share = np.repeat(np.where(r > 1, 2.0 * (r - 1) / r, 0.0)[order], r[order])
        share = np.concatenate([share, spare])[table].sum(axis=1)  # [N]
        return float(loads.max() + sync_rows * share.max())

    def split_cold(k: int, c: int) -> np.ndarray:
        r = np.full(num_experts, k, np.int64)
        rest = coldest[c:]
        r[rest] = _divisor_method(counts[rest], num_slots - k * c, num_devices)
        return r

    tried = [_divisor_method(counts, num_slots, num_devices, off) for off in (0.0, 0.5, 1.0)]
    scores = [packed_max(r) for r in tried]
    for k in _cold_split_ways(counts, num_devices):
        # c < E: at least one expert is apportioned the slots the split ones leave
        limit = min(num_devices // 4, (num_slots - num_experts) // (k - 1), num_experts - 1)
        grid = sorted({0, limit} | {2**i for i in range(limit.bit_length()) if 2**i <= limit})
        by_c = {0: (scores[0], tried[0])}  # c = 0 is plain apportion
        for c in grid[1:]:
            r = split_cold(k, c)
            by_c[c] = (packed_max(r), r)
        i = grid.index(min(by_c, key=lambda c: (by_c[c][0], c)))
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        for c in np.unique(np.linspace(lo, hi, _REFINE + 2).round().astype(int)).tolist():
            if c not in by_c:
                r = split_cold(k, c)
                by_c[c] = (packed_max(r), r)
        score, r = min(by_c.values(), key=lambda item: item[0])
        scores.append(score)
        tried.append(r)
    if sync_rows > 0:  # fewer replicas across devices, the other spare slots duplicated in place
        least = max(num_devices - num_experts, 0)  # every device needs one expert of its own
        top = num_slots - num_experts
        grid = {least} | {2**i for i in range(top.bit_length()) if 2**i > least}
        for extra in sorted(x for x in grid if x < top):
            r = _divisor_method(counts, num_experts + extra, num_devices)
            scores.append(packed_max(r))
            tried.append(r)
    return tried[int(np.argmin(scores))]


def fill_spare(table: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """Fills the empty slots (ids < 0) of a packing with duplicates of an expert of the device.

    A duplicate of an expert the device alone holds (``replicas[e] == 1``) changes nothing: the
    expert's rows stay on that device, split over two of its slots, and nothing is synced. A
    device holding only replicated experts duplicates its first one (which then takes a larger
    share of that expert's rows); one holding nothing gets expert 0.

    Args:
      table: ``[N, S]`` experts per device, ids < 0 for empty slots.
      replicas: ``[E]`` devices holding each expert in ``table``.

    Returns:
      ``[N, S]`` int64 experts per device, every slot filled.
    """
    real = table >= 0
    own = real & (replicas[np.maximum(table, 0)] == 1)
    column = np.where(own.any(axis=1), np.argmax(own, axis=1), np.argmax(real, axis=1))
    host = np.where(real.any(axis=1), table[np.arange(table.shape[0]), column], 0)
    return np.where(real, table, host[:, None]).astype(np.int64)


def _cold_split_ways(counts: np.ndarray, num_devices: int) -> list[int]:
    """``k`` values for ``replica_counts``: 2, and the smallest ``k`` with ``n_min / k`` fitting
    beside two replicas of ``n_min`` rows within 1% of the mean device load ``M``."""
    if num_devices < 2:
        return []
    positive = counts[counts > 0]
    n_min = float(positive.min()) if positive.size else 0.0
    room = 1.01 * counts.sum() / num_devices - 2.0 * n_min
    ways = {2}
    if n_min > 0 and room > 0:
        ways.add(int(min(num_devices, max(2, np.ceil(n_min / room)))))
    return sorted(ways)


def pack(
    weights: np.ndarray,
    experts: np.ndarray,
    num_devices: int,
    method: Literal["best", "differencing", "greedy"] = "best",
) -> np.ndarray:
    """Packs ``P`` replicas into ``N`` devices of exactly ``S = P / N`` slots, balancing loads.

    Two starts, each refined by the same pairwise rebalancing passes: balanced largest
    differencing (``_differencing``) and EPLB-style greedy (``_greedy``: heaviest replica first
    into the least loaded device that is not full). ``"best"`` keeps the refined greedy packing
    only when its busiest device is strictly lighter (ties: differencing, the original packer).

    Args:
      weights: ``[P]`` rows of each replica (``n_e / r_e``).
      experts: ``[P]`` expert of each replica.
      num_devices: ``N`` (divides ``P``).
      method: ``"best"`` (both starts, the better kept), ``"differencing"`` or ``"greedy"``.

    Returns:
      ``[N, S]`` int64 experts per device. Replicas of one expert normally land on distinct
      devices: the rebalancing and the greedy start never add two on one device (unless every
      open device already holds the expert), the differencing start rarely does (two on one
      device are still a valid placement, merely less useful).
    """
    if method not in ("best", "differencing", "greedy"):
        raise ValueError(f"method must be 'best', 'differencing' or 'greedy', got {method!r}")
    if method != "best":
        return pack_starts(weights, experts, num_devices, (method,))[0][0]
    (first, first_max), (second, second_max) = pack_starts(weights, experts, num_devices)
    return second if second_max < first_max * (1.0 - 1e-12) else first


def pack_starts(
    weights: np.ndarray,
    experts: np.ndarray,
    num_devices: int,
    starts: tuple[str, ...] = ("differencing", "greedy"),
) -> list[tuple[np.ndarray, float]]:
    """``pack``'s candidates: for each start, ``[N, S]`` experts per device and the busiest
    device's rows, in the order of ``starts`` (``"differencing"``, ``"greedy"``), each refined
    by the pairwise rebalancing passes. The planner weighs them by modeled step time."""
    order = np.argsort(-weights, kind="stable")
    weights, experts = weights[order], experts[order]
    out = []
    for start in starts:
        if start == "differencing":
            table, loads = _differencing(weights, num_devices)  # [N, S] replica indices
        else:
            table, loads = _greedy(weights, experts, num_devices)
        tab, loads = _refine(experts[table], weights[table], loads)
        out.append((tab, float(loads.max())))
    return out


def greedy_pack(weights: np.ndarray, experts: np.ndarray, num_devices: int) -> np.ndarray:
    """EPLB-style greedy packing alone (no rebalancing passes): ``[N, S]`` experts per device.

    Args and replica order as ``pack``; see ``_greedy``."""
    order = np.argsort(-weights, kind="stable")
    table, _ = _greedy(weights[order], experts[order], num_devices)
    return experts[order][table]


def _refine(tab: np.ndarray, w: np.ndarray, loads: np.ndarray):
    """Pairwise rebalancing passes (``_rebalance_pairs``) until ``_STALL_PASSES`` passes without
    a lower maximum; returns ``[N, S]`` experts and ``[N]`` loads (the maximum never rises)."""
    best = loads.max()
    stall = 0
    for shift in range(_MAX_PASSES):
        tab, w, loads = _rebalance_pairs(tab, w, loads, shift)
        if loads.max() < best * (1.0 - 1e-12):
            best, stall = loads.max(), 0
        else:
            stall += 1
            if stall >= _STALL_PASSES:
                break
    return tab, loads


def _greedy(weights: np.ndarray, experts: np.ndarray, num_devices: int):
    """Greedy packing after DeepSeek EPLB's balanced packing: replicas in the given order
    (heaviest first) each go to the least loaded device with a free slot (ties: the lowest
    device), skipping devices that already hold the replica's expert unless all open ones do.
    A heap of open devices, one pop and push per replica (~1 us each: ~0.5 ms at ``P = 512``).
    Returns replica indices ``[N, S]`` and loads ``[N]``."""
    s = weights.shape[0] // num_devices
    heap = [(0.0, d) for d in range(num_devices)]  # (load, device) of devices with free slots
    slots: list[list[int]] = [[] for _ in range(num_devices)]
    held: list[set[int]] = [set() for _ in range(num_devices)]
    loads = [0.0] * num_devices
    for i, (w, e) in enumerate(zip(weights.tolist(), experts.tolist(), strict=True)):
        skipped = []
        load, d = heapq.heappop(heap)
        while e in held[d] and heap:  # a device holding e: the next lightest one
            skipped.append((load, d))
            load, d = heapq.heappop(heap)
        if e in held[d] and skipped:  # every open device holds e: the lightest of them
            skipped.append((load, d))
            skipped.sort()
            load, d = skipped.pop(0)
        for item in skipped:
            heapq.heappush(heap, item)
        slots[d].append(i)
        held[d].add(e)
        loads[d] = load + w
        if len(slots[d]) < s:
            heapq.heappush(heap, (loads[d], d))
    return np.asarray(slots, np.int64).reshape(num_devices, s), np.asarray(loads)


def _differencing(weights: np.ndarray, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Balanced largest differencing: ``S`` partial packings of ``N`` sorted replicas each are
    merged two at a time (the two with the widest load spread first), heaviest devices of one
    with the lightest of the other. Returns replica indices ``[N, S]`` and loads ``[N]``."""
    s = weights.shape[0] // num_devices
    # The parts by spread, widest first, ties to the latest made (a stable sort of a list each
    # round would be the same order; a heap keeps the S rounds at O(S log S), not O(S^2)). Each
    # merge records only the row orders it used, the [N, S] table is read off the tree at the
    # end (rebuilding every merged part's index array costs O(S^2 N) when one part keeps
    # growing).
    heap, loads, children = [], [], []
    for k in range(s):
        part = weights[k * num_devices : (k + 1) * num_devices]
        loads.append(part)
        children.append(None)
        heap.append((-(part.max() - part.min()), -k))
    heapq.heapify(heap)
    while len(heap) > 1:
        a, b = -heapq.heappop(heap)[1], -heapq.heappop(heap)[1]
        up, down = np.argsort(loads[a], kind="stable"), np.argsort(-loads[b], kind="stable")
        merged = loads[a][up] + loads[b][down]
        loads.append(merged)
        children.append((a, up, b, down))
        loads[a] = loads[b] = None
        heapq.heappush(heap, (-(merged.max() - merged.min()), -(len(loads) - 1)))
    root = -heap[0][1]
    table = np.empty((num_devices, s), np.int64)
    column = 0
    stack = [(root, np.arange(num_devices))]  # (part, its row of each table row)
    while stack:
        node, rows = stack.pop()
        if children[node] is None:
            table[:, column] = node * num_devices + rows
            column += 1
            continue
        a, up, b, down = children[node]
        stack.append((b, down[rows]))  # popped after a: a's columns come first
        stack.append((a, up[rows]))
    return table, loads[root]


def rebalance(table: np.ndarray, weights: np.ndarray, target: float, rounds: int) -> np.ndarray:
    """Migration-light repair: the busiest device swaps replicas with its best partner.

    Each round takes the busiest device and, over every other device and every split of the
    pair's ``2S`` replicas into two devices of ``S``, applies the split with the lowest pair
    maximum (vectorised over the ``N - 1`` partners); replica counts are unchanged, so only
    the two devices of a round exchange experts. It stops once every device is within
    ``target``, when the busiest device cannot be lowered, or after ``rounds`` rounds.

    Args:
      table: ``[N, S]`` experts per device.
      weights: ``[N, S]`` rows of each slot.
      target: load to get every device under.
      rounds: most rounds.

    Returns:
      ``[N, S]`` experts per device.
    """
    n, s = table.shape
    tab, w = table.copy(), weights.astype(np.float64, copy=True)
    loads = w.sum(axis=1)
    mask = splits(s)  # [C, 2S]
    for _ in range(rounds):
        d = int(np.argmax(loads))
        if loads[d] <= target or n < 2:
            break
        items = np.concatenate([np.broadcast_to(tab[d], (n, s)), tab], axis=1)  # [N, 2S]
        item_w = np.concatenate([np.broadcast_to(w[d], (n, s)), w], axis=1)
        items, item_w = take_pairs(movable_first(item_w), items, item_w)
        worst = np.where(duplicate_splits(items, mask), np.inf, larger_side(item_w, mask))  # [N, C]
        worst[:, 0] = np.inf  # the current split changes nothing
        worst[d] = np.inf
        partner, split = np.unravel_index(np.argmin(worst), worst.shape)
        if not worst[partner, split] < loads[d]:
            break
        pick = mask[split]
        pair_items, pair_w = items[partner], item_w[partner]
        tab[d], tab[partner] = pair_items[pick], pair_items[~pick]
        w[d], w[partner] = pair_w[pick], pair_w[~pick]
        loads[d], loads[partner] = w[d].sum(), w[partner].sum()
    return tab


def _rebalance_pairs(tab: np.ndarray, w: np.ndarray, loads: np.ndarray, shift: int):
    """One pass: the ``N // 2`` busiest devices are paired with the least busy ones (rotated by
    ``shift`` between passes) and each pair's ``2S`` replicas are re-split to minimise the
    pair's larger load; splits that would put two replicas of one expert on a device are
    avoided unless the current split already does. Returns new ``(tab, w, loads)``."""
    n, s = tab.shape
    half = n // 2
    if half == 0:
        return tab, w, loads
    order = np.argsort(loads, kind="stable")
    heavy, light = order[::-1][:half], np.roll(order[:half], shift)
    items = np.concatenate([tab[heavy], tab[light]], axis=1)  # [half, 2S]
    item_w = np.concatenate([w[heavy], w[light]], axis=1)  # [half, 2S]
    items, item_w = take_pairs(movable_first(item_w), items, item_w)
    mask = splits(s)  # [C, 2S]
    larger = larger_side(item_w, mask)  # [half, C]
    worst = np.where(duplicate_splits(items, mask), np.inf, larger)
    worst[:, 0] = larger[:, 0]  # the current split is always allowed
    pick = mask[np.argmin(worst, axis=1)]  # [half, 2S]
    tab, w, loads = tab.copy(), w.copy(), loads.copy()
    tab[heavy], tab[light] = items[pick].reshape(half, s), items[~pick].reshape(half, s)
    w[heavy], w[light] = item_w[pick].reshape(half, s), item_w[~pick].reshape(half, s)
    loads[heavy], loads[light] = w[heavy].sum(axis=1), w[light].sum(axis=1)
    return tab, w, loads


def align(old_table: np.ndarray, new: np.ndarray, num_experts: int) -> np.ndarray:
    """Relabels the devices (and orders the slots) of a packing to keep experts where they are.

    Devices are interchangeable for balance, so packed device ``b`` is given the old device that
    already holds the most of its experts (greedy matching, most shared experts first); within a
    device, an expert that stays keeps its old slot.

    Args:
      old_table: ``[N, S]`` current experts per device.
      new: ``[N, S]`` packed experts per device (any device order).
      num_experts: ``E``.

    Returns:
      ``[P]`` int64 slot-to-expert table: ``new``'s devices permuted, slots ordered.
    """
    device = match_devices(old_table, new, num_experts)  # [N] old device of packed device b
    return order_slots(old_table, new, device)
