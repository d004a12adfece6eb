"""Cost model sanity: compute, all-to-all, migration, hardware figures."""

import dataclasses

import numpy as np
import pytest

from moejax.placement import (
    H100_IB,
    H100_NVLINK,
    TPU_V5P_ICI,
    HardwareModel,
    Placement,
    Workload,
    copies_needed,
    migration_bytes,
    migration_s,
    perfect_cost,
    step_cost,
)

WL = Workload(tokens_per_device=1024, top_k=2, d_model=512, d_ff=1024)


def test_hardware_figures_match_spec_sheets():
    assert H100_NVLINK.flops_per_s == H100_IB.flops_per_s == 989e12
    assert H100_NVLINK.link_bytes_per_s == 450e9  # 900 GB/s bidirectional
    assert H100_IB.link_bytes_per_s == 50e9  # 400 Gb/s NDR
    assert H100_IB.devices_per_node == 8
    assert TPU_V5P_ICI.flops_per_s == 459e12
    assert TPU_V5P_ICI.link_bytes_per_s == 4800e9 / 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        H100_IB.flops_per_s = 1.0


def test_hardware_validation():
    with pytest.raises(ValueError, match="flops_per_s must be > 0, got 0"):
        HardwareModel("x", flops_per_s=0, link_bytes_per_s=1)
    with pytest.raises(ValueError, match="node_link_bytes_per_s"):
        HardwareModel("x", flops_per_s=1, link_bytes_per_s=1, devices_per_node=8)
    with pytest.raises(ValueError, match="top_k must be a positive int, got 0"):
        Workload(top_k=0)


def test_hierarchical_transfer():
    # Inside one node everything goes over NVLink; across nodes IB dominates.
    nbytes = 1e9
    assert H100_IB.transfer_s(nbytes, 8) == pytest.approx(nbytes / 450e9)
    slow = H100_IB.transfer_s(nbytes, 64)
    assert slow == pytest.approx(nbytes * (56 / 63) / 50e9)


def test_compute_time_follows_busiest_device():
    p = Placement.identity(4, 2, 2)
    balanced = step_cost(p, np.array([100, 100, 100, 100]), H100_NVLINK, WL)
    skewed = step_cost(p, np.array([300, 100, 0, 0]), H100_NVLINK, WL)
    assert skewed.compute_s == pytest.approx(2 * balanced.compute_s)
    assert balanced.compute_s == pytest.approx(200 * WL.flops_per_row / 989e12)
    assert skewed.total_s == skewed.compute_s + skewed.all_to_all_s


def test_all_to_all_counts_only_rows_leaving_their_device():
    counts = np.array([100, 100, 100, 100])
    one_device = step_cost(Placement.identity(4, 1, 4), counts, H100_NVLINK, WL)
    assert one_device.all_to_all_s == 0.0
    p = Placement.identity(4, 2, 2)
    cost = step_cost(p, counts, H100_NVLINK, WL)
    # Each device sends half of its 200 source rows and receives 100 rows, 4 passes.
    expected = 4 * 100 * WL.d_model * WL.activation_bytes / 450e9
    assert cost.all_to_all_s == pytest.approx(expected)
    # Replicating experts 0 and 2 on both devices keeps their rows local: half the traffic.
    spare = Placement.identity(4, 2, 3)  # [[0, 1, 0], [2, 3, 2]]: same traffic as above
    assert step_cost(spare, counts, H100_NVLINK, WL).all_to_all_s == pytest.approx(expected)
    shadow = spare.with_table(np.array([0, 1, 2, 2, 3, 0]))
    assert step_cost(shadow, counts, H100_NVLINK, WL).all_to_all_s == pytest.approx(expected / 2)


def test_perfect_bound_is_below_static_on_skew():
    p = Placement.identity(8, 4, 2)
    counts = np.array([800, 10, 10, 10, 10, 10, 10, 10])
    assert perfect_cost(counts, 4, H100_IB, WL).total_s < step_cost(p, counts, H100_IB, WL).total_s
    even = np.full(8, 100)
    assert perfect_cost(even, 4, H100_IB, WL).total_s == pytest.approx(
        step_cost(p, even, H100_IB, WL).total_s
    )


