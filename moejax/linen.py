"""Flax Linen shell over the functional layer: holds the same parameter tree, returns `(y, aux)`.

>>> import jax, jax.numpy as jnp, moejax, moejax.linen
>>> layer = moejax.linen.MoE(moejax.MoEConfig(d_model=8, d_ff=16, num_experts=4))
>>> variables = layer.init(jax.random.key(0), jnp.ones((3, 8)))
>>> sorted(variables["params"])
['experts', 'router']
"""

from __future__ import annotations

import flax.linen as nn
import jax

from moejax._config import MoEConfig
from moejax._layer import Implementation, moe_apply
from moejax._params import init_param, param_specs


class MoE(nn.Module):
    """An MoE feed-forward layer (Flax Linen).

    Parameters live at `params/{router,experts,shared}/...` with the names and shapes of
    `moejax.init_moe_params`, so a functional tree can be used as `{"params": tree}` directly.
    """

    config: MoEConfig
    implementation: Implementation = "auto"

    @nn.compact
    def __call__(self, x: jax.Array):
        """`x [..., D]` -> `(y [..., D], MoEAux)`."""
        params = {
            group: self.param(group, self._init_group, tuple(leaves.items()))
            for group, leaves in param_specs(self.config).items()
        }
        return moe_apply(params, x, self.config, implementation=self.implementation)

    def _init_group(self, key, leaves):
        keys = jax.random.split(key, len(leaves))
        return {
            name: init_param(spec, k, self.config)
            for (name, spec), k in zip(leaves, keys, strict=True)
        }
