"""Flax Linen shell over the functional layer: holds the same parameter tree, returns `(y, aux)`.

Trained parameters live in the `"params"` collection. The DeepSeek-V3 correction bias
(`router/score_correction_bias`) is not trained by the optimizer (it is updated by
`moejax.update_correction_bias`), so it lives in its own collection, `CORRECTION_BIAS =
"correction_bias"`, at the
same path: an optimizer over `variables["params"]` (weight decay included) never touches it, as
`nnx.Optimizer(..., wrt=nnx.Param)` never touches the NNX module's `CorrectionBias`.
`to_variables` and `from_variables` convert between a functional tree and Linen variables.

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

__all__ = ["CORRECTION_BIAS", "MoE", "from_variables", "to_variables"]

CORRECTION_BIAS = "correction_bias"  # collection of the untrained router/score_correction_bias
_PARAMS = "params"
_UNTRAINED = ("router", "score_correction_bias")


def to_variables(tree: dict) -> dict:
    """Linen variables `{"params": ..., "correction_bias": ...}` holding a functional tree.

    Args:
      tree: a parameter tree as `moejax.init_moe_params` returns it.

    Returns:
      The variables `MoE.apply` takes (the `"correction_bias"` collection only when the tree has
      `router/score_correction_bias`).
    """
    group, name = _UNTRAINED
    params = {g: dict(leaves) for g, leaves in tree.items()}
    variables = {_PARAMS: params}
    if name in params.get(group, {}):
        variables[CORRECTION_BIAS] = {group: {name: params[group].pop(name)}}
    return variables


def from_variables(variables: dict) -> dict:
    """The functional tree held by Linen variables (inverse of `to_variables`)."""
    tree = {g: dict(leaves) for g, leaves in variables[_PARAMS].items()}
    for group, leaves in variables.get(CORRECTION_BIAS, {}).items():
        tree[group].update(leaves)
    return tree


class MoE(nn.Module):
    """An MoE feed-forward layer (Flax Linen).

    Parameters live at `params/{router,experts,shared}/...` with the names, shapes and dtypes of
    `moejax.init_moe_params`; the correction bias at `correction_bias/router/score_correction_bias`
    (see the module docstring). `apply(to_variables(tree), x)` equals
    `moejax.moe_apply(tree, x, config)`.
    """

    config: MoEConfig
    implementation: Implementation = "auto"

    @nn.compact
    def __call__(self, x: jax.Array):
        """`x [..., D]` -> `(y [..., D], MoEAux)`."""
        specs = param_specs(self.config)
        group, name = _UNTRAINED
        untrained = specs[group].pop(name, None)
        params = {
            g: self.param(g, self._init_group, tuple(leaves.items())) for g, leaves in specs.items()
        }
        if untrained is not None:
            bias = self.variable(
                CORRECTION_BIAS, group, lambda: {name: init_param(untrained, None, self.config)}
            )
            params[group] = {**params[group], **bias.value}
        return moe_apply(params, x, self.config, implementation=self.implementation)

    def _init_group(self, key, leaves):
        keys = jax.random.split(key, len(leaves))
        return {
            name: init_param(spec, k, self.config)
            for (name, spec), k in zip(leaves, keys, strict=True)
        }
