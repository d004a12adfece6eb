"""The XLA:CPU expert paths against plain-jnp references, forward and VJP, on adversarial routing:
the fused chunk loop (`moejax._fused`, what `implementation="blocked"` runs) and the block-loop
grouped matmul (`moejax._gmm.blocked_gmm`, which each device of `moejax.parallel` also runs)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax import _fused, _gmm
from moejax._experts import activate
from moejax._permute import make_layout
from moejax._types import Routing
from moejax.testing import assert_close

T, K, D, F, E = 40, 2, 8, 12, 4
_FLAT = np.arange(T * K).reshape(T, K)
# Expert of each (token, slot); every pattern sends the 80 assignments somewhere else.
ROUTINGS = {
    "random": lambda rng: rng.integers(0, E, (T, K)),
    "all_in_one": lambda rng: np.stack([np.full(T, 2), np.full(T, 2)], 1),
    "empty_experts": lambda rng: rng.choice([0, 3], (T, K)),  # experts 1 and 2 get nothing
    "last_only": lambda rng: np.full((T, K), E - 1),
    # Experts 1..E-1 get one row each, expert 0 all the others.
    "one_row_experts": lambda rng: np.where(_FLAT < E - 1, _FLAT + 1, 0),
}


def _routing(name, seed=0, drop=False):
    rng = np.random.default_rng(seed)
    index = jnp.asarray(ROUTINGS[name](rng), jnp.int32)
    weight = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)), jnp.float32)
    kept = jnp.asarray(rng.uniform(size=(T, K)) > 0.3 if drop else np.ones((T, K), bool))
    return Routing(logits=None, probs=None, expert_index=index, weight=weight, kept=kept)


def _experts(config, key=0):
    params = moejax.init_moe_params(config, jax.random.key(key))["experts"]
    keys = jax.random.split(jax.random.key(key + 1), len(params))
    # Non-zero biases, so every bias path is exercised.
    return {
        n: (0.3 * jax.random.normal(k, v.shape) if n.startswith("b_") else v)
        for (n, v), k in zip(sorted(params.items()), keys, strict=True)
    }


def _reference_moe(x, weight, index, experts, config):
    """`y[t] = sum_k weight[t, k] * ffn_{index[t, k]}(x[t])`, expert weights gathered per token."""
    y = jnp.zeros_like(x)
    for k in range(index.shape[1]):
        e = index[:, k]

        def proj(h, name, e=e):
            out = jnp.einsum("ti,tio->to", h, experts[f"w_{name}"][e])
            return out + experts[f"b_{name}"][e] if config.expert_bias else out

        gate = proj(x, "gate") if config.gated else None
        y = y + weight[:, k, None] * proj(activate(gate, proj(x, "up"), config), "down")
    return y


CONFIGS = {
    "swiglu": moejax.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, block_size=2),
    "gelu_bias": moejax.MoEConfig(
        d_model=D,
        d_ff=F,
        num_experts=E,
        top_k=K,
        block_size=4,
        activation="gelu",
        expert_bias=True,
    ),
}


@functools.cache
def _fused_vjp(config_name):
    config = CONFIGS[config_name]

    def f(x, weight, experts, index, kept):
        routing = Routing(logits=None, probs=None, expert_index=index, weight=weight, kept=kept)
        layout = make_layout(routing, E, 1)
        return _fused.fused_moe(x, jnp.where(kept, weight, 0), layout, experts, config)

    return jax.jit(lambda dy, *a: jax.vjp(lambda *d: f(*d, *a[3:]), *a[:3])[1](dy))


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("routing_name", sorted(ROUTINGS))
def test_fused_moe_matches_reference(config_name, routing_name):
    config = CONFIGS[config_name]
    routing = _routing(routing_name, drop=routing_name == "random")
    experts = _experts(config)
    x = jax.random.normal(jax.random.key(3), (T, D))
    dy = jax.random.normal(jax.random.key(4), (T, D))
    kept_weight = jnp.where(routing.kept, routing.weight, 0)

    def ref(x, weight, experts):
        return _reference_moe(
            x, jnp.where(routing.kept, weight, 0), routing.expert_index, experts, config
        )

    y_ref, ref_vjp = jax.vjp(ref, x, routing.weight, experts)
    layout = make_layout(routing, E, 1)
    y = _fused.fused_moe(x, kept_weight, layout, experts, config)
    assert_close(y, y_ref)
    grads = _fused_vjp(config_name)(
        dy, x, routing.weight, experts, routing.expert_index, routing.kept
    )
    assert_close(grads, ref_vjp(dy))
    # Empty experts get exactly zero weight gradient; dropped assignments zero weight gradient.
    counts = np.bincount(np.asarray(routing.expert_index)[np.asarray(routing.kept)], minlength=E)
    for leaf in jax.tree.leaves(grads[2]):
        assert np.all(np.asarray(leaf)[counts == 0] == 0)
    assert np.all(np.asarray(grads[1])[~np.asarray(routing.kept)] == 0)


def test_fused_moe_keeps_non_finite_values_inside_their_expert():
    # Expert 3 computes NaN. Expert 2's last chunk runs past its rows into expert 3's (masked):
    # nothing may leak into expert 2's gradients or into tokens that expert 3 never saw.
    config = CONFIGS["gelu_bias"]  # chunks of 16 and 4 rows
    routing = _routing("random")
    index = np.asarray(routing.expert_index)
    assert np.sum(index == 2) % 4 != 0 and np.sum(index == 3) > 0
    experts = _experts(config)
    experts["w_up"] = experts["w_up"].at[3].set(jnp.nan)
    x = jax.random.normal(jax.random.key(3), (T, D))
    dy = jax.random.normal(jax.random.key(4), (T, D))
    grads = _fused_vjp("gelu_bias")(
        dy, x, routing.weight, experts, routing.expert_index, routing.kept
    )
    want = jax.vjp(
        lambda x, w, p: _reference_moe(x, w, routing.expert_index, p, config),
        x,
        routing.weight,
        experts,
    )[1](dy)
    clean = ~np.any(index == 3, axis=1)  # tokens that expert 3 never saw
    assert_close(grads[0][clean], want[0][clean])
    assert_close(grads[1][clean], want[1][clean])
    for name in experts:
        assert_close(grads[2][name][:3], want[2][name][:3], err_msg=name)


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 31, 32, 33, 100])
def test_chunk_ladder_covers_each_row_once_with_bounded_waste(count):
    sizes = (32, 8)
    trips = _fused._ladder(count, sizes)
    covered = sum(n * s for n, s in zip(trips, sizes, strict=True))
    assert count <= covered < count + sizes[-1]
    assert trips[0] == count // 32  # the big chunks take all they can


def test_chunk_sizes_fit_the_layout():
    assert _fused.chunk_sizes(128, 10_000) == (512, 128)
    assert _fused.chunk_sizes(128, 300) == (128,)
    assert _fused.chunk_sizes(128, 50) == (50,)


def _gmm_case(sizes, block=4, n=6, k=5, seed=0):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int32) * block
    r = int(sizes.sum()) + 2 * block  # unused rows at the end
    lhs = jnp.asarray(rng.normal(size=(r, k)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)), jnp.float32)
    return lhs, rhs, jnp.asarray(sizes)


def _reference_gmm(lhs, rhs, sizes):
    group = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
    used = len(group)
    out = jnp.einsum("rk,rkn->rn", lhs[:used], rhs[group])
    return jnp.concatenate([out, jnp.zeros((lhs.shape[0] - used, rhs.shape[2]))])


@pytest.mark.parametrize("groups", [[2, 1, 3], [0, 4, 0], [0, 0, 5], [1, 0, 0, 2], [0, 0, 0]])
def test_blocked_gmm_matches_reference_forward_and_vjp(groups):
    lhs, rhs, sizes = _gmm_case(groups)
    dout = jax.random.normal(jax.random.key(0), (lhs.shape[0], rhs.shape[2]))
    out, vjp = jax.vjp(lambda a, b: _gmm.blocked_gmm(a, b, sizes, 4), lhs, rhs)
    want, want_vjp = jax.vjp(lambda a, b: _reference_gmm(a, b, sizes), lhs, rhs)
    assert_close(out, want)
    assert_close(vjp(dout), want_vjp(dout))
