"""Expert placement on the device side: physical expert slots, replica choice, replica gradients.

A `moejax.placement.Placement` (host numpy) says which expert each of the `P = N·S` physical
slots holds; slot `p` lives on expert-axis device `p // S`. With a placement, a layer's stored
expert weights are physical, `[P, ...]` (`experts/w_up [P, D, F]`, ...), split over `expert` like
the logical `[E, ...]` layout, and hot experts hold several identical replicas.

`SlotTable` is the placement as device arrays. It is an argument of the step, not a constant
compiled into it: a new placement of the same shape (same `P`, `E`) reuses the compiled step, so
re-placing experts costs a parameter gather and no recompilation.

Pure functions (shape letters from docs/design.md):

- `slot_table(placement)`: numpy `Placement` -> `SlotTable`.
- `assign_slots(expert_index, kept, table, shard)`: the slot of every assignment. The j-th
  assignment (in token order) of this shard to expert `e` goes to replica `(j + shard) mod r_e`,
  so every shard splits its rows of `e` evenly over `e`'s `r_e` replicas (remainders rotate with
  the shard index). No communication.
- `to_physical(experts, table)`, `to_logical(physical, table)`: `[E, ...]` <-> `[P, ...]`.
- `combine_replica_grads(grads, table)`: replica gradients summed per expert and handed back to
  every replica, so replicas stay identical and the update equals the unreplicated one.
- `migrate(physical, sources)`: the physical state of a new placement, gathered from the slots
  `moejax.placement.migration_sources(old, new)` names (params and optimizer state alike).

>>> import numpy as np
>>> from moejax.placement import Placement
>>> p = Placement(np.array([0, 0, 1, 2]), num_experts=3, num_devices=2, slots_per_device=2)
>>> t = slot_table(p)
>>> t.replica_count.tolist(), t.replica_slots[:, :2].tolist()
([2, 1, 1], [[0, 1], [2, 2], [3, 3]])
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotTable:
    """A placement as device arrays (see module docstring).

    `Rm = P - E + 1` is the most replicas one expert can hold when every expert holds one slot,
    so the array shapes depend on `P` and `E` only, never on the placement itself.
    """

    slot_to_expert: jax.Array  # [P] int32 expert held by each slot
    replica_slots: jax.Array  # [E, Rm] int32 slots of each expert, ascending, padded by repeats
    replica_count: jax.Array  # [E] int32 replicas of each expert (>= 1)

    @property
    def num_slots(self) -> int:
        """`P`."""
        return self.slot_to_expert.shape[0]

    @property
    def num_experts(self) -> int:
        """`E`."""
        return self.replica_count.shape[0]


def slot_table(placement) -> SlotTable:
    """The device form of a `moejax.placement.Placement` (numpy arrays, placed by `jit`)."""
    table = np.asarray(placement.slot_to_expert)
    e, p = placement.num_experts, table.shape[0]
    width = p - e + 1
    replica_slots = np.zeros((e, width), np.int32)
    count = np.bincount(table, minlength=e).astype(np.int32)
    for expert in range(e):
        slots = np.flatnonzero(table == expert)
        replica_slots[expert] = np.resize(slots, width)  # repeats: never read past the count
    return SlotTable(
        slot_to_expert=jnp.asarray(table, jnp.int32),
        replica_slots=jnp.asarray(replica_slots),
        replica_count=jnp.asarray(count),
    )


def assign_slots(
    expert_index: jax.Array, kept: jax.Array, table: SlotTable, shard: jax.Array | int = 0
) -> jax.Array:
    """The physical slot of every assignment: an even split over each expert's replicas.

    Args:
      expert_index: `[T, K]` int32 logical experts.
      kept: `[T, K]` bool; dropped assignments take no share (their slot is arbitrary).
      table: the placement.
      shard: this token shard's index (rotates which replicas get the remainders).

    Returns:
      `[T, K]` int32 slots in `[0, P)`.
    """
    t, k = expert_index.shape
    e = table.num_experts
    a = t * k
    expert = jnp.where(kept, expert_index, e).reshape(a)
    order = jnp.argsort(expert, stable=True)
    counts = jnp.bincount(expert, length=e + 1)
    start = jnp.cumsum(counts) - counts
    rank = (
        jnp.zeros(a, jnp.int32)
        .at[order]
        .set((jnp.arange(a) - start[expert[order]]).astype(jnp.int32), unique_indices=True)
    )
    safe = jnp.minimum(expert, e - 1)
    replica = (rank + shard) % table.replica_count[safe]
    return table.replica_slots[safe, replica].reshape(t, k)


def to_physical(experts: dict, table: SlotTable) -> dict:
    """`[E, ...]` logical expert arrays -> `[P, ...]` physical ones (replicas are copies)."""
    return jax.tree.map(lambda w: jnp.take(w, table.slot_to_expert, axis=0), experts)


def to_logical(physical: dict, table: SlotTable) -> dict:
    """`[P, ...]` physical expert arrays -> `[E, ...]`, read from each expert's first replica."""
    first = table.replica_slots[:, 0]
    return jax.tree.map(lambda w: jnp.take(w, first, axis=0), physical)


def combine_replica_grads(grads: dict, table: SlotTable) -> dict:
    """Sum each expert's replica gradients and give the sum to every replica.

    With identical replicas, the loss depends on an expert's weights through all of its replicas,
    so the logical gradient is the sum of the replica gradients; handing it to every replica keeps
    them identical under any optimizer that acts elementwise on identical states (Adam, SGD).

    Args:
      grads: `[P, ...]` gradients of the physical expert arrays.
      table: the placement.

    Returns:
      `[P, ...]` combined gradients.
    """

    def one(g):
        per_expert = jax.ops.segment_sum(g, table.slot_to_expert, table.num_experts)
        return jnp.take(per_expert, table.slot_to_expert, axis=0)

    return jax.tree.map(one, grads)


def migrate(physical, sources: jax.Array):
    """State of a new placement: new slot `p` takes old slot `sources[p]` (any pytree of
    `[P, ...]` arrays: params, optimizer moments). Under `jit` with `[P, ...]` arrays split over
    `expert`, XLA inserts the collectives; a slot whose source is itself is a local copy."""
    return jax.tree.map(lambda w: jnp.take(w, sources, axis=0), physical)
