"""`moe_apply`: the functional MoE layer, as four phases — route, permute, experts, unpermute."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from moejax import _gmm, _routing
from moejax._config import MoEConfig
from moejax._experts import grouped_ffn, reference_experts, shared_mlp
from moejax._fused import fused_moe
from moejax._permute import combine, make_layout, permute
from moejax._types import MoEAux, Routing
from moejax._validate import check_layer_inputs, is_empty

Implementation = Literal["auto", "reference", "ragged_dot", "blocked", "pallas"]
IMPLEMENTATIONS: tuple[str, ...] = Implementation.__args__


_ACCELERATORS = ("cuda", "rocm", "tpu")  # lowering platforms where "auto" means "pallas"


def resolve_implementation(implementation: str, platform: str | None = None) -> str:
    """Map `"auto"` to the implementation it runs when compiled for `platform`.

    Fallback order for `"auto"`: `pallas` on GPU and TPU (the block-sparse kernels), `blocked`
    (the fused XLA chunk loop, `moejax._fused`) everywhere else: on XLA:CPU it runs within a few
    percent of a dense FFN of the same FLOPs, where `ragged_dot` costs E times the FLOPs
    (`experiments/bench_layer.py`). `"reference"` is never picked automatically.

    The layers do not call this with the host's platform: they stage both candidates and let the
    compile target pick (`by_target`), so compiling for a GPU or TPU mesh from a CPU host runs
    the kernels. `platform` is a lowering platform ("cpu", "cuda", "rocm", "tpu"; "gpu" is
    accepted for "cuda"); None means the default backend's.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: must be one of {IMPLEMENTATIONS}")
    if implementation != "auto":
        return implementation
    platform = platform or jax.default_backend()
    return "pallas" if platform in (*_ACCELERATORS, "gpu") else "blocked"


def by_target(fn, implementation: str, *args):
    """`fn(*args, concrete_implementation)`; `"auto"` is decided by the platform the program is
    compiled for (`jax.lax.platform_dependent`): `"pallas"` on GPU and TPU, `"blocked"` elsewhere.
    Both are traced; lowering keeps one."""
    if implementation != "auto":
        return fn(*args, implementation)

    def run(impl):
        return lambda *a: fn(*a, impl)

    pallas = run("pallas")
    return jax.lax.platform_dependent(
        *args, **dict.fromkeys(_ACCELERATORS, pallas), default=run("blocked")
    )


def _gmm_for(implementation: str, config: MoEConfig):
    """The grouped matmul and the row alignment it wants, for the unfused phases (`moe_apply`
    runs `"blocked"` fused, see `moejax._fused`, except in fp8; `moejax.parallel` runs the
    phases per device). With `expert_precision="fp8"`, the fp8 recipe over the same alignment."""
    if implementation == "ragged_dot":
        gmm, alignment = _gmm.ragged_dot_gmm, 1
    elif implementation == "blocked":
        alignment = config.block_size
        gmm = functools.partial(_gmm.blocked_gmm, block=alignment)
    elif implementation == "pallas":
        import pallas_kernels

        alignment = pallas_kernels.group_alignment()  # 128 for Hopper's Mosaic GPU kernels
        gmm = functools.partial(_gmm.pallas_gmm, group_alignment=alignment)
    else:
        raise ValueError(f"no grouped matmul for implementation={implementation!r}")
    if config.expert_precision == "fp8":
        gmm = _gmm.Fp8Matmul(implementation, alignment, config.fp8_grad_format)
    return gmm, alignment


