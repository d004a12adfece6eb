"""Helpers the packers share: pair splits, device matching, node packing, replica candidates.

Shape letters: ``E`` experts, ``N`` devices, ``S`` slots per device, ``G`` devices per node,
``M`` nodes, ``Q`` experts per node, ``C`` candidate splits of a device pair, ``R`` pairs.

* Pair re-splits (``splits``, ``larger_side``, ``duplicate_splits``): every packer refines by
  re-splitting the ``2S`` replicas of two devices; these give the ways to split, the larger
  load of each, and the splits that would put one expert twice on a device.
* Relabelling (``unique_ints``, ``match_devices``, ``order_slots``): a packing's devices and
  slots mapped onto the current placement so that experts stay where they are.
* Packing inside nodes (``candidate_replicas``, ``pack_nodes``): replica counts per node and the
  node's replicas dealt to its ``G`` devices, for the packers by node and by group.

Plain numpy; no jax.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

_MAX_SPLITS = 256  # above this many 2S-item splits per pair, only single swaps are tried
# Above this many slots per device, single swaps only between the first ``_SWAP_SIDE`` positions
# of each side, which ``movable_first`` fills with replicas spread over the side's weights: the
# ``S^2`` swaps of every pair (a ``[C, 2S]`` mask, ``[R, C]`` loads) grow as ``S^3`` per pair, and
# 65,536 experts on 8 devices (``S = 8193``) would need a mask of 1.1 TB.
_SWAP_SIDE = 64
_NODE_PASSES = 16  # pairwise re-split passes per node at most (``pack_nodes``)


# -- pair re-splits -----------------------------------------------------------------------------


@functools.cache
def splits(s: int) -> np.ndarray:
    """``[C, 2S]`` bool: the ways to split a pair's ``2S`` replicas into two devices of ``S``
    (side A always holds replica 0, since the two devices are interchangeable; the first split
    is the current one). Past ``_MAX_SPLITS``: the current split and every single swap; past
    ``_SWAP_SIDE`` slots, the single swaps between the first ``_SWAP_SIDE`` positions of each
    side (the caller orders them with ``movable_first``)."""
    if math.comb(2 * s, s) // 2 <= _MAX_SPLITS:
        sides = [c for c in itertools.combinations(range(2 * s), s) if c[0] == 0]
        mask = np.zeros((len(sides), 2 * s), bool)
        for row, side in enumerate(sides):
            mask[row, list(side)] = True
        return mask
    k = min(s, _SWAP_SIDE)
    a, b = np.repeat(np.arange(k), k), np.tile(np.arange(k), k)  # sorted, as the loop was
    mask = np.zeros((1 + k * k, 2 * s), bool)
    mask[:, :s] = True
    mask[np.arange(1, 1 + k * k), a] = False
    mask[np.arange(1, 1 + k * k), s + b] = True
    return mask


def movable_first(item_w: np.ndarray) -> np.ndarray | None:
    """``[R, 2S]`` a permutation within each side of each pair that puts ``_SWAP_SIDE``
    replicas first, spread evenly over the side's weights (heaviest, lightest and between), so
    that ``splits``' single swaps between them can move any amount; None when ``S`` is at most
    ``_SWAP_SIDE`` (every swap is tried, nothing to order)."""
    s = item_w.shape[1] // 2
    if s <= _SWAP_SIDE:
        return None
    pick = np.unique(np.linspace(0, s - 1, _SWAP_SIDE).round().astype(np.int64))
    rest = np.setdiff1d(np.arange(s), pick)
    out = []
    for side in (item_w[:, :s], item_w[:, s:]):
        by_weight = np.argsort(-side, axis=1, kind="stable")  # [R, S] positions, heaviest first
        out.append(by_weight[:, np.concatenate([pick, rest])] + (s if out else 0))
    return np.concatenate(out, axis=1)


def take_pairs(perm: np.ndarray | None, *arrays: np.ndarray):
    """Each ``[R, 2S]`` array reordered by ``perm`` (``movable_first``); as given when None."""
    if perm is None:
        return arrays
    return tuple(np.take_along_axis(a, perm, axis=1) for a in arrays)


def larger_side(weights: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``[R, C]`` the larger of the two devices' loads under each split of each pair.

    Args:
      weights: ``[R, 2S]`` rows (or any per-slot figure) of each device pair's replicas.
      mask: ``[C, 2S]`` bool splits (``splits``): side A, the other side B.
    """
    s = mask.shape[1] // 2
    if s > _SWAP_SIDE and mask.shape[0] == 1 + _SWAP_SIDE**2:  # ``splits``' single swaps
        a = np.repeat(np.arange(_SWAP_SIDE), _SWAP_SIDE)
        b = s + np.tile(np.arange(_SWAP_SIDE), _SWAP_SIDE)
        current = weights[:, :s].sum(axis=1, keepdims=True)
        moved = np.concatenate([np.zeros((weights.shape[0], 1)), weights[:, b] - weights[:, a]], 1)
        side_a = current + moved  # the [C, 2S] matmul costs 1.1 TFLOP per pass at S = 8193
    else:
        side_a = weights @ mask.T
    return np.maximum(side_a, weights.sum(axis=1, keepdims=True) - side_a)