def test_migration_zero_for_identical_placements():
    p = Placement.identity(8, 4, 3)
    assert migration_bytes(p, p, WL) == 0
    assert migration_s(p, p, H100_IB, WL) == 0.0
    assert not copies_needed(p, p).any()


def test_migration_counts_remote_copies_only():
    old = Placement.identity(4, 2, 3)  # [[0, 1, 0], [2, 3, 2]]
    # Slot 2 takes expert 2 (remote: one copy); slot 5 takes expert 3 (already local: free).
    new = old.with_table(np.array([0, 1, 2, 2, 3, 3]))
    assert copies_needed(old, new).tolist() == [False, False, True, False, False, False]
    assert migration_bytes(old, new, WL) == WL.expert_state_bytes
    assert migration_s(old, new, H100_NVLINK, WL) == pytest.approx(WL.expert_state_bytes / 450e9)
    assert WL.expert_state_bytes == 3 * 512 * 1024 * 14


def test_migration_shape_mismatch():
    with pytest.raises(ValueError, match="differ in shape"):
        migration_bytes(Placement.identity(4, 2, 2), Placement.identity(4, 2, 3), WL)


def test_replica_sync_counts_only_replicas_on_other_devices():
    from moejax.placement.cost_model import replica_sync_s

    wl = Workload(tokens_per_device=512, top_k=2, d_model=1024, d_ff=1024)
    flat = HardwareModel("flat", flops_per_s=1e15, link_bytes_per_s=1e11)
    # Identity's spare slots duplicate home experts on their own device: nothing to combine.
    assert replica_sync_s(Placement.identity(8, 4, 3), flat, wl) == 0.0
    # Expert 0 on all 4 devices: each sends 2 (4 - 1) / 4 of its bf16 gradient (ring).
    table = np.array([0, 1, 2, 0, 3, 4, 0, 5, 6, 0, 7, 1])
    p = Placement(table, 8, 4, 3)
    grad = wl.expert_params * wl.param_bytes
    expected_device0 = 2 * 3 / 4 * grad + 2 * 1 / 2 * grad  # experts 0 (4 devices), 1 (2)
    assert replica_sync_s(p, flat, wl) == pytest.approx(expected_device0 / 1e11)


def test_step_cost_charges_replica_sync_by_hand():
    # Expert 0 on both devices (twice on device 0, a free local duplicate): 3 slots, 100 rows
    # each. Loads 200 + 60 = 260 and 100 + 90 + 30 = 220 rows; each device makes 240 rows and
    # keeps those of experts it holds: local (300 + 60) / 2 = 180 and (300 + 90 + 30) / 2 = 210.
    hw = H100_NVLINK
    p = Placement(np.array([0, 1, 0, 0, 2, 3]), 4, 2, 3)
    counts = np.array([300.0, 60, 90, 30])
    cost = step_cost(p, counts, hw, WL)
    compute = 260 * WL.flops_per_row / 989e12
    a2a = 4 * max(240 - 180, 260 - 180) * 512 * 2 / 450e9
    sync = 2 * (2 - 1) / 2 * (3 * 512 * 1024 * 2) / 450e9  # ring all-reduce of 2 bf16 replicas
    assert (cost.compute_s, cost.all_to_all_s) == pytest.approx((compute, a2a), rel=1e-12)
    assert cost.replica_sync_s == pytest.approx(sync, rel=1e-12)
    assert cost.total_s == pytest.approx(compute + a2a + sync, rel=1e-12)
    hidden = dataclasses.replace(WL, replica_sync_overlap=0.25)
    assert step_cost(p, counts, hw, hidden).replica_sync_s == pytest.approx(0.75 * sync)
    # No replica across devices, no sync; the perfect bound never has any.
    assert step_cost(Placement.identity(4, 2, 3), counts, hw, WL).replica_sync_s == 0.0
    assert perfect_cost(counts, 2, hw, WL).replica_sync_s == 0.0


