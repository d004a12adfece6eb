"""moejax: dropless Mixture-of-Experts layers for JAX on device meshes.

Public surface (everything else is private and may change):

- `MoEConfig`: the frozen, validated layer config; `presets` fills it for published families.
- `init_moe_params`, `param_specs`: the parameter tree (names, shapes, initialisers).
- `moe_apply(params, x, config, implementation=...)` -> `(y, MoEAux)`; `IMPLEMENTATIONS` names
  the values of `implementation=` and `resolve_implementation` maps `"auto"` to one of them.
- `route` -> `Routing`, `load_balance_loss`, `z_loss`, `update_correction_bias`: the routing
  phase and its auxiliary quantities.
- `record_to_json`, `record_from_json`: every config record (`MoEConfig`, `moejax.models.
  LMConfig`, `moejax.training.TrainConfig`, ...) as JSON and back, nested records rebuilt.
- `MoE` (Flax NNX, also `moejax.nnx.MoE`) and `moejax.linen.MoE` (Flax Linen): module shells
  over `moe_apply`; the submodules `moejax.nnx` and `moejax.linen` are loaded by `import moejax`.

>>> import jax, jax.numpy as jnp, moejax
>>> cfg = moejax.MoEConfig(d_model=16, d_ff=32, num_experts=4, top_k=2)
>>> params = moejax.init_moe_params(cfg, jax.random.key(0))
>>> y, aux = moejax.moe_apply(params, jnp.ones((4, 16)), cfg)
"""

from moejax import linen as linen
from moejax import nnx as nnx
from moejax import presets as presets
from moejax._config import MoEConfig as MoEConfig
from moejax._layer import IMPLEMENTATIONS as IMPLEMENTATIONS
from moejax._layer import moe_apply as moe_apply
from moejax._layer import resolve_implementation as resolve_implementation
from moejax._params import init_moe_params as init_moe_params
from moejax._params import param_specs as param_specs
from moejax._routing import apply_capacity as apply_capacity
from moejax._routing import load_balance_loss as load_balance_loss
from moejax._routing import route as route
from moejax._routing import update_correction_bias as update_correction_bias
from moejax._routing import z_loss as z_loss
from moejax._types import MoEAux as MoEAux
from moejax._types import Routing as Routing
from moejax.nnx import MoE as MoE
from moejax.records import record_from_json as record_from_json
from moejax.records import record_to_json as record_to_json

__all__ = [
    "IMPLEMENTATIONS",
    "MoE",
    "MoEAux",
    "MoEConfig",
    "Routing",
    "apply_capacity",
    "init_moe_params",
    "linen",
    "load_balance_loss",
    "moe_apply",
    "nnx",
    "param_specs",
    "presets",
    "record_from_json",
    "record_to_json",
    "resolve_implementation",
    "route",
    "update_correction_bias",
    "z_loss",
]
