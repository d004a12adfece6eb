"""Flax NNX shell over the functional layer: holds the same parameter tree, returns `(y, aux)`."""

from __future__ import annotations

import jax
from flax import nnx

from moejax._config import MoEConfig
from moejax._layer import Implementation, moe_apply
from moejax._params import init_moe_params


class CorrectionBias(nnx.Variable):
    """`router/score_correction_bias`: updated by `moejax.update_correction_bias`, not by the
    optimizer (`nnx.Optimizer(..., wrt=nnx.Param)` leaves it alone)."""


class MoE(nnx.Module):
    """An MoE feed-forward layer (Flax NNX).

    Attributes `router`, `experts`, `shared` are `nnx.Dict`s whose leaves follow the tree of
    `moejax.init_moe_params` (same names, shapes and, for the same key, values).

    >>> import jax.numpy as jnp, moejax
    >>> from flax import nnx
    >>> layer = moejax.MoE(moejax.MoEConfig(d_model=8, d_ff=16, num_experts=4), rngs=nnx.Rngs(0))
    >>> y, aux = layer(jnp.ones((3, 8)))
    >>> y.shape
    (3, 8)
    """

    def __init__(
        self, config: MoEConfig, *, rngs: nnx.Rngs, implementation: Implementation = "auto"
    ):
        self.config = config
        self.implementation = implementation
        tree = init_moe_params(config, rngs.params())
        for group, leaves in tree.items():
            wrapped = {
                name: (CorrectionBias if name == "score_correction_bias" else nnx.Param)(value)
                for name, value in leaves.items()
            }
            setattr(self, group, nnx.Dict(wrapped))

    def params_tree(self) -> dict:
        """The plain nested dict of arrays, as `moe_apply` takes it."""
        groups = [g for g in ("router", "experts", "shared") if hasattr(self, g)]
        return {g: {n: v[...] for n, v in getattr(self, g).items()} for g in groups}

    def __call__(self, x: jax.Array):
        """`x [..., D]` -> `(y [..., D], MoEAux)`."""
        return moe_apply(self.params_tree(), x, self.config, implementation=self.implementation)
