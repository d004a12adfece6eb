"""Placement table: validation, identity layout, row splitting."""

import numpy as np
import pytest

from moejax.placement import Placement


def test_identity_layout_and_local_duplicates():
    p = Placement.identity(num_experts=8, num_devices=4, slots_per_device=3)
    # Device d holds experts 2d, 2d+1 and repeats 2d in its spare slot.
    assert p.device_table().tolist() == [[0, 1, 0], [2, 3, 2], [4, 5, 4], [6, 7, 6]]
    assert p.num_slots == 12
    assert p.device_of_slot(7) == 2
    assert p.device_of_slot(np.array([0, 11])).tolist() == [0, 3]
    assert p.replicas_of(4).tolist() == [6, 8]
    assert p.expert_replica_counts().tolist() == [2, 1, 2, 1, 2, 1, 2, 1]
    # Local duplicates change no device's load.
    counts = np.arange(8) * 10
    assert p.device_load(counts).tolist() == [10, 50, 90, 130]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_experts=6, num_devices=4, slots_per_device=2), "multiple of num_devices"),
        (dict(num_experts=8, num_devices=2, slots_per_device=3), "slots_per_device=3"),
        (dict(num_experts=0, num_devices=2, slots_per_device=3), "num_experts"),
    ],
)
def test_identity_rejects_bad_shapes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Placement.identity(**kwargs)


def test_validation_names_field_and_value():
    with pytest.raises(ValueError, match=r"shape \[P\] = \(4,\).*got \(3,\)"):
        Placement(np.array([0, 1, 2]), 3, 2, 2)
    with pytest.raises(ValueError, match="in \\[0, 3\\), got 7"):
        Placement(np.array([0, 1, 2, 7]), 3, 2, 2)
    with pytest.raises(ValueError, match="without a replica: \\[2\\]"):
        Placement(np.array([0, 1, 1, 0]), 3, 2, 2)
    with pytest.raises(ValueError, match="int array"):
        Placement(np.array([0.0, 1, 2, 0]), 3, 2, 2)
    with pytest.raises(ValueError, match="expert must lie"):
        Placement.identity(4, 2, 2).replicas_of(4)


def test_table_is_read_only_copy():
    src = np.array([0, 1, 2, 0])
    p = Placement(src, 3, 2, 2)
    src[0] = 2
    assert p.slot_to_expert[0] == 0
    with pytest.raises(ValueError):
        p.slot_to_expert[0] = 1


def test_integer_split_is_exact_and_even():
    # Expert 0 has replicas in slots 0, 2, 3; 10 rows -> 4, 3, 3 (remainder to the lowest slot).
    p = Placement(np.array([0, 1, 0, 0]), 2, 2, 2)
    rows = p.slot_rows(np.array([10, 5]))
    assert rows.tolist() == [4, 5, 3, 3]
    assert p.device_load(np.array([10, 5])).tolist() == [9, 6]
    float_rows = p.slot_rows(np.array([10.0, 5.0]))
    np.testing.assert_allclose(float_rows, [10 / 3, 5, 10 / 3, 10 / 3])


@pytest.mark.parametrize("seed", range(5))
def test_split_conserves_rows(seed):
    rng = np.random.default_rng(seed)
    p = Placement(rng.permutation(np.arange(24) % 10), 10, 6, 4)
    counts = rng.integers(0, 1000, 10)
    assert p.slot_rows(counts).sum() == counts.sum()
    assert p.device_load(counts).sum() == counts.sum()
    # Every replica of an expert gets within one row of the others.
    rows = p.slot_rows(counts)
    for e in range(10):
        r = rows[p.replicas_of(e)]
        assert r.max() - r.min() <= 1


def test_counts_validation():
    p = Placement.identity(4, 2, 2)
    with pytest.raises(ValueError, match=r"shape \[E\] = \(4,\)"):
        p.device_load(np.ones(5))
    with pytest.raises(ValueError, match=">= 0"):
        p.device_load(np.array([1, -1, 0, 0]))


def test_equality_and_hash():
    a = Placement.identity(4, 2, 3)
    b = Placement(a.slot_to_expert.copy(), 4, 2, 3)
    c = a.with_table(np.array([0, 1, 2, 2, 3, 0]))
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2


def test_imbalance():
    p = Placement.identity(4, 2, 2)
    assert p.imbalance(np.array([3, 1, 1, 3])) == 1.0
    assert p.imbalance(np.array([6, 0, 1, 1])) == pytest.approx(1.5)
    assert p.imbalance(np.zeros(4)) == 1.0