def duplicate_splits(items: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``[R, C]`` bool: split ``c`` (a row of ``mask``, ``splits``) of pair ``r`` puts one expert
    twice on a device. Only pairs holding some expert twice can; the others are not searched.

    Args:
      items: ``[R, 2S]`` experts of each device pair (ids < 0 must be distinct).
      mask: ``[C, 2S]`` bool splits.
    """
    out = np.zeros((items.shape[0], mask.shape[0]), bool)
    grouped = np.sort(items, axis=1)
    repeated = np.flatnonzero(np.any(grouped[:, 1:] == grouped[:, :-1], axis=1))
    if repeated.size:
        out[repeated] = _has_duplicates(items[repeated], mask)
    return out


def _has_duplicates(items: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``[half, C]`` bool: split ``c`` of pair ``i`` puts one expert twice on a device.

    A split does exactly when two positions ``j < k`` of the pair hold the same expert and it
    puts them on the same side: the (few) equal position pairs are looked up in a table of
    which splits keep them together, instead of sorting both sides of every split."""
    half, two_s = items.shape
    row, j, k = _equal_positions(items)
    dup = np.zeros((half, mask.shape[0]), bool)
    if row.size:
        together = mask[:, j] == mask[:, k]  # [C, pairs]
        starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
        dup[row[starts]] = np.logical_or.reduceat(together, starts, axis=1).T
    return dup


def _equal_positions(items: np.ndarray):
    """``(row, j, k)``: every pair of positions ``j < k`` of a row holding the same item, sorted
    by row, then ``j``, then ``k`` (``np.nonzero`` of the ``[R, 2S, 2S]`` equality, without
    building it: a sort of each row, runs of equal items paired up)."""
    r, w = items.shape
    order = np.argsort(items, axis=1, kind="stable")  # equal items: ascending positions
    grouped = np.take_along_axis(items, order, 1)
    rows, js, ks = [], [], []
    same = np.ones((r, w), bool)
    for d in range(1, w):
        same = same[:, :-1] & (grouped[:, d:] == grouped[:, :-d])  # i and i + d in one run
        if not same.any():
            break
        row, i = np.nonzero(same)
        rows.append(row)
        js.append(order[row, i])
        ks.append(order[row, i + d])
    if not rows:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    row, j, k = (np.concatenate(x) for x in (rows, js, ks))
    j, k = np.minimum(j, k), np.maximum(j, k)
    sort = np.lexsort((k, j, row))
    return row[sort], j[sort], k[sort]


# -- relabelling -------------------------------------------------------------------------------


def unique_ints(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values of an int array: ``np.unique`` by sorting (numpy 2.4's default,
    hash-based ``np.unique`` took ~0.9 ms on 6144 ints on the development VM, this ~0.09)."""
    values = np.sort(values, axis=None)
    return values[np.concatenate([[True], values[1:] != values[:-1]])]


def match_devices(
    old_table: np.ndarray, new: np.ndarray, num_experts: int, groups: np.ndarray | None = None
) -> np.ndarray:
    """``[N]`` old device for each packed device, maximising (greedily) the shared experts.

    ``groups`` (``[N]``, optional): devices left without a shared expert are matched within
    their group (packed device ``b`` to an old device of group ``groups[b]``); the caller makes
    sure that shared experts only occur within a group.
    """
    n, s = new.shape
    old_keys = unique_ints(np.arange(n)[:, None] * num_experts + old_table)  # (device, expert)
    old_dev, old_exp = old_keys // num_experts, old_keys % num_experts
    by_expert = np.argsort(old_exp, kind="stable")
    start = np.searchsorted(old_exp[by_expert], np.arange(num_experts + 1))
    items = new.reshape(-1)  # [P]
    bins = np.repeat(np.arange(n), s)
    reps = start[items + 1] - start[items]  # old devices holding each packed replica's expert
    pos = np.repeat(start[items] - np.cumsum(reps) + reps, reps) + np.arange(reps.sum())
    pairs, shared = np.unique(
        np.repeat(bins, reps) * n + old_dev[by_expert][pos], return_counts=True
    )
    order = np.argsort(-shared, kind="stable")
    bins, olds = pairs[order] // n, pairs[order] % n  # candidate pairs, most shared first
    device = np.full(n, -1, np.int64)
    taken = np.zeros(n, bool)
    while bins.size:
        # Accept every pair that is the best remaining one of both its packed and old device.
        first_bin = np.zeros(bins.size, bool)
        first_bin[np.unique(bins, return_index=True)[1]] = True
        first_old = np.zeros(bins.size, bool)
        first_old[np.unique(olds, return_index=True)[1]] = True
        accept = first_bin & first_old
        device[bins[accept]], taken[olds[accept]] = olds[accept], True
        keep = (device[bins] < 0) & ~taken[olds]
        bins, olds = bins[keep], olds[keep]
    free_bins, free_olds = np.flatnonzero(device < 0), np.flatnonzero(~taken)
    if groups is not None:  # the same number of each group's devices is left on both sides
        free_bins = free_bins[np.argsort(groups[free_bins], kind="stable")]
        free_olds = free_olds[np.argsort(groups[free_olds], kind="stable")]
    device[free_bins] = free_olds
    return device


def order_slots(old_table: np.ndarray, new: np.ndarray, device: np.ndarray) -> np.ndarray:
    """Puts packed device ``b`` at ``device[b]`` and keeps each staying expert in its old slot.

    Args:
      old_table: ``[N, S]`` current experts per device.
      new: ``[N, S]`` packed experts per device.
      device: ``[N]`` permutation, the old device each packed device becomes.

    Returns:
      ``[P]`` int64 slot-to-expert table.
    """
    n, s = new.shape
    out = np.empty_like(new)
    out[device] = new
    # Within each device: an expert that was in old slot k stays in slot k. The i-th old slot
    # of expert e on a device (in slot order) keeps the i-th of its packed replicas there.
    # Vectorised: (device, expert, i) keys of both sides intersected (not S passes over [N, S]).
    low = min(int(old_table.min(initial=0)), int(out.min(initial=0)))
    span = max(int(old_table.max(initial=0)), int(out.max(initial=0))) - low + 1
    rows = np.repeat(np.arange(n, dtype=np.int64), s)

    def keys(table):
        key = rows * span + (table.reshape(-1).astype(np.int64) - low)
        order = np.argsort(key, kind="stable")  # equal keys: ascending slot
        key = key[order]
        start = np.r_[True, key[1:] != key[:-1]]
        rank = np.arange(key.size) - np.maximum.accumulate(np.where(start, np.arange(key.size), 0))
        return key * s + rank, order

    old_keys, old_order = keys(old_table)
    new_keys, new_order = keys(out)
    _, i_old, i_new = np.intersect1d(old_keys, new_keys, assume_unique=True, return_indices=True)
    slot, packed = old_order[i_old], new_order[i_new]
    flat = out.reshape(-1)
    result = np.empty(n * s, np.int64)
    filled, used = np.zeros(n * s, bool), np.zeros(n * s, bool)
    result[slot], filled[slot], used[packed] = flat[packed], True, True
    result[~filled] = flat[~used]  # row-major: the rest, in order, per device
    return result


# -- packing inside nodes ----------------------------------------------------------------------


def candidate_replicas(
    node_counts: np.ndarray, budget: np.ndarray, cap: np.ndarray, every_split: bool = False
) -> list[np.ndarray]:
    """Replica-count candidates for packing each node's experts into its slots.

    The ``j`` coldest experts of each node split two or three ways (they give every device
    small pieces to fill up with, ``flat.replica_counts`` explains why they pack better), the
    other spare slots by highest averages (largest ``n_e / r_e`` first, at most ``cap``
    replicas). The splits take at most two thirds of a node's spare slots: beyond, the hottest
    experts keep too few replicas (on the simulator's traces no node ever chose more).

    Args:
      node_counts: ``[M, Q]`` rows of each node's experts.
      budget: ``[M]`` slots of each node's experts.
      cap: ``[M]`` most replicas of one expert (the split cold ones excepted).
      every_split: try every ``j``; else a coarse grid (all of 0..3, then quarters of the
        most), as each candidate costs a full packing.

    Returns:
      ``[M, Q]`` int64 replica counts per candidate, each summing to ``budget`` per node.
    """
    m, q = node_counts.shape
    spare = budget - q  # [M]
    rows = np.arange(m)
    coldest = np.argsort(node_counts, axis=1, kind="stable")
    out = []
    for ways in (2, 3):
        limit = np.minimum(2 * spare // (3 * (ways - 1)), q)  # [M] cold splits at most
        first = 0 if ways == 2 else 1  # (j = 0 is the same candidate for both)
        top = int(limit.max())
        grid = set(range(top + 1) if every_split else range(min(top, 3) + 1))
        if not every_split:
            grid |= {round(top * f / 4) for f in range(1, 5)}
        for j in sorted(grid - set(range(first))):
            split = np.minimum(j, limit)  # [M]
            r = np.ones((m, q), np.int64)
            cold = np.arange(q)[None, :] < split[:, None]
            r[rows[:, None], coldest] = np.where(cold, ways, 1)
            out.append(r + _highest_averages(node_counts, r, spare - split * (ways - 1), cap))
    return out


def _highest_averages(node_counts, r, left, cap) -> np.ndarray:
    """``[M, Q]`` replicas added to ``r``: each node's ``left [M]`` largest ``n_e / (r_e + k)``,
    ``k >= 0`` (so one expert's next replicas come in order), with ``r_e + k < cap [M]``."""
    m, q = r.shape
    k = np.arange(int(cap.max()))
    priority = node_counts[:, :, None] / (r[:, :, None] + k)  # [M, Q, cap]
    priority = np.where(r[:, :, None] + k < cap[:, None, None], priority, -np.inf)
    order = np.argsort(-priority.reshape(m, -1), axis=1, kind="stable")[:, : int(left.max())]
    take = np.arange(order.shape[1]) < left[:, None]  # [M, max left]
    expert = np.arange(m)[:, None] * q + order // k.size
    return np.bincount(expert[take], minlength=m * q).reshape(m, q)


def pack_nodes(
    weights: np.ndarray,
    ids: np.ndarray,
    g: int,
    s: int,
    blocks: int = 1,
    passes: int = _NODE_PASSES,
):
    """``[K, G·S]`` replicas into ``[K, G, S]`` devices per node; returns the experts and the
    rows of every slot. Largest first, each round of ``G`` replicas with the lightest to the
    busiest device so far, then at most ``passes`` passes of pairwise re-splits of each node's
    heaviest and lightest devices. The ``K`` nodes are
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
        table, slot_w = _resplit_node_pairs(table, slot_w, shift)
        keep = np.repeat(active, k // blocks)  # [K] nodes of the blocks this pass counts for
        out_table = np.where(keep[:, None, None], table, out_table)
        out_w = np.where(keep[:, None, None], slot_w, out_w)
        top = block_max(slot_w)
        active &= top < best
        if not active.any():
            break
        best = np.where(active, top, best)
    return out_table, out_w


def _resplit_node_pairs(table: np.ndarray, slot_w: np.ndarray, shift: int):
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
    items, item_w = take_pairs(movable_first(item_w), items, item_w)
    mask = splits(s)  # [C, 2S]
    larger = larger_side(item_w, mask)  # [M·G/2, C]
    worst = np.where(duplicate_splits(items, mask), np.inf, larger)
    worst[:, 0] = larger[:, 0]  # the current split is always allowed
    pick = mask[np.argmin(worst, axis=1)]  # [M·G/2, 2S]
    table, slot_w = table.copy(), slot_w.copy()
    table[rows, heavy] = items[pick].reshape(m, half, s)
    table[rows, light] = items[~pick].reshape(m, half, s)
    slot_w[rows, heavy] = item_w[pick].reshape(m, half, s)
    slot_w[rows, light] = item_w[~pick].reshape(m, half, s)
    return table, slot_w
