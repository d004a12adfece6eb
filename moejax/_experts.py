"""Phase 3, experts: activations, the grouped expert FFN, the shared-expert MLP, and the
per-expert loop reference that is the test oracle for every implementation."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from moejax._config import MoEConfig
from moejax._types import Routing

GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def activate(gate: jax.Array | None, up: jax.Array, config: MoEConfig) -> jax.Array:
    """Expert hidden activation from the gate and up projections (gate is None if not gated)."""
    act = config.activation
    if act == "swiglu":
        return jax.nn.silu(gate) * up
    if act == "geglu":
        return jax.nn.gelu(gate, approximate=True) * up
    if act == "clamped_swiglu":
        gate = jnp.minimum(gate, config.swiglu_limit)
        up = jnp.clip(up, -config.swiglu_limit, config.swiglu_limit)
        return (up + 1) * gate * jax.nn.sigmoid(config.swiglu_alpha * gate)
    if act == "gelu":
        return jax.nn.gelu(up, approximate=True)
    if act == "relu":
        return jax.nn.relu(up)
    raise ValueError(f"unknown activation {act!r}")  # unreachable: MoEConfig validates it


def grouped_ffn(
    rows: jax.Array,
    group_sizes: jax.Array,
    group_of_row: jax.Array,
    experts: dict,
    config: MoEConfig,
    gmm: GroupedMatmul,
) -> jax.Array:
    """Run every expert on its rows.

    Args:
      rows: `[R, D]` tokens sorted by expert (padding rows are zero).
      group_sizes: `[E]` rows per expert, in row order.
      group_of_row: `[R]` expert of each row (for the biases).
      experts: `experts/...` parameters: `w_gate`, `w_up [E, D, F]`, `w_down [E, F, D]`, biases.
      config: the layer config.
      gmm: a grouped matmul (see `moejax._gmm`); with `expert_precision="fp8"`, a
        `moejax._gmm.Fp8Matmul`, whose `swiglu_ffn` runs a SwiGLU FFN whole.

    Returns:
      `[R, D]` expert outputs, unweighted (padding rows hold garbage that is never read).
    """
    dtype = rows.dtype
    if config.fp8_swiglu_ffn:
        # The whole FFN in one fp8 op: the activation computed where it is quantized, and the
        # weights quantized as stored (fp32 master weights without a 16-bit copy).
        weights = (experts[f"w_{name}"] for name in ("gate", "up", "down"))
        return gmm.swiglu_ffn(rows, *weights, group_sizes)

    def proj(x, name):
        y = gmm(x, experts[f"w_{name}"].astype(dtype), group_sizes)
        if config.expert_bias:
            y = y + jnp.take(experts[f"b_{name}"].astype(dtype), group_of_row, axis=0)
        return y

    gate = proj(rows, "gate") if config.gated else None
    h = activate(gate, proj(rows, "up"), config)
    return proj(h, "down")


def shared_mlp(shared: dict, x: jax.Array, config: MoEConfig) -> jax.Array:
    """The shared experts, fused into one MLP of width `Fs`, optionally sigmoid-gated per token.

    Args:
      shared: `shared/...` parameters: `w_gate`, `w_up [D, Fs]`, `w_down [Fs, D]`, `gate [D, 1]`.
      x: `[T, D]`.
      config: the layer config.

    Returns:
      `[T, D]`.
    """
    dtype = x.dtype
    gate = x @ shared["w_gate"].astype(dtype) if config.gated else None
    y = activate(gate, x @ shared["w_up"].astype(dtype), config) @ shared["w_down"].astype(dtype)
    if config.shared_gate:
        y = y * jax.nn.sigmoid(x @ shared["gate"].astype(dtype))
    return y


def reference_experts(experts: dict, x: jax.Array, routing: Routing, config: MoEConfig):
    """The oracle: a Python loop over experts, each run densely on all T tokens and masked.

    `y[t] = sum_e c[t, e] * ffn_e(x[t])` with `c[t, e]` the summed combine weight of the kept
    assignments of token t to expert e (cast to the activation dtype, as `combine` does).

    Args:
      experts: `experts/...` parameters.
      x: `[T, D]`.
      routing: the routing (with `kept` applied).
      config: the layer config.

    Returns:
      `[T, D]`.
    """
    dtype = x.dtype
    w = routing.weight.astype(dtype)
    y = jnp.zeros_like(x)
    for e in range(config.num_experts):
        mask = (routing.expert_index == e) & routing.kept
        c = jnp.where(mask, w, 0).sum(-1)  # [T]

        def proj(h, name, e=e):
            out = h @ experts[f"w_{name}"][e].astype(dtype)
            if config.expert_bias:
                out = out + experts[f"b_{name}"][e].astype(dtype)
            return out

        gate = proj(x, "gate") if config.gated else None
        y = y + c[:, None] * proj(activate(gate, proj(x, "up"), config), "down")
    return y