def moe_apply(
    params: dict,
    x: jax.Array,
    config: MoEConfig,
    *,
    implementation: Implementation = "auto",
    replay_experts: jax.Array | None = None,
) -> tuple[jax.Array, MoEAux]:
    """Apply one MoE layer.

    Args:
      params: the tree from `init_moe_params` (or the NNX/Linen modules).
      x: `[..., D]` tokens. With 3 or more dims, the second-to-last axis is the sequence: capacity
        (capacity mode, expert choice) is counted per sequence.
      config: the layer config.
      implementation: `"reference"` (per-expert loop, the oracle), `"ragged_dot"`, `"blocked"`
        (the XLA path for CPU: permute, experts and unpermute fused into one loop over chunks of
        expert-sorted rows), `"pallas"` (block-sparse kernels: Triton on GPU, Mosaic on TPU,
        interpreted on CPU), or `"auto"` (`"pallas"` when compiled for GPU or TPU, `"blocked"`
        otherwise; decided by the compile target, see `by_target`).
      replay_experts: router replay: None, or `[..., K]` int expert ids (x's token axes, then
        `top_k`), e.g. a recorded `aux.topk_indices` reshaped to x's token axes. They replace
        the router's top-k; the weights are recomputed by the current router over those experts
        (`moejax._routing.replayed`), and capacity, counts and losses follow them.

    Returns:
      `(y, aux)`: `y` of the shape and dtype of `x`, `aux` a `MoEAux` of routing statistics and
      auxiliary losses (over the T flattened tokens). An empty batch (T = 0) gives an empty `y`
      and zero aux (`empty_outputs`). Called eagerly, the layer compiles once per shape and
      config (`jax.jit` inside); under the caller's `jit` or `grad` it is traced inline.

    Raises:
      TypeError, ValueError: before tracing, for a params tree that does not match `config`
        (a missing or unused key, a wrong shape: the path and the expected shape are named), an
        x that is not a floating array `[..., D]` of rank >= 2 (`moejax._validate`).

    >>> import jax, jax.numpy as jnp, moejax
    >>> cfg = moejax.MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2)
    >>> params = moejax.init_moe_params(cfg, jax.random.key(0))
    >>> y, aux = moejax.moe_apply(params, jnp.ones((2, 3, 8)), cfg)
    >>> y.shape, aux.expert_counts.sum().item(), aux.dropped_fraction.item()
    ((2, 3, 8), 12, 0.0)
    """
    check_layer_inputs(params, x, config)
    resolve_implementation(implementation)  # validates the name
    if replay_experts is not None:
        _routing.check_replay(replay_experts, x.shape[:-1], config, "replay_experts")
    if is_empty(x):
        return empty_outputs(params["router"], x, config)
    if is_traced(params, x, replay_experts):
        return _moe_apply(params, x, config, implementation, replay_experts)  # caller's jit/grad
    # Called eagerly: one compiled program per shape and config, not an op-by-op run.
    return _moe_apply_jit(params, x, config, implementation, replay_experts)


