"""moejax.parallel: the MoE layer on device meshes (expert, data and tensor parallel experts).

Mesh axes `data`, `expert`, `model` (any subset). Stored expert weights keep one layout: `E` over
`expert`, `F` over `model`; router replicated; tokens over `("data", "expert")`. One entry point,
`moe_apply_sharded(params, x, config, mesh, strategy=..., implementation=...)`, computes the same
function (outputs, gradients, aux) as `moejax.moe_apply` for every strategy:

- mode `"expert"` with dispatcher `"capacity"` (GShard all-to-all with fixed buffers),
  `"dropless"` (bounded all-to-all in rounds: never drops, buffer `N * bucket` rows per round),
  or `"allgather"` (all-gather tokens, local experts, reduce-scatter);
- mode `"data"` (all-gather expert weights, ZeRO-style) and `"tensor"` (re-slice weights over F);
- pipeline degree `chunks` in 1, 2, 4, 8;
- an optional expert placement, `slot_table` (`moejax.parallel.slots`): physical `[P, ...]`
  expert slots with replicas of hot experts, chosen by the host controller of `moejax.placement`.

`strategy_space(config)` lists the strategies a layer can run; a training run chooses among them
by timing its own steps (`moejax.training.tuning`).

>>> import jax, jax.numpy as jnp, moejax
>>> from moejax import parallel
>>> cfg = moejax.MoEConfig(d_model=16, d_ff=32, num_experts=8, top_k=2, block_size=8)
>>> mesh = parallel.make_mesh((8,), ("expert",))
>>> params = parallel.shard_params(moejax.init_moe_params(cfg, jax.random.key(0)), cfg, mesh)
>>> x = parallel.shard_activations(jnp.ones((64, 16)), mesh)
>>> y, aux = parallel.moe_apply_sharded(params, x, cfg, mesh)
>>> y.shape, float(aux.dropped_fraction)
((64, 16), 0.0)
"""

from moejax.parallel import slots as slots
from moejax.parallel import traffic as traffic
from moejax.parallel._local import local_moe as local_moe
from moejax.parallel.dispatch_dropless import choose_bucket as choose_bucket
from moejax.parallel.dispatch_dropless import default_bucket as default_bucket
from moejax.parallel.dispatch_dropless import max_pair_count as max_pair_count
from moejax.parallel.layer import moe_apply_sharded as moe_apply_sharded
from moejax.parallel.mesh import AXES as AXES
from moejax.parallel.mesh import activation_spec as activation_spec
from moejax.parallel.mesh import make_mesh as make_mesh
from moejax.parallel.mesh import param_partition_specs as param_partition_specs
from moejax.parallel.mesh import shard_activations as shard_activations
from moejax.parallel.mesh import shard_params as shard_params
from moejax.parallel.modes import MODES as MODES
from moejax.parallel.slots import SlotTable as SlotTable
from moejax.parallel.slots import slot_table as slot_table
from moejax.parallel.strategy import DISPATCHERS as DISPATCHERS
from moejax.parallel.strategy import PIPELINE_DEGREES as PIPELINE_DEGREES
from moejax.parallel.strategy import Strategy as Strategy
from moejax.parallel.strategy import strategy_space as strategy_space

__all__ = [
    "AXES",
    "DISPATCHERS",
    "MODES",
    "PIPELINE_DEGREES",
    "SlotTable",
    "Strategy",
    "activation_spec",
    "choose_bucket",
    "default_bucket",
    "local_moe",
    "make_mesh",
    "max_pair_count",
    "moe_apply_sharded",
    "param_partition_specs",
    "shard_activations",
    "shard_params",
    "slot_table",
    "slots",
    "strategy_space",
    "traffic",
]
