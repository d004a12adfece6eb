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
    """An MoE feed-forward layer (Flax NNX), on one device or a device mesh.

    Attributes `router`, `experts`, `shared` are `nnx.Dict`s whose leaves follow the tree of
    `moejax.init_moe_params` (same names, shapes and, for the same key, values).

    Args:
      config: the layer config.
      rngs: the parameters' initialisation keys (`rngs.params()`).
      implementation: as `moejax.moe_apply`'s.
      mesh: None (one device: `moejax.moe_apply`), or a `moejax.parallel.make_mesh` mesh: the
        parameters are stored in its layout (`parallel.shard_params`: experts over `expert`,
        `F` over `model`) and a call runs `parallel.moe_apply_sharded` on it (tokens over
        `data`, `fsdp` and `expert`; the batch must divide over them).
      strategy: with a mesh, `moe_apply_sharded`'s `strategy` (a `parallel.Strategy` or
        `"auto"`).

    >>> import jax.numpy as jnp, moejax
    >>> from flax import nnx
    >>> layer = moejax.MoE(moejax.MoEConfig(d_model=8, d_ff=16, num_experts=4), rngs=nnx.Rngs(0))
    >>> y, aux = layer(jnp.ones((3, 8)))
    >>> y.shape
    (3, 8)
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        rngs: nnx.Rngs,
        implementation: Implementation = "auto",
        mesh=None,
        strategy="auto",
    ):
        self.config = config
        self.implementation = implementation
        self.mesh, self.strategy = mesh, strategy
        tree = init_moe_params(config, rngs.params())
        if mesh is not None:
            from moejax import parallel  # the single-device layer does not need it

            tree = parallel.shard_params(tree, config, mesh)
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
        if self.mesh is None:
            return moe_apply(self.params_tree(), x, self.config, implementation=self.implementation)
        from moejax import parallel

        return parallel.moe_apply_sharded(
            self.params_tree(),
            x,
            self.config,
            self.mesh,
            strategy=self.strategy,
            implementation=self.implementation,
        )
