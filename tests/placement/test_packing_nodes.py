"""Node-aware placement: replica sync over in-node vs cross-node links, device grouping into
nodes, node-preserving alignment, and the planner using both."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.placement import H100_IB, HardwareModel, Placement, Workload, plan, step_cost
from moejax.placement._packing.node_order import align_nodes, group_nodes
from moejax.placement.cost_model import replica_sync_s
from moejax.placement.planner import _Nodes, _repack
from moejax.placement.traces import zipf_exponent_for, zipf_probs

WL = Workload(tokens_per_device=64, top_k=2, d_model=512, d_ff=1024)
TWO_NODES = HardwareModel(
    "two-nodes",
    flops_per_s=1e15,
    link_bytes_per_s=1e10,
    devices_per_node=2,
    node_link_bytes_per_s=9e10,
)


def _cross_shares(table: np.ndarray, g: int) -> np.ndarray:
    """[N] gradients each device sends for experts whose holders span nodes (by definition)."""
    n = table.shape[0]
    holders = {x: {d for d in range(n) if x in table[d]} for x in np.unique(table[table >= 0])}
    out = np.zeros(n)
    for devs in holders.values():
        if len(devs) > 1 and len({d // g for d in devs}) > 1:
            for d in devs:
                out[d] += 2 * (len(devs) - 1) / len(devs)
    return out


def test_replica_sync_uses_the_link_of_the_holders_by_hand():
    grad = WL.expert_params * WL.param_bytes
    # 4 devices, nodes {0, 1} and {2, 3}. Expert 0 on devices 0 and 1 (one node): NVLink-like.
    inside = Placement(np.array([0, 1, 0, 2, 3, 4, 5, 6]), 7, 4, 2)
    assert replica_sync_s(inside, TWO_NODES, WL) == pytest.approx(grad / 9e10, rel=1e-12)
    # Expert 0 on devices 0 and 2 (two nodes): the ring runs at the cross-node link's speed.
    across = Placement(np.array([0, 1, 2, 3, 0, 4, 5, 6]), 7, 4, 2)
    assert replica_sync_s(across, TWO_NODES, WL) == pytest.approx(grad / 1e10, rel=1e-12)
    # Both at once on device 0 (expert 0 inside, expert 1 across): the two links work in
    # parallel, the slower one sets the time.
    both = Placement(np.array([0, 1, 0, 2, 1, 3, 4, 5]), 6, 4, 2)
    assert replica_sync_s(both, TWO_NODES, WL) == pytest.approx(grad / 1e10, rel=1e-12)
    # One node (G >= N) or a flat network: every replica pair goes over the only link there is.
    flat = dataclasses.replace(TWO_NODES, devices_per_node=1)
    assert replica_sync_s(across, flat, WL) == pytest.approx(grad / 1e10, rel=1e-12)
    assert replica_sync_s(inside, dataclasses.replace(TWO_NODES, devices_per_node=4), WL) == (
        pytest.approx(grad / 9e10, rel=1e-12)
    )


def test_nodes_holding_counts_distinct_nodes():
    p = Placement(np.array([0, 1, 2, 0, 3, 0, 1, 4]), 5, 4, 2)  # devices 0..3
    assert p.nodes_holding(2).tolist() == [2, 2, 1, 1, 1]  # expert 0 on devices 0, 1, 2
    assert p.nodes_holding(4).tolist() == [1, 1, 1, 1, 1]
    assert p.nodes_holding(2) is p.nodes_holding(2)  # kept with the placement


def test_group_nodes_cuts_a_shuffled_chain_once_per_node_boundary():
    # 16 devices, replicated experts 0..14 chain them: device i holds halves of experts i - 1
    # and i, plus an unreplicated expert of its own. In nodes of 4 the best grouping cuts the
    # chain 3 times, each cut costing its two devices one cross-node gradient.
    n, g = 16, 4
    chain = [[i - 1 if i else 100 + i, i if i < n - 1 else 200, 300 + i] for i in range(n)]
    table = np.array(chain)[np.random.default_rng(0).permutation(n)]
    order = group_nodes(table, g)
    assert sorted(order.tolist()) == list(range(n))
    cross = _cross_shares(table[order], g)
    assert cross.max() == pytest.approx(1.0)
    assert np.sum(cross > 0) == 6  # 3 cuts x 2 devices


def test_group_nodes_is_the_identity_without_several_nodes():
    table = np.arange(12).reshape(4, 3)
    assert group_nodes(table, 1).tolist() == [0, 1, 2, 3]
    assert group_nodes(table, 4).tolist() == [0, 1, 2, 3]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(16, 4), (24, 8), (32, 8)]))
def test_group_nodes_never_worse_than_packing_order_and_align_keeps_nodes(seed, shape):
    n, g = shape
    rng = np.random.default_rng(seed)
    e = 2 * n
    counts = rng.multinomial(200 * n, zipf_probs(e, zipf_exponent_for(e, 4.0)))
    placement = Placement.identity(e, n, 3)
    packed = _repack(placement, counts.astype(np.float64))  # no nodes: packing order
    table = packed.device_table()
    order = group_nodes(table, g)
    assert sorted(order.tolist()) == list(range(n))
    assert _cross_shares(table[order], g).max() <= _cross_shares(table, g).max() + 1e-9
    # Relabelling onto an old placement keeps each node's devices together, in some node.
    old = Placement.identity(e, n, 3).device_table()[rng.permutation(n)]
    aligned = align_nodes(old, table[order], e, g).reshape(n, 3)
    grouped = [
        sorted(map(sorted, table[order][m * g : (m + 1) * g].tolist())) for m in range(n // g)
    ]
    landed = [sorted(map(sorted, aligned[m * g : (m + 1) * g].tolist())) for m in range(n // g)]
    assert sorted(landed) == sorted(grouped)
    assert _cross_shares(aligned, g).max() == pytest.approx(_cross_shares(table[order], g).max())


def test_align_nodes_keeps_a_placement_that_only_moved_within_and_between_nodes():
    rng = np.random.default_rng(3)
    n, g, s, e = 16, 4, 3, 40
    old = rng.permutation(np.arange(n * s) % e).reshape(n, s)
    nodes = rng.permutation(n // g)
    moved = old.reshape(n // g, g, s)[nodes]  # nodes permuted
    moved = np.stack([block[rng.permutation(g)] for block in moved]).reshape(n, s)
    moved = np.stack([row[rng.permutation(s)] for row in moved])  # slots within devices
    assert np.array_equal(align_nodes(old, moved, e, g), old.reshape(-1))


def test_align_nodes_rejects_a_partial_node():
    with pytest.raises(ValueError, match="multiple of devices_per_node"):
        align_nodes(np.zeros((6, 2), np.int64), np.zeros((6, 2), np.int64), 1, 4)


def test_planner_groups_replicas_into_nodes():
    # 32 devices in 4 nodes of 8 (H100_IB), skewed routing: the planner's re-pack puts the
    # holders of replicated experts in fewer nodes than the same packing in packing order,
    # with the same loads, and a lower modeled step.
    n, e = 32, 64
    rng = np.random.default_rng(0)
    wl = Workload()
    counts = rng.multinomial(n * wl.rows_per_step, zipf_probs(e, zipf_exponent_for(e, 4.0)))
    counts = counts.astype(np.float64)
    base = Placement.identity(e, n, 3)
    planned = plan(base, counts, hardware=H100_IB, workload=wl)
    assert np.all(planned.expert_replica_counts() >= 1)
    from moejax.placement.cost_model import rows_per_gradient

    sync_rows = rows_per_gradient(H100_IB, wl, n)
    grouped = _repack(base, counts, sync_rows, _Nodes(8, H100_IB, wl, np.inf))
    ungrouped = _repack(base, counts, sync_rows)
    assert np.sort(grouped.device_load(counts)).tolist() == pytest.approx(
        np.sort(ungrouped.device_load(counts)).tolist()
    )
    assert replica_sync_s(grouped, H100_IB, wl) < replica_sync_s(ungrouped, H100_IB, wl)
    cost = lambda p: step_cost(p, counts, H100_IB, wl).total_s  # noqa: E731
    assert cost(planned) <= cost(grouped) * (1 + 1e-12) < cost(ungrouped)


def test_group_nodes_keeps_the_order_when_nothing_is_replicated():
    # No expert on two devices (issue 17, item 4: this raised OverflowError): nothing to group.
    table = np.arange(32 * 8).reshape(32, 8)
    assert group_nodes(table, 8).tolist() == list(range(32))
    table[:, -1] = -1  # empty slots too
    assert group_nodes(table, 8).tolist() == list(range(32))