def is_traced(*trees) -> bool:
    """Whether any leaf of `trees` is a tracer (the call is inside a `jit`, `grad`, `vmap`...).
    The layer entry points jit themselves when called eagerly and inline otherwise."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(trees))


def _moe_apply(params, x, config, implementation, replay=None):
    """`moe_apply` on checked, non-empty inputs."""
    shape = x.shape
    num_sequences = math.prod(shape[:-2]) if x.ndim >= 3 else 1
    xt = x.reshape(-1, config.d_model)
    if replay is not None:
        replay = replay.reshape(-1, replay.shape[-1])

    with jax.named_scope("route"):
        routing = _routing.route(
            params["router"], xt, config, num_sequences=num_sequences, replay=replay
        )
        if config.drop_policy == "capacity" and config.router != "expert_choice":
            routing = _routing.apply_capacity(routing, config, num_sequences)

    max_kept = _max_kept(xt, config, num_sequences)
    phases = functools.partial(_routed_phases, config=config, max_kept=max_kept)
    y = by_target(phases, implementation, xt, routing, params["experts"])

    if config.shared_width:
        with jax.named_scope("shared_experts"):
            y = y + shared_mlp(params["shared"], xt, config)
    return y.reshape(shape), make_aux(routing, config, num_sequences)


_moe_apply_jit = jax.jit(_moe_apply, static_argnums=(2, 3))


def _routed_phases(xt, routing, experts, implementation, *, config, max_kept):
    """permute -> experts -> unpermute with one concrete implementation: `y [T, D]`."""
    if implementation == "reference":
        with jax.named_scope("experts"):
            return reference_experts(experts, xt, routing, config)
    if implementation == "blocked" and config.expert_precision != "fp8":  # fp8: unfused
        with jax.named_scope("permute"):
            layout = make_layout(routing, config.num_experts, 1, max_kept)
        with jax.named_scope("experts"):
            return fused_moe(xt, routing.weight, layout, experts, config)
    gmm, alignment = _gmm_for(implementation, config)
    with jax.named_scope("permute"):
        layout = make_layout(routing, config.num_experts, alignment, max_kept)
        rows = permute(xt, layout)
    with jax.named_scope("experts"):
        out = grouped_ffn(rows, layout.group_sizes, layout.group_of_row, experts, config, gmm)
    with jax.named_scope("unpermute"):
        return combine(out, routing.weight, layout)


def _max_kept(xt, config, num_sequences) -> int | None:
    """Static bound on kept assignments (smaller R for capacity mode and expert choice)."""
    if config.drop_policy == "capacity" or config.router == "expert_choice":
        s = xt.shape[0] // num_sequences
        cap = min(config.capacity(s), s) if config.router == "expert_choice" else config.capacity(s)
        return num_sequences * config.num_experts * cap
    return None


def empty_outputs(router_params: dict, x: jax.Array, config: MoEConfig) -> tuple[jax.Array, MoEAux]:
    """`(y, aux)` of an empty batch (`x [..., D]` with no tokens), the same for every
    implementation, sharded included: `y` zeros like `x`; per-token aux fields `[0, ...]`;
    counts, fractions and losses zero (not the NaN of a mean over no tokens)."""
    one = jnp.zeros((1, config.d_model), x.dtype)
    like = jax.eval_shape(lambda r: make_aux(_routing.route(r, one, config), config), router_params)
    aux = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
    per_token = ("router_logits", "topk_indices", "topk_weights", "dropped_mask")
    aux = dataclasses.replace(
        aux,
        **{
            f: jnp.zeros((0, *getattr(like, f).shape[1:]), getattr(like, f).dtype)
            for f in per_token
        },
    )
    return jnp.zeros(x.shape, x.dtype), aux


def make_aux(routing: Routing, config: MoEConfig, num_sequences: int = 1) -> MoEAux:
    """Routing statistics and auxiliary losses of one call (`num_sequences` sequence-major
    sequences for the sequence-wise balance loss)."""
    e = config.num_experts
    dropped = ~routing.kept
    if config.router == "expert_choice":
        dropped_fraction = jnp.mean(~routing.kept.any(-1))
        counts = _routing.expert_counts(routing.expert_index, e, routing.kept)
    else:
        dropped_fraction = jnp.mean(dropped)
        counts = _routing.expert_counts(routing.expert_index, e)
    return MoEAux(
        router_logits=routing.logits,
        topk_indices=routing.expert_index,
        topk_weights=routing.weight,
        dropped_mask=dropped if config.router != "expert_choice" else jnp.zeros_like(dropped),
        expert_counts=counts,
        kept_counts=_routing.expert_counts(routing.expert_index, e, routing.kept),
        dropped_fraction=dropped_fraction.astype(jnp.float32),
        load_balance_loss=_routing.load_balance_loss(routing, e),
        z_loss=_routing.z_loss(routing.logits),
        routed_fraction=_routing.expert_counts(routing.expert_index, e).astype(jnp.float32)
        / routing.expert_index.size,
        mean_probs=routing.probs.mean(0).astype(jnp.float32),
        sequence_balance_loss=_routing.sequence_balance_sum(routing, e, num_sequences)
        / num_sequences,
    )
