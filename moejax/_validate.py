"""Input checks of the layer entry points (`moe_apply`, `moe_apply_sharded`, the NNX and Linen
modules), run before anything is traced.

They read only Python structure, shapes and dtypes (never values), so under `jit` they cost
nothing per call: they run once, at trace time. Each mistake is one `TypeError` (wrong kind of
thing: not a dict, not an array, not a float) or `ValueError` (wrong key or shape) naming the
parameter path and what the config expects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax.numpy as jnp

from moejax._config import MoEConfig
from moejax._params import param_specs


def check_layer_inputs(
    params, x, config: MoEConfig, *, experts_config: MoEConfig | None = None
) -> None:
    """Raise a clear error if `params` or `x` cannot run through the layer of `config`.

    Args:
      params: the parameter tree (`{group: {name: array}}`, see `moejax.init_moe_params`).
      x: `[..., D]` tokens: an array of a floating dtype, rank >= 2, last dim `config.d_model`.
        An empty batch (no tokens) is valid.
      config: the layer config.
      experts_config: the config the `experts/...` arrays follow when it differs from `config`
        (a placement: `[P, ...]` physical slots in place of `E` experts).
    """
    check_x(x, config)
    check_params(params, config, experts_config=experts_config)


def check_x(x, config: MoEConfig) -> None:
    """`x` is a floating array `[..., D]` of rank >= 2 with `D = config.d_model`."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"x must be an array [..., D], got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x has dtype {x.dtype}: must be a floating dtype (float32, bfloat16, ...)")
    if x.ndim < 2:
        raise ValueError(
            f"x.shape={tuple(x.shape)}: need rank >= 2, [T, D] or [B, S, D] (one token is [1, D])"
        )
    if x.shape[-1] != config.d_model:
        raise ValueError(
            f"x.shape={tuple(x.shape)}: last dim must be D=config.d_model={config.d_model}"
        )


def is_empty(x) -> bool:
    """Whether `x [..., D]` holds no tokens (some leading dim is 0)."""
    return math.prod(x.shape[:-1]) == 0


def check_params(params, config: MoEConfig, *, experts_config: MoEConfig | None = None) -> None:
    """`params` has exactly the groups, names and shapes of `param_specs(config)` (the experts'
    from `experts_config` when given), every leaf a floating array."""
    expected = param_specs(config)
    if experts_config is not None:
        expected["experts"] = param_specs(experts_config)["experts"]
    _check_mapping(params, "params")
    for group in params:
        if group not in expected:
            raise ValueError(f"params[{group!r}]: {_unused(group, None, config)}")
    for group, specs in expected.items():
        if group not in params:
            raise ValueError(
                f"params[{group!r}] is missing: this config needs {sorted(specs)} in it"
            )
        leaves = params[group]
        path = f"params[{group!r}]"
        _check_mapping(leaves, path)
        for name in leaves:
            if name not in specs:
                raise ValueError(f"{path}[{name!r}]: {_unused(group, name, config)}")
        for name, spec in specs.items():
            letters = _letters(group, spec.axes, experts_config)
            want = f"{letters} = {spec.shape}"
            if name not in leaves:
                raise ValueError(f"{path}[{name!r}] is missing: this config needs {want}")
            leaf = leaves[name]
            if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                raise TypeError(f"{path}[{name!r}] must be an array {want}, got {type(leaf)}")
            if tuple(leaf.shape) != spec.shape:
                raise ValueError(
                    f"{path}[{name!r}] has shape {tuple(leaf.shape)}: this config needs {want}"
                )
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise TypeError(f"{path}[{name!r}] has dtype {leaf.dtype}: must be floating")


def _check_mapping(tree, path: str) -> None:
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"{path} must be a dict as moejax.init_moe_params returns, got {type(tree).__name__}"
        )


def _letters(group: str, axes: tuple, experts_config: MoEConfig | None) -> str:
    """Shape letters of a parameter, `P` (physical slots) for the experts under a placement."""
    slots = group == "experts" and experts_config is not None
    names = ["P" if slots and a == "E" else str(a) for a in axes]
    return "[" + ", ".join(names) + "]"


def _unused(group: str, name: str | None, config: MoEConfig) -> str:
    """Why the config has no use for `group/name` (a key it would silently ignore)."""
    if name is None:
        if group == "shared":
            return "not used by this config (num_shared_experts=0); remove it"
        return "unknown group: a layer's params hold 'router', 'experts' and 'shared' only"
    reasons = {
        ("router", "bias"): "router_bias=False",
        ("router", "score_correction_bias"): "score_correction_bias=False",
        ("shared", "gate"): "shared_gate=False",
    }
    if name in ("w_gate", "b_gate") and not config.gated:
        reason = f"activation={config.activation!r} has no gate"
    elif group == "experts" and name in ("b_up", "b_down", "b_gate"):
        reason = "expert_bias=False"
    else:
        reason = reasons.get((group, name))
    if reason is None:
        specs = param_specs(config).get(group, {})
        return f"unknown name; this config's {group!r} holds {sorted(specs)}"
    return f"not used by this config ({reason}); remove it"
