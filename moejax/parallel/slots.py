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
- `combine_replica_grads(grads, table, mesh)`: replica gradients summed per expert and handed
  back to every replica, so replicas stay identical and the update equals the unreplicated one;
  only experts held on several devices communicate, in one packed `psum` whose size follows
  their number (`sync_ranks`, `sync_buffer_sizes`).
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
from jax.sharding import PartitionSpec

from moejax.parallel import _collectives as col


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


def sync_buffer_sizes(num_slots: int, num_experts: int) -> tuple[int, ...]:
    """The sizes, in expert gradients, of the buffers the replica sync may all-reduce.

    At most `min(P - E, E)` experts sit on two devices or more (each needs a spare slot); the
    sizes are 0, then the powers of two below that bound, then the bound: `(0,)` when `P == E`,
    `(0, 1, 2, 4, 6)` for 6 spare slots. A step with `m` experts to sync all-reduces the smallest
    size `>= m` (`combine_replica_grads`), so it moves less than `2 m` gradients, and the
    compiled step holds one branch per size, each with its own static shape.

    >>> sync_buffer_sizes(12, 8)
    (0, 1, 2, 4)
    """
    bound = min(num_slots - num_experts, num_experts)
    powers = [1 << i for i in range(max(bound, 1).bit_length()) if 1 << i < bound]
    return (0, *powers, bound) if bound > 0 else (0,)


def sync_ranks(table: SlotTable, num_devices: int) -> tuple[jax.Array, jax.Array]:
    """Which experts need a cross-device gradient sum, numbered for a packed buffer.

    Args:
      table: the placement; slot `p` lives on device `p // S`, `S = P / num_devices`.
      num_devices: `N`, devices of the `expert` axis.

    Returns:
      `rank [E]` int32: expert `e`'s row in the packed buffer when its slots lie on two devices
      or more (ranks `0 .. m - 1` in expert order), else `E` (no row); `m []` int32.
    """
    p, e = table.num_slots, table.num_experts
    device = jnp.arange(p) // (p // num_devices)
    holds = jnp.zeros((num_devices, e), jnp.int32).at[device, table.slot_to_expert].max(1)
    spans = holds.sum(axis=0) >= 2  # [E]
    rank = jnp.where(spans, jnp.cumsum(spans) - 1, e).astype(jnp.int32)
    return rank, spans.sum().astype(jnp.int32)


def _sum_local(g: jax.Array, expert: jax.Array) -> jax.Array:
    """`[S, ...]` gradients of one device's slots: each slot gets the sum over this device's
    slots of its expert (local duplicates summed once, in slot order)."""
    s = expert.shape[0]
    first = jnp.argmax(expert[:, None] == expert[None, :], axis=1)  # [S] first local slot
    return jnp.take(jax.ops.segment_sum(g, first, s), first, axis=0)


def _sync(size: int, g: jax.Array, local: jax.Array, row: jax.Array, axis: str | None):
    """One branch of the replica sync: a `[size, ...]` buffer holding, at row `row[s]`, the sum
    of this device's slots `s` of that expert, summed over `axis`; every slot with a row reads
    its expert's total, the others keep their local sum. `size == 0`: no collective."""
    if size == 0:
        return local
    packed = jnp.zeros((size,) + g.shape[1:], g.dtype).at[row].add(g, mode="drop")
    total = col.psum(packed, axis)
    synced = (row < size).reshape((-1,) + (1,) * (g.ndim - 1))
    return jnp.where(synced, jnp.take(total, jnp.minimum(row, size - 1), axis=0), local)


def _combine_shard(grads: dict, table: SlotTable, num_devices: int, axis: str | None) -> dict:
    """`combine_replica_grads` on one device's `[S, ...]` slots (inside shard_map when
    `num_devices > 1`)."""
    s = table.num_slots // num_devices
    device = jax.lax.axis_index(axis) if num_devices > 1 else 0
    expert = jax.lax.dynamic_slice_in_dim(table.slot_to_expert, device * s, s)  # [S]
    local = jax.tree.map(lambda g: _sum_local(g, expert), grads)
    sizes = sync_buffer_sizes(table.num_slots, table.num_experts) if num_devices > 1 else (0,)
    if len(sizes) == 1:
        return local
    rank, m = sync_ranks(table, num_devices)
    row = rank[expert]  # [S]
    branch = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), m)  # smallest size >= m

    def run(size):
        return lambda g, loc: jax.tree.map(lambda a, b: _sync(size, a, b, row, axis), g, loc)

    return jax.lax.switch(branch, [run(size) for size in sizes], grads, local)


def combine_replica_grads(grads: dict, table: SlotTable, mesh=None, specs=None) -> dict:
    """Sum each expert's replica gradients and give the sum to every replica.

    With identical replicas, the loss depends on an expert's weights through all of its replicas,
    so the logical gradient is the sum of the replica gradients; handing it to every replica keeps
    them identical under any optimizer that acts elementwise on identical states (Adam, SGD).

    Communication is proportional to replication. Each device first sums its own duplicates of
    an expert (no communication). Only the `m` experts whose slots lie on two devices or more
    (`sync_ranks`) need more: their local sums are packed into one `[B, ...]` buffer per array
    (`B` = the smallest of `sync_buffer_sizes(P, E)` that is `>= m`), and one `psum` over the
    `expert` axis adds it up; each of their slots reads its expert's row back. The branch of each
    `B` is compiled once (`lax.switch` on `m`, the table is an argument), so a placement with no
    expert across devices runs no collective, and a layout without spare slots (`P == E`) compiles
    none. Each device of the `expert` axis sends `2 (N - 1) / N · B` expert gradients (a ring
    all-reduce; `moejax.placement.Workload(replica_sync="packed")` charges exactly that).

    Args:
      grads: `[P, ...]` gradients of the physical expert arrays (`P` over `expert` on `mesh`).
      table: the placement (its `N` is `mesh`'s `expert` axis size).
      mesh: the mesh the gradients live on; None: one device (no collective).
      specs: `PartitionSpec`s of `grads` on `mesh` (a tree like `grads`; default: `P` over
        `expert`, the rest whole). Only `expert` is communicated over; other split axes
        (`fsdp` on `D`, `model` on `F`) stay split.

    Returns:
      `[P, ...]` combined gradients, sharded like `grads`.
    """
    n = 1 if mesh is None else dict(mesh.shape).get("expert", 1)
    if n == 1:
        return _combine_shard(grads, table, 1, None)
    if table.num_slots % n:
        raise ValueError(f"table.num_slots={table.num_slots}: not divisible by expert={n}")
    if specs is None:
        specs = jax.tree.map(lambda _: PartitionSpec("expert"), grads)
    body = lambda g, t: _combine_shard(g, t, n, "expert")
    table_spec = jax.tree.map(lambda _: PartitionSpec(), table)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, table_spec), out_specs=specs)(
        grads, table
    )


def migrate(physical, sources: jax.Array):
    """State of a new placement: new slot `p` takes old slot `sources[p]` (any pytree of
    `[P, ...]` arrays: params, optimizer moments). Under `jit` with `[P, ...]` arrays split over
    `expert`, XLA inserts the collectives; a slot whose source is itself is a local copy."""
    return jax.tree.map(lambda w: jnp.take(w, sources, axis=0), physical)
