"""The parameter tree of one MoE layer: names, shapes and initialisers, shared by the functional
API, the NNX module and the Linen module so that all three hold the same tree.

```
router/kernel                 [D, E]
router/bias                   [E]      (router_bias)
router/score_correction_bias  [E]      (score_correction_bias; not trained by the optimizer)
experts/w_gate                [E, D, F] (gated activations)
experts/w_up                  [E, D, F]
experts/w_down                [E, F, D]
experts/b_gate, b_up          [E, F]   (expert_bias; b_gate only when gated)
experts/b_down                [E, D]   (expert_bias)
shared/w_gate                 [D, Fs]  (shared experts, gated activations)
shared/w_up                   [D, Fs]
shared/w_down                 [Fs, D]
shared/gate                   [D, 1]   (shared_gate)
```
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax._config import MoEConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Shape and initialiser of one parameter. `fan_in_axis` None means zeros."""

    shape: tuple[int, ...]
    fan_in_axis: int | None = -2
    # Logical axis names (shape letters), used for sharding by `moejax.parallel`.
    axes: tuple[str, ...] = ()


def param_specs(config: MoEConfig) -> dict[str, dict[str, ParamSpec]]:
    """The nested `{group: {name: ParamSpec}}` tree for `config` (see module docstring)."""
    d, f, e, fs = config.d_model, config.d_ff, config.num_experts, config.shared_width
    router = {"kernel": ParamSpec((d, e), axes=("D", "E"))}
    if config.router_bias:
        router["bias"] = ParamSpec((e,), None, ("E",))
    if config.score_correction_bias:
        router["score_correction_bias"] = ParamSpec((e,), None, ("E",))
    experts = {
        "w_up": ParamSpec((e, d, f), axes=("E", "D", "F")),
        "w_down": ParamSpec((e, f, d), axes=("E", "F", "D")),
    }
    if config.gated:
        experts["w_gate"] = ParamSpec((e, d, f), axes=("E", "D", "F"))
    if config.expert_bias:
        experts["b_up"] = ParamSpec((e, f), None, ("E", "F"))
        experts["b_down"] = ParamSpec((e, d), None, ("E", "D"))
        if config.gated:
            experts["b_gate"] = ParamSpec((e, f), None, ("E", "F"))
    tree = {"router": router, "experts": experts}
    if fs:
        shared = {
            "w_up": ParamSpec((d, fs), axes=("D", "Fs")),
            "w_down": ParamSpec((fs, d), axes=("Fs", "D")),
        }
        if config.gated:
            shared["w_gate"] = ParamSpec((d, fs), axes=("D", "Fs"))
        if config.shared_gate:
            shared["gate"] = ParamSpec((d, 1), axes=("D", None))
        tree["shared"] = shared
    return tree


def init_param(spec: ParamSpec, key: jax.Array, config: MoEConfig) -> jax.Array:
    """Normal(0, init_scale / sqrt(fan_in)) for projections, zeros for biases."""
    dtype = jnp.dtype(config.param_dtype)
    if spec.fan_in_axis is None:
        return jnp.zeros(spec.shape, dtype)
    std = config.init_scale / spec.shape[spec.fan_in_axis] ** 0.5
    return (std * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)


def init_moe_params(config: MoEConfig, key: jax.Array) -> dict:
    """Initialise the parameters of one MoE layer.

    Args:
      config: the layer config.
      key: a PRNG key.

    Returns:
      The nested parameter dict (see the module docstring for names and shapes).

    >>> import jax, moejax
    >>> cfg = moejax.MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2)
    >>> params = moejax.init_moe_params(cfg, jax.random.key(0))
    >>> params["experts"]["w_up"].shape
    (4, 8, 16)
    """
    specs = param_specs(config)
    flat = [(g, n, s) for g, group in specs.items() for n, s in group.items()]
    keys = jax.random.split(key, len(flat))
    params: dict = {g: {} for g in specs}
    for k, (g, n, s) in zip(keys, flat, strict=True):
        params[g][n] = init_param(s, k, config)
    return params
