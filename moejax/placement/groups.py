"""Expert groups of group-limited routing: where they sit, and the cross-node traffic they cause.

Shape letters: ``E`` experts, ``N`` devices, ``S`` slots per device, ``G`` devices per node
(``HardwareModel.devices_per_node``), ``M = N / G`` nodes, ``K`` experts per token.

With group-limited routing (``MoEConfig.num_groups`` / ``topk_groups``, the sigmoid router as
in DeepSeek-V3) the experts form ``num_groups`` groups of ``E / num_groups`` consecutive ids:
group ``j`` holds experts ``j·E/num_groups .. (j+1)·E/num_groups - 1`` (the router reshapes the
``[T, E]`` scores to ``[T, num_groups, E/num_groups]``). Each token keeps its ``topk_groups``
best groups and picks its ``K`` experts among them, ``c = K / topk_groups`` per group on
average (DeepSeek-V3: 8 / 4 = 2; ``Workload.picks_per_group``, at least 1). A group that lives
on one node costs a token one cross-node copy at most; spread over ``m`` nodes, up to
``min(m, c)``.

**Cross-node copies** (``cross_node_copies``; node-deduplicated dispatch as in DeepSeek-V3: a
token crosses to each destination node once and is forwarded inside it). With ``R_j`` the rows
routed to group ``j`` in a step, ``T_j = R_j / c`` the tokens that chose it, and ``p_jm`` the
share of ``R_j`` computed on node ``m`` (each expert's rows split evenly over its replicas),
node ``m`` receives from other nodes, per step,

    ``X_m = (1 - 1/M) · sum_j T_j · (1 - (1 - p_jm)^c)``

token copies: a token's ``c`` picks in group ``j`` are taken as independent, each landing on
node ``m`` with probability ``p_jm``, and a token comes from another node than ``m`` with
probability ``1 - 1/M`` (sources uniform over devices). A group on one node gives
``(1 - 1/M) · T_j`` copies, spread evenly over ``m >= c`` nodes about ``c`` times as many.
``cost_model.step_cost`` turns them into the cross-node part of the all-to-all.

Plain numpy; no jax.
"""

from __future__ import annotations

import numpy as np

from moejax.placement.table import Placement


def experts_per_group(num_experts: int, num_groups: int) -> int:
    """``E / num_groups``; ValueError naming ``num_groups`` unless it divides ``E``."""
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(
            f"num_groups must be a positive divisor of num_experts={num_experts}, "
            f"got {num_groups!r}"
        )
    return num_experts // num_groups


def expert_groups(num_experts: int, num_groups: int) -> np.ndarray:
    """``[E]`` int64 group of every expert (consecutive ids, module docstring)."""
    return np.arange(num_experts) // experts_per_group(num_experts, num_groups)


def nodes_per_group(placement: Placement, num_groups: int, devices_per_node: int) -> np.ndarray:
    """``[num_groups]`` nodes holding a slot of at least one expert of each group (replicas
    included; node ``m`` is devices ``m·G .. m·G + G - 1``)."""
    group = expert_groups(placement.num_experts, num_groups)
    node = placement.slot_devices() // devices_per_node
    pairs = np.unique(group[placement.slot_to_expert] * placement.num_devices + node)
    return np.bincount(pairs // placement.num_devices, minlength=num_groups)


def min_nodes_per_group(num_experts: int, num_groups: int, num_nodes: int) -> np.ndarray:
    """``[num_groups]`` nodes each group spans when groups are kept together and every node
    holds ``E / M`` of the experts once (a node's slots cannot all go to replicas of others).

    Groups laid out in id order, ``E / M`` experts per node: group ``j`` covers the nodes of its
    first and last expert. That is the least possible for every group when one of
    ``num_groups``, ``M`` divides the other (1 node per group, or ``M / num_groups``);
    otherwise some group straddles a node boundary, as it must, and spans one node more than
    ``ceil((E / num_groups) / (E / M))`` at most.

    >>> min_nodes_per_group(256, 8, 4).tolist(), min_nodes_per_group(12, 3, 2).tolist()
    ([1, 1, 1, 1, 1, 1, 1, 1], [1, 2, 1])
    """
    per_group = experts_per_group(num_experts, num_groups)
    if num_experts % num_nodes:
        raise ValueError(f"num_nodes must divide num_experts={num_experts}, got {num_nodes!r}")
    per_node = num_experts // num_nodes
    first = np.arange(num_groups) * per_group // per_node
    last = ((np.arange(num_groups) + 1) * per_group - 1) // per_node
    return last - first + 1


def group_node_rows(
    placement: Placement, counts: np.ndarray, num_groups: int, devices_per_node: int
) -> np.ndarray:
    """``[num_groups, M]`` rows of each group computed on each node (``Placement.slot_rows``)."""
    m = placement.num_devices // devices_per_node
    group = expert_groups(placement.num_experts, num_groups)
    rows = placement.slot_rows(np.asarray(counts, np.float64))
    node = placement.slot_devices() // devices_per_node
    keys = group[placement.slot_to_expert] * m + node
    return np.bincount(keys, weights=rows, minlength=num_groups * m).reshape(num_groups, m)


def cross_node_copies(
    placement: Placement,
    counts: np.ndarray,
    num_groups: int,
    picks_per_group: float,
    devices_per_node: int,
) -> np.ndarray:
    """``[M]`` token copies each node receives from other nodes per step (module docstring).

    Args:
      placement: ``N`` devices, a multiple of ``devices_per_node``.
      counts: ``[E]`` rows routed to each expert in the step, summed over all devices.
      num_groups: expert groups (divides ``E``).
      picks_per_group: ``c = K / topk_groups`` experts a token picks in each of its groups.
      devices_per_node: ``G``.

    Returns:
      ``X [M]`` float64.

    >>> p = Placement.identity(num_experts=4, num_devices=4, slots_per_device=1)
    >>> counts = np.full(4, 100.0)  # 2 groups of 2 experts, each group on one node of 2
    >>> cross_node_copies(p, counts, 2, 2.0, 2).tolist()
    [50.0, 50.0]
    """
    rows = group_node_rows(placement, counts, num_groups, devices_per_node)  # [groups, M]
    m = rows.shape[1]
    total = rows.sum(axis=1, keepdims=True)  # R_j
    share = np.divide(rows, total, out=np.zeros_like(rows), where=total > 0)  # p_jm
    tokens = total / picks_per_group  # T_j
    reach = 1.0 - (1.0 - share) ** picks_per_group
    return (1.0 - 1.0 / m) * (tokens * reach).sum(axis=0)
