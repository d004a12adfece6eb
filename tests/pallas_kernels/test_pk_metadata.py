"""Invariants of the pure-jnp tile metadata, checked against brute force over random routings."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import metadata as md


@st.composite
def routings(draw):
    """(group_sizes [G], m, tm) with m a multiple of tm and sum(group_sizes) <= m.

    Few distinct (m, tm, G) so that each shape compiles once; the sizes vary freely.
    """
    tm = draw(st.sampled_from([1, 4, 8]))
    m = tm * draw(st.sampled_from([1, 3, 5]))
    g = draw(st.sampled_from([1, 3, 7]))
    cuts = sorted(draw(st.lists(st.integers(0, m), min_size=g, max_size=g)))
    ends = np.array(cuts)
    sizes = np.diff(np.concatenate([[0], ends])).astype(np.int32)
    return sizes, m, tm


def _intersecting(sizes, m, tm):
    """Brute force: the set of (group, tile) with at least one row of the group in the tile."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return {(g, row // tm) for g in range(len(sizes)) for row in range(offsets[g], offsets[g + 1])}


@settings(max_examples=40, deadline=None)
@given(routings(), st.booleans())
def test_make_group_metadata_visits(routing, visit_empty):
    sizes, m, tm = routing
    meta, num_tiles = md.make_group_metadata(
        jnp.asarray(sizes), m=m, tm=tm, visit_empty_groups=visit_empty
    )
    n = int(num_tiles)
    group_ids = np.asarray(meta.group_ids)[:n]
    tile_ids = np.asarray(meta.m_tile_ids)[:n]
    offsets = np.asarray(meta.group_offsets)
    assert offsets[0] == 0 and offsets[-1] == sizes.sum()
    assert len(meta.group_ids) == m // tm + len(sizes) - 1 >= n
    # Walked in order: groups and tiles never go back (a tile is revisited consecutively only).
    assert (np.diff(group_ids) >= 0).all() and (np.diff(tile_ids) >= 0).all()
    pairs = list(zip(group_ids.tolist(), tile_ids.tolist(), strict=True))
    assert len(set(pairs)) == len(pairs), "no visit twice"
    nonempty_pairs = {(g, t) for g, t in pairs if sizes[g] > 0}
    assert nonempty_pairs == _intersecting(sizes, m, tm), "every intersecting pair, only those"
    empty_visits = [g for g, _ in pairs if sizes[g] == 0]
    expected_empty = [g for g in range(len(sizes)) if sizes[g] == 0] if visit_empty else []
    assert empty_visits == expected_empty
    for g, t in pairs:
        if sizes[g] == 0:  # an empty group visits a tile holding (or ending at) its offset
            assert t == min(offsets[g] // tm, m // tm - 1)


@settings(max_examples=40, deadline=None)
@given(routings())
def test_tile_group_ranges(routing):
    sizes, m, tm = routing
    first, stop = md.tile_group_ranges(jnp.asarray(sizes), m=m, tm=tm)
    first, stop = np.asarray(first), np.asarray(stop)
    assert (stop >= first).all()
    hits = _intersecting(sizes, m, tm)
    for t in range(m // tm):
        needed = {g for g, tt in hits if tt == t}
        in_range = set(range(first[t], stop[t]))
        assert needed <= in_range
        assert all(g in needed or sizes[g] == 0 for g in in_range), "extras are empty groups"


@settings(max_examples=40, deadline=None)
@given(routings())
def test_group_tile_ranges(routing):
    sizes, m, tm = routing
    lo, hi = md.group_tile_ranges(jnp.asarray(sizes), tm=tm)
    hits = _intersecting(sizes, m, tm)
    for g in range(len(sizes)):
        assert set(range(int(lo[g]), int(hi[g]))) == {t for gg, t in hits if gg == g}
