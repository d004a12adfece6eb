"""The planner's packers: where the replicas of a layer's experts go, computed from scratch.

Shape letters: ``E`` experts, ``N`` devices, ``S`` slots per device, ``G`` devices per node.

Private to ``moejax.placement`` (``planner.plan`` is the entry point; ``moejax.placement``
re-exports ``apportion``, ``replica_counts``, ``pack``, ``greedy_pack`` and ``pack_by_group``
for the benchmarks). One module per packer, the helpers they share in ``common``:

* ``flat``: replica counts (``apportion``, ``replica_counts``), a balanced packing of all
  devices (``pack``, ``pack_starts``), the migration-light repair (``rebalance``) and the
  relabelling onto the current placement (``align``).
* ``by_node``: experts dealt to nodes, replicas packed inside their node (``pack_by_node``).
* ``by_group``: whole expert groups dealt to nodes, for group-limited routing
  (``pack_by_group``).
* ``node_order``: a flat packing's devices ordered into nodes (``group_nodes``) and relabelled
  node by node (``align_nodes``).
* ``sync``: replicas moved between devices to lower the largest replica-sync share
  (``limit_sync``).
* ``common``: pair re-splits, device matching, replica candidates and packing inside nodes.

Plain numpy; no jax.
"""

from moejax.placement._packing.by_group import SPILL_LEVELS as SPILL_LEVELS
from moejax.placement._packing.by_group import pack_by_group as pack_by_group
from moejax.placement._packing.by_node import pack_by_node as pack_by_node
from moejax.placement._packing.by_node import pack_by_node_starts as pack_by_node_starts
from moejax.placement._packing.flat import align as align
from moejax.placement._packing.flat import apportion as apportion
from moejax.placement._packing.flat import fill_spare as fill_spare
from moejax.placement._packing.flat import greedy_pack as greedy_pack
from moejax.placement._packing.flat import pack as pack
from moejax.placement._packing.flat import pack_starts as pack_starts
from moejax.placement._packing.flat import rebalance as rebalance
from moejax.placement._packing.flat import replica_counts as replica_counts
from moejax.placement._packing.node_order import align_nodes as align_nodes
from moejax.placement._packing.node_order import group_nodes as group_nodes
from moejax.placement._packing.sync import limit_sync as limit_sync
from moejax.placement._packing.sync import sync_shares as sync_shares
