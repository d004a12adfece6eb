"""Expert groups: the cross-node traffic model, the group-aware packing and the planner."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.placement import H100_IB, HardwareModel, Placement, Workload, plan, step_cost
from moejax.placement._packing.by_group import SPILL_LEVELS, group_homes, pack_by_group
from moejax.placement.groups import (
    cross_node_copies,
    expert_groups,
    min_nodes_per_group,
    nodes_per_group,
)

# 2 nodes of 2 devices; a slow cross-node link so that it sets the all-to-all time.
TOY_HW = HardwareModel(
    "toy", flops_per_s=1e15, link_bytes_per_s=1e9, devices_per_node=2, node_link_bytes_per_s=1e12
)
TOY_WL = Workload(tokens_per_device=100, top_k=2, d_model=8, d_ff=8, num_groups=2, topk_groups=1)


def test_cross_node_copies_and_all_to_all_by_hand():
    # E=4 in 2 groups {0, 1}, {2, 3}; one slot per device; 100 rows per expert; top-2 within
    # one group, so c = 2 picks per group and T_j = 200 / 2 = 100 tokens per group; M = 2.
    counts = np.full(4, 100.0)
    together = Placement.identity(4, 4, 1)  # group 0 on node 0 (devices 0, 1), group 1 on 1
    spread = together.with_table(np.array([0, 2, 1, 3]))  # each node holds half of each group
    # Together: node 0 receives the tokens of group 0 from node 1 only: (1 - 1/2) * 100 = 50.
    np.testing.assert_allclose(cross_node_copies(together, counts, 2, 2.0, 2), [50.0, 50.0])
    # Spread: p = 1/2 per node, a token reaches node 0 with prob. 1 - (1/2)^2 = 3/4 per group:
    # (1 - 1/2) * (100 * 3/4 + 100 * 3/4) = 75.
    np.testing.assert_allclose(cross_node_copies(spread, counts, 2, 2.0, 2), [75.0, 75.0])
    # All-to-all: 4 passes x (copies per device = X / 2) x D x 2 bytes / 1 GB/s (the in-node
    # part, <= 100 rows x 16 B at 1 TB/s, is smaller).
    for p, copies in ((together, 50.0), (spread, 75.0)):
        cost = step_cost(p, counts, TOY_HW, TOY_WL)
        assert cost.all_to_all_s == pytest.approx(4 * copies / 2 * 8 * 2 / 1e9)
    assert nodes_per_group(together, 2, 2).tolist() == [1, 1]
    assert nodes_per_group(spread, 2, 2).tolist() == [2, 2]


def test_without_groups_or_nodes_the_exchange_is_the_flat_one():
    counts = np.array([300.0, 100, 50, 50])
    p = Placement.identity(4, 4, 1)
    flat = Workload(tokens_per_device=100, top_k=2, d_model=8, d_ff=8)
    # Local rows n_e / N = [75, 25, 12.5, 12.5]; sent 125 - local, received n_e - local:
    # max = [225, 100, 112.5, 112.5] rows of 16 B, 1/3 of them in-node (1 of 3 peers).
    a2a = 4 * max(225 * 16 / 3 / 1e12, 225 * 16 * 2 / 3 / 1e9)
    assert step_cost(p, counts, TOY_HW, flat).all_to_all_s == pytest.approx(a2a)
    one_node = HardwareModel("flat", 1e15, 1e9)  # groups change nothing without nodes
    assert step_cost(p, counts, one_node, TOY_WL) == step_cost(p, counts, one_node, flat)


def test_group_validation():
    with pytest.raises(ValueError, match="topk_groups must be <= num_groups=2"):
        Workload(num_groups=2, topk_groups=3, top_k=8)
    with pytest.raises(ValueError, match="num_groups must be a positive divisor of num_experts=4"):
        step_cost(Placement.identity(4, 4, 1), np.ones(4), TOY_HW, Workload(num_groups=3))
    with pytest.raises(ValueError, match="spill must lie in"):
        pack_by_group(np.ones(8), 4, 2, 2, 2, spill=1.5)
    assert expert_groups(8, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(
    "e, groups, nodes, want",
    [
        (256, 8, 4, [1] * 8),  # 2 groups per node
        (256, 8, 8, [1] * 8),
        (256, 4, 8, [2] * 4),  # each group on 2 nodes of its own
        (12, 3, 2, [1, 2, 1]),  # group 1 straddles the two nodes of 6 experts
        (24, 4, 3, [1, 2, 2, 1]),
    ],
)
def test_min_nodes_per_group(e, groups, nodes, want):
    assert min_nodes_per_group(e, groups, nodes).tolist() == want
    homes = group_homes(np.random.default_rng(0).random(e), groups, nodes)
    assert sorted(homes.reshape(-1).tolist()) == list(range(e))  # each expert once
    group = expert_groups(e, groups)
    spans = [len({m for m in range(nodes) if j in group[homes[m]]}) for j in range(groups)]
    assert spans == want


@st.composite
def grouped_shapes(draw):
    g = draw(st.sampled_from([2, 4]))  # devices per node
    m = draw(st.integers(2, 4))  # nodes
    s = draw(st.integers(1, 4))
    q = draw(st.integers(max(s, 2), g * s))  # experts per node
    e = m * q
    # Two experts per group at least (MoEConfig: the router scores a group by its top two).
    groups = draw(st.sampled_from([d for d in range(2, e // 2 + 1) if e % d == 0]))
    kind = draw(st.sampled_from(["zipf", "one_hot", "zeros", "uniform"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    counts = {
        "zipf": lambda: rng.permutation(1000.0 / np.arange(1, e + 1) ** 1.2),
        "one_hot": lambda: np.eye(e)[rng.integers(e)] * 1e4,
        "zeros": lambda: np.zeros(e),
        "uniform": lambda: np.full(e, 10.0),
    }[kind]()
    return g, m, s, e, groups, counts


@settings(max_examples=60, deadline=None)
@given(grouped_shapes(), st.sampled_from(SPILL_LEVELS))
def test_pack_by_group_is_valid_and_keeps_groups_on_their_nodes(shape, spill):
    g, m, s, e, groups, counts = shape
    n = g * m
    table = pack_by_group(counts, n, s, g, groups, spill)
    assert table.shape == (n, s)
    p = Placement(table.reshape(-1), e, n, s)  # validates: every expert on >= 1 slot
    assert p.device_load(counts).sum() == pytest.approx(counts.sum())
    if spill == 0.0:  # no replica outside its group's home nodes
        spans = nodes_per_group(p, groups, g)
        assert np.array_equal(spans, min_nodes_per_group(e, groups, m)), spans


@settings(max_examples=40, deadline=None)
@given(grouped_shapes())
def test_plan_with_groups_spreads_a_group_only_when_the_cost_model_pays(shape):
    g, m, s, e, groups, counts = shape
    n = g * m
    hw = HardwareModel("t", 1e15, 50e9, devices_per_node=g, node_link_bytes_per_s=450e9)
    wl = Workload(
        tokens_per_device=1024, top_k=4, d_model=256, d_ff=128, num_groups=groups, topk_groups=2
    )
    # A start with every group on its least nodes, whatever the loads.
    start = Placement(pack_by_group(np.ones(e), n, s, g, groups).reshape(-1), e, n, s)
    new = plan(start, counts, hardware=hw, workload=wl)
    assert new.slot_to_expert.shape == (n * s,)
    assert np.bincount(new.slot_to_expert, minlength=e).min() >= 1
    cost = step_cost(new, counts, hw, wl).total_s
    assert new is start or cost < step_cost(start, counts, hw, wl).total_s
    whole = Placement(pack_by_group(counts, n, s, g, groups).reshape(-1), e, n, s)
    least = min_nodes_per_group(e, groups, m)
    if np.any(nodes_per_group(new, groups, g) > least):
        assert cost < step_cost(whole, counts, hw, wl).total_s


def test_plan_with_groups_beats_the_group_blind_plan_on_deepseek_shapes():
    # E=256 in 8 groups on 64 H100s in 8 nodes: the plan without groups spreads every group
    # over all 8 nodes; with them groups stay on few nodes and the modeled step is lower.
    rng = np.random.default_rng(1)
    counts = rng.multinomial(64 * 8192 * 8, rng.dirichlet(np.full(256, 2.0))).astype(float)
    wl = Workload(num_groups=8, topk_groups=4)
    start = Placement.identity(256, 64, 5)
    blind = plan(start, counts, hardware=H100_IB, workload=Workload())
    aware = plan(start, counts, hardware=H100_IB, workload=wl)
    assert nodes_per_group(blind, 8, 8).min() > 1
    # Spilled replicas of hot experts may take a group onto a few more nodes (when it pays).
    assert nodes_per_group(aware, 8, 8).mean() < nodes_per_group(blind, 8, 8).mean() / 2
    cost = lambda p: step_cost(p, counts, H100_IB, wl).total_s  # noqa: E731
    assert cost(aware) < cost(blind) and cost(aware) < cost(start)