def test_packed_replica_sync_is_the_training_steps_all_reduce_by_hand():
    # `Workload(replica_sync="packed")`: one ring all-reduce over all N devices of B expert
    # gradients, B the smallest of 0, 1, 2, 4, ..., min(P - E, E) holding the m experts that
    # sit on two devices or more (moejax.parallel.slots.combine_replica_grads).
    from moejax.placement.cost_model import packed_sync_gradients, replica_sync_s

    wl = Workload(tokens_per_device=512, top_k=2, d_model=1024, d_ff=1024, replica_sync="packed")
    flat = HardwareModel("flat", flops_per_s=1e15, link_bytes_per_s=1e11)
    grad = wl.expert_params * wl.param_bytes
    ring = lambda n, b: 2 * (n - 1) / n * b * grad
    # No spare slot, or spare slots as local duplicates: no expert across devices, nothing sent.
    for p in (Placement.identity(8, 4, 2), Placement.identity(8, 4, 3)):
        assert packed_sync_gradients(p) == 0 and replica_sync_s(p, flat, wl) == 0.0
    # Expert 0 on all 4 devices, expert 1 on two: m = 2, B = 2, whatever the holders.
    p = Placement(np.array([0, 1, 2, 0, 3, 4, 0, 5, 6, 0, 7, 1]), 8, 4, 3)
    assert packed_sync_gradients(p) == 2
    assert replica_sync_s(p, flat, wl) == pytest.approx(ring(4, 2) / 1e11, rel=1e-12)
    # Three experts across devices (7 is a local duplicate): B = 4; the bound caps B at X.
    p3 = Placement(np.array([0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7]), 8, 4, 3)
    assert packed_sync_gradients(p3) == 4
    assert packed_sync_gradients(Placement(np.arange(10) % 8, 8, 2, 5)) == 2  # X = 2
    # In one node: the node link; over two nodes: the ring runs at the cross-node link.
    two_nodes = HardwareModel(
        "nodes", 1e15, link_bytes_per_s=1e10, devices_per_node=4, node_link_bytes_per_s=9e10
    )
    assert replica_sync_s(p, two_nodes, wl) == pytest.approx(ring(4, 2) / 9e10, rel=1e-12)
    wide = Placement(np.concatenate([np.arange(16), [0, 1]] + [np.arange(2, 16)]), 16, 8, 4)
    assert packed_sync_gradients(wide) == 16  # all 16 experts on two devices (X = 16)
    assert replica_sync_s(wide, two_nodes, wl) == pytest.approx(ring(8, 16) / 1e10, rel=1e-12)
    # step_cost charges it (less the overlap), and "holders" differs (per-expert rings).
    counts = np.full(8, 100.0)
    assert step_cost(p, counts, flat, wl).replica_sync_s == pytest.approx(ring(4, 2) / 1e11)
    hidden = dataclasses.replace(wl, replica_sync_overlap=0.5)
    assert step_cost(p, counts, flat, hidden).replica_sync_s == pytest.approx(ring(4, 2) / 2e11)
    holders = dataclasses.replace(wl, replica_sync="holders")
    assert replica_sync_s(p, flat, holders) != replica_sync_s(p, flat, wl)


def test_replica_sync_validation():
    with pytest.raises(ValueError, match="replica_sync must be one of \\('holders', 'packed'\\)"):
        Workload(replica_sync="psum")


def test_replica_sync_overlap_validation():
    with pytest.raises(ValueError, match="replica_sync_overlap must lie in \\[0, 1\\], got 1.5"):
        Workload(replica_sync_overlap=1.5)


def test_rows_per_gradient_converts_sync_to_busiest_device_rows():
    from moejax.placement.cost_model import rows_per_gradient

    grad_s = 3 * 512 * 1024 * 2 / 450e9
    row_s = WL.flops_per_row / 989e12 + 4 * 512 * 2 / 450e9
    assert rows_per_gradient(H100_NVLINK, WL, 8) == pytest.approx(grad_s / row_s, rel=1e-12)
    hidden = dataclasses.replace(WL, replica_sync_overlap=1.0)
    assert rows_per_gradient(H100_NVLINK, hidden, 8) == 0.0
