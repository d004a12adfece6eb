"""Router replay at the layer: recorded experts replace the router's top-k, the current router
weighs them (and learns through the weights); one device, the 2x4 mesh and a placement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax import parallel
from moejax._experts import reference_experts
from moejax._types import Routing
from moejax.parallel import slots
from moejax.placement import Placement

BASE = dict(d_model=16, d_ff=8, num_experts=8, top_k=2, block_size=8)
CONFIGS = {
    "softmax": moejax.MoEConfig(**BASE),
    "softmax_unnormalised": moejax.MoEConfig(**BASE, norm_topk_prob=False),
    "sigmoid_groups": moejax.MoEConfig(
        **BASE,
        router="sigmoid",
        score_correction_bias=True,
        num_groups=4,
        topk_groups=2,
        routed_scaling_factor=2.5,
    ),  # fmt: skip
    "topk_softmax": moejax.MoEConfig(**BASE, router="topk_softmax", router_bias=True),
    "capacity": moejax.MoEConfig(**BASE, drop_policy="capacity", capacity_factor=0.75),
}
B, S = 8, 4


def _inputs(cfg, seed=0):
    params = moejax.init_moe_params(cfg, jax.random.key(seed))
    if cfg.score_correction_bias:
        params["router"]["score_correction_bias"] = jnp.linspace(-0.3, 0.3, cfg.num_experts)
    if cfg.router_bias:
        params["router"]["bias"] = jnp.linspace(-0.2, 0.2, cfg.num_experts)
    x = jax.random.normal(jax.random.key(seed + 1), (B, S, cfg.d_model))
    return params, x


def _other_choices(cfg, seed=3):
    """Distinct random experts per token, unlike what the router picks."""
    keys = jax.random.split(jax.random.key(seed), B * S)
    perms = jax.vmap(lambda k: jax.random.permutation(k, cfg.num_experts))(keys)
    return perms[:, : cfg.top_k].reshape(B, S, cfg.top_k).astype(jnp.int32)


def _loss_fn(cfg, implementation="ragged_dot", replay=None):
    def loss(params, x):
        y, aux = moejax.moe_apply(
            params, x, cfg, implementation=implementation, replay_experts=replay
        )
        w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
        return jnp.sum(y * w) + 0.1 * aux.load_balance_loss + 0.1 * aux.z_loss, aux

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("name", CONFIGS)
def test_replaying_own_choice_is_bit_identical(name):
    cfg = CONFIGS[name]
    params, x = _inputs(cfg)
    (loss, aux), grads = _loss_fn(cfg)(params, x)
    own = aux.topk_indices.reshape(B, S, cfg.top_k)
    (loss_r, aux_r), grads_r = _loss_fn(cfg, replay=own)(params, x)
    np.testing.assert_array_equal(loss_r, loss)
    _equal(grads_r, grads)
    _equal(aux_r, aux)


def _expected_weights(cfg, params, x, index):
    """The router's weights over given experts, written out from MoEConfig's description."""
    logits = x.reshape(-1, cfg.d_model) @ params["router"]["kernel"]
    if cfg.router_bias:
        logits = logits + params["router"]["bias"]
    if cfg.router == "topk_softmax":
        return jax.nn.softmax(jnp.take_along_axis(logits, index, -1), -1)
    scores = jax.nn.sigmoid(logits) if cfg.router == "sigmoid" else jax.nn.softmax(logits, -1)
    w = jnp.take_along_axis(scores, index, -1)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    return w * cfg.routed_scaling_factor


@pytest.mark.parametrize("name", ["softmax", "sigmoid_groups", "topk_softmax"])
def test_replaying_other_choices_routes_exactly_those_experts(name):
    cfg = CONFIGS[name]
    params, x = _inputs(cfg)
    other = _other_choices(cfg)
    _, own = moejax.moe_apply(params, x, cfg, implementation="ragged_dot")
    assert (np.asarray(own.topk_indices).reshape(other.shape) != np.asarray(other)).any()
    y, aux = moejax.moe_apply(params, x, cfg, implementation="ragged_dot", replay_experts=other)
    index = other.reshape(-1, cfg.top_k)
    np.testing.assert_array_equal(aux.topk_indices, index)  # per token
    counts = np.bincount(np.asarray(index).ravel(), minlength=cfg.num_experts)
    np.testing.assert_array_equal(aux.expert_counts, counts)

    # y per token from the per-expert loop over exactly those experts and their weights
    def reference(params, x):
        w = _expected_weights(cfg, params, x, index)
        kept = jnp.ones(index.shape, bool)
        r = Routing(logits=None, probs=None, expert_index=index, weight=w, kept=kept)
        return reference_experts(params["experts"], x.reshape(-1, cfg.d_model), r, cfg)

    np.testing.assert_allclose(y.reshape(-1, cfg.d_model), reference(params, x), atol=2e-6)

    # the router learns through the weights: its gradient is the reference's, and not zero
    def loss(fn):
        return lambda p: jnp.sum(jnp.sin(fn(p).reshape(-1)))

    layer = lambda p: moejax.moe_apply(  # noqa: E731
        p, x, cfg, implementation="ragged_dot", replay_experts=other
    )[0]
    g = jax.grad(loss(layer))(params)["router"]["kernel"]
    g_ref = jax.grad(loss(lambda p: reference(p, x)))(params)["router"]["kernel"]
    assert float(jnp.abs(g).max()) > 1e-3
    np.testing.assert_allclose(g, g_ref, atol=2e-6)


def test_capacity_drops_follow_the_replayed_choice():
    cfg = CONFIGS["capacity"]
    params, x = _inputs(cfg)
    other = jnp.broadcast_to(jnp.array([0, 1], jnp.int32), (B, S, 2))  # all on experts 0, 1
    _, aux = moejax.moe_apply(params, x, cfg, implementation="ragged_dot", replay_experts=other)
    cap = cfg.capacity(S)
    np.testing.assert_array_equal(aux.kept_counts[:2], [B * cap, B * cap])
    assert int(aux.kept_counts[2:].sum()) == 0


def test_sharded_and_placed_replay_equal_one_device():
    cfg = CONFIGS["softmax"]
    params, x = _inputs(cfg)
    other = _other_choices(cfg)
    (loss, aux), grads = _loss_fn(cfg, replay=other)(params, x)
    mesh = parallel.make_mesh((2, 4), ("data", "expert"))
    layout = Placement(np.array([0, 5, 0, 1, 2, 5, 3, 4, 5, 6, 7, 1]), 8, 4, 3)
    table = slots.slot_table(layout)
    physical = {**params, "experts": slots.to_physical(params["experts"], table)}
    for p, placement in ((params, None), (physical, table)):

        def f(p, x, placement=placement):
            y, a = parallel.moe_apply_sharded(
                p, x, cfg, mesh, implementation="ragged_dot", slot_table=placement,
                replay_experts=other,
            )  # fmt: skip
            w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
            return jnp.sum(y * w) + 0.1 * a.load_balance_loss + 0.1 * a.z_loss, a

        (loss_s, aux_s), (g, gx) = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(p, x)
        np.testing.assert_allclose(loss_s, loss, rtol=1e-5)
        np.testing.assert_array_equal(aux_s.topk_indices, aux.topk_indices)
        np.testing.assert_allclose(gx, grads[1], atol=1e-5)
        np.testing.assert_allclose(g["router"]["kernel"], grads[0]["router"]["kernel"], atol=1e-5)


@pytest.mark.parametrize(
    "replay, match",
    [
        (np.full((B, S, 2), 8), r"expert id 8 out of range \[0, 8\)"),
        (np.full((B, S, 2), -1), r"expert id -1 out of range"),
        (np.zeros((B, S, 3), np.int32), r"replay_experts.shape=\(8, 4, 3\): need \(8, 4, 2\)"),
        (np.zeros((B * S, 2), np.int32), r"replay_experts.shape=\(32, 2\): need \(8, 4, 2\)"),
        (np.zeros((B, S, 2), np.float32), r"replay_experts.dtype=float32: need integer"),
        (np.tile(np.array([3, 3]), (B, S, 1)), r"token 0 repeats an expert \(\[3, 3\]\)"),
    ],
)
def test_bad_replay_raises_a_clear_error(replay, match):
    cfg = CONFIGS["softmax"]
    params, x = _inputs(cfg)
    with pytest.raises(ValueError, match=match):
        moejax.moe_apply(params, x, cfg, replay_experts=replay)


def test_bad_replay_under_jit_gives_nan_weights_not_another_expert():
    cfg = CONFIGS["softmax"]
    params, x = _inputs(cfg)
    bad = _other_choices(cfg).at[0, 0, 0].set(99)
    y, aux = jax.jit(
        lambda r: moejax.moe_apply(params, x, cfg, implementation="ragged_dot", replay_experts=r)
    )(bad)
    assert np.isnan(np.asarray(y)[0, 0]).all() and np.isfinite(np.asarray(y)[1:]).all()


def test_expert_choice_cannot_replay():
    cfg = moejax.MoEConfig(**{**BASE, "router": "expert_choice"})
    params, x = _inputs(cfg)
    with pytest.raises(ValueError, match="expert_choice"):
        moejax.moe_apply(params, x, cfg, replay_experts=np.zeros((B, S, 2), np.int32))


@pytest.mark.parametrize("router", ["softmax", "sigmoid", "topk_softmax"])
def test_routed_scaling_factor_scales_every_token_choice_router(router):
    """The same experts, weights times the factor (DeepSeek-V2-Lite scales softmax weights)."""
    cfg = moejax.MoEConfig(**BASE, router=router, router_bias=router == "topk_softmax")
    params, x = _inputs(cfg)
    x = x.reshape(-1, cfg.d_model)
    plain = moejax.route(params["router"], x, cfg)
    scaled = moejax.route(params["router"], x, cfg.replace(routed_scaling_factor=2.0))
    np.testing.assert_array_equal(scaled.expert_index, plain.expert_index)
    np.testing.assert_array_equal(scaled.weight, 2.0 * plain.weight)
    # replaying the router's own choice weighs it the same, scaled
    again = moejax.route(
        params["router"], x, cfg.replace(routed_scaling_factor=2.0), replay=scaled.expert_index
    )
    np.testing.assert_array_equal(again.weight, scaled.weight)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        moejax.MoEConfig(**BASE, router="expert_choice", routed_scaling_factor=2.0)
