"""Sync-aware refinement of a packing: lowers the busiest device's replica-sync share.

Shape letters: ``E`` experts, ``N`` devices, ``S`` slots per device, ``C`` candidate splits of a
device pair.

``cost_model.replica_sync_s`` charges the busiest device's share of the ring all-reduces of the
experts replicated across devices: a device holding replicas of experts ``e`` with ``r_e >= 2``
holders sends ``sum 2 (r_e - 1) / r_e`` expert gradients. The step pays the *largest* such share
and, separately, the *largest* load; ``pack`` balances loads only, so its replicas land where
they balance best and some devices end up with two or three replicated experts (up to ~3.5
gradients at ``N = 2048``) while the mean share is ``2 (P - E) / N`` (2 at ``E = 2N, S = 3``).

``limit_sync`` moves replicas between devices, replica counts unchanged, so that neither maximum
rises and the largest share falls where it can. It alternates two vectorised pair passes
(``N / 2`` disjoint device pairs at once, each pair's ``2S`` replicas re-split over every split
of ``common.splits``):

1. **share pass**: the devices with the largest shares paired with those of the smallest; each
   pair takes the split with the smallest larger share among those whose loads stay within the
   current busiest load (ties: the smaller larger load);
2. **load pass**: the busiest devices paired with the least busy; each pair takes the split with
   the smallest larger load among those whose shares stay within the current largest share.

Either pass may keep a pair's current split, so the busiest load and the largest share never
rise: the result is at least as good as the input for every weighting of balance against sync.

Plain numpy; no jax.
"""

from __future__ import annotations

import numpy as np

from moejax.placement._packing.common import (
    duplicate_splits,
    larger_side,
    movable_first,
    splits,
    take_pairs,
)

_MAX_PASSES = 16  # alternating share + load passes at most
_STALL_PASSES = 2  # stop after this many passes that lower neither maximum


def sync_shares(table: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """``[N, S]`` expert gradients each slot sends in the replica all-reduce.

    A replica of an expert held by ``r >= 2`` devices sends ``2 (r - 1) / r`` gradients
    (``cost_model.replica_sync_s``); an unreplicated expert or an empty slot (id < 0) sends none.

    Args:
      table: ``[N, S]`` experts per device (ids < 0: empty), each replica on a distinct device.
      replicas: ``[E]`` devices holding each expert.

    Returns:
      ``[N, S]`` float64 shares; a device's share is its row sum.
    """
    r = np.where(table >= 0, replicas[np.maximum(table, 0)], 1).astype(np.float64)
    return np.where(r > 1, 2.0 * (r - 1.0) / r, 0.0)


def limit_sync(table: np.ndarray, weights: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """Moves replicas between devices to lower the largest sync share, loads kept (module doc).

    Args:
      table: ``[N, S]`` experts per device (ids < 0: empty slots, each a distinct id).
      weights: ``[N, S]`` rows of each slot.
      shares: ``[N, S]`` expert gradients each slot sends (``sync_shares``).

    Returns:
      ``[N, S]`` int64 experts per device: the same replicas, whose busiest device has no more
      rows and whose largest share is no larger than the input's. No device gets two replicas
      of one expert unless the input's pair already had them on one device.
    """
    n = table.shape[0]
    half = n // 2
    tab = table.astype(np.int64, copy=True)
    w, sh = weights.astype(np.float64, copy=True), shares.astype(np.float64, copy=True)
    if half == 0 or not sh.any():
        return tab
    best, stall = (sh.sum(axis=1).max(), w.sum(axis=1).max()), 0
    for shift in range(_MAX_PASSES):
        load_cap = w.sum(axis=1).max()
        first, second = _pairs(sh.sum(axis=1), w.sum(axis=1), half, shift)
        tab, w, sh = _resplit(tab, w, sh, first, second, by_share=True, cap=load_cap)
        share_cap = sh.sum(axis=1).max()
        first, second = _pairs(w.sum(axis=1), sh.sum(axis=1), half, shift)
        tab, w, sh = _resplit(tab, w, sh, first, second, by_share=False, cap=share_cap)
        now = (sh.sum(axis=1).max(), w.sum(axis=1).max())
        if now[0] < best[0] * (1 - 1e-12) or now[1] < best[1] * (1 - 1e-12):
            best, stall = now, 0
        else:
            stall += 1
            if stall >= _STALL_PASSES:
                break
    return tab


def _pairs(key: np.ndarray, tie: np.ndarray, half: int, shift: int):
    """The ``half`` devices of largest ``key`` (ties: larger ``tie``) and their partners of
    smallest ``key``, rotated by ``shift`` so that successive passes try other pairs."""
    order = np.lexsort((tie, key))  # ascending key, then ascending tie
    return order[::-1][:half], np.roll(order[:half], shift)


def _resplit(tab, w, sh, first, second, *, by_share: bool, cap: float):
    """Re-splits each pair ``(first[i], second[i])``: by the larger share with both loads
    ``<= cap`` (``by_share``), else by the larger load with both shares ``<= cap``; splits that
    put one expert twice on a device are avoided unless the current split (always allowed, and
    within both caps) does. Returns new ``(tab, w, sh)``."""
    s = tab.shape[1]
    items = np.concatenate([tab[first], tab[second]], axis=1)  # [half, 2S]
    item_w = np.concatenate([w[first], w[second]], axis=1)
    item_sh = np.concatenate([sh[first], sh[second]], axis=1)
    items, item_w, item_sh = take_pairs(movable_first(item_w), items, item_w, item_sh)
    mask = splits(s)  # [C, 2S]
    load = larger_side(item_w, mask)  # [half, C]
    share = larger_side(item_sh, mask)
    slack = 1e-12 * max(cap, 1.0)
    if by_share:  # lexicographic: share first, then load (loads are below cap, a finite scale)
        allowed = load <= cap + slack
        score = share + load / (2.0 * max(cap, 1e-300)) * 1e-6
    else:
        allowed = share <= cap + 1e-9
        score = load
    allowed &= ~duplicate_splits(items, mask)
    allowed[:, 0] = True  # the current split (within both caps) is always allowed
    chosen = mask[np.argmin(np.where(allowed, score, np.inf), axis=1)]  # [half, 2S]
    tab, w, sh = tab.copy(), w.copy(), sh.copy()
    for out, src in ((tab, items), (w, item_w), (sh, item_sh)):
        out[first] = src[chosen].reshape(-1, s)
        out[second] = src[~chosen].reshape(-1, s)
    return tab, w, sh
