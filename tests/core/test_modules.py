"""Functional == NNX == Linen: the same tree, the same outputs, aux and gradients for the same
parameters; the correction bias is outside what the optimizer trains in both module systems."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import moejax
import moejax.linen
from moejax import presets

SIZES = dict(d_model=16, d_ff=24, num_experts=8, block_size=8)
CONFIGS = {
    "deepseek_v3": presets.deepseek_v3(**SIZES, top_k=3, num_groups=4, topk_groups=2),
    "gpt_oss": presets.gpt_oss(**SIZES, top_k=2),
    "qwen2_moe": presets.qwen2_moe(**SIZES, top_k=2, shared_d_ff=8),
}
UNTRAINED = "score_correction_bias"


def _x():
    return jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 16)), jnp.float32)


def _assert_same_tree(a, b, exact_values=True):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    signature = lambda t: jax.tree.map(lambda v: (v.shape, v.dtype), t)  # noqa: E731
    assert signature(a) == signature(b)
    if exact_values:
        jax.tree.map(np.testing.assert_array_equal, a, b)


def _perturbed(tree):
    """Non-zero biases and correction bias, so that every leaf changes the result."""
    return jax.tree.map(lambda v: v + 0.1 * jnp.sin(jnp.arange(v.size)).reshape(v.shape), tree)


def _set_tree(layer, tree):
    for group, leaves in tree.items():
        for name, value in leaves.items():
            getattr(layer, group)[name][...] = value


def _split(tree):
    """(trained leaves, untrained leaves) of a functional tree."""

    def pick(keep):
        return {g: {n: v for n, v in ls.items() if keep(n)} for g, ls in tree.items()}

    return pick(lambda n: n != UNTRAINED), pick(lambda n: n == UNTRAINED)


def _merge(a, b):
    return {g: {**a.get(g, {}), **b.get(g, {})} for g in {**a, **b}}


def _loss(y, aux):
    w = jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)
    return jnp.sum(y * w) + 0.1 * aux.load_balance_loss + 0.01 * aux.z_loss


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_nnx_holds_the_functional_tree_for_the_same_key(name):
    cfg = CONFIGS[name]
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0))
    # The module initialises from the first key its `rngs.params()` stream draws.
    _assert_same_tree(layer.params_tree(), moejax.init_moe_params(cfg, nnx.Rngs(0).params()))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_linen_holds_the_functional_tree(name):
    cfg = CONFIGS[name]
    # (init runs one forward pass: the reference runs it fastest outside jit)
    variables = moejax.linen.MoE(cfg, implementation="reference").init(jax.random.key(0), _x())
    tree = moejax.linen.from_variables(variables)
    # Linen derives one key per group from its own rng stream: same tree, other values.
    _assert_same_tree(tree, moejax.init_moe_params(cfg, jax.random.key(0)), exact_values=False)
    _assert_same_tree(moejax.linen.from_variables(moejax.linen.to_variables(tree)), tree)
    assert (moejax.linen.CORRECTION_BIAS in variables) == cfg.score_correction_bias
    assert all(UNTRAINED not in leaves for leaves in variables["params"].values())


@pytest.mark.parametrize("name", ["deepseek_v3"])  # correction bias, groups, shared experts
def test_functional_nnx_linen_give_the_same_outputs_aux_and_grads(name):
    cfg = CONFIGS[name]
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(3), implementation="blocked")
    tree = _perturbed(layer.params_tree())
    _set_tree(layer, tree)
    linen_layer = moejax.linen.MoE(cfg, implementation="blocked")
    variables = moejax.linen.to_variables(tree)
    trained, untrained = _split(tree)
    x = _x()

    @jax.jit
    def functional(trained, x):
        def f(p):
            y, aux = moejax.moe_apply(_merge(p, untrained), x, cfg, implementation="blocked")
            return _loss(y, aux), (y, aux)

        return jax.grad(f, has_aux=True)(trained)

    @nnx.jit
    def with_nnx(layer, x):
        grads, out = nnx.grad(lambda m: (_loss(*m(x)), m(x)), has_aux=True)(layer)
        return nnx.to_pure_dict(grads), out

    @jax.jit
    def with_linen(variables, x):
        def f(p):
            y, aux = linen_layer.apply({**variables, "params": p}, x)
            return _loss(y, aux), (y, aux)

        return jax.grad(f, has_aux=True)(variables["params"])

    grads, (y, aux) = functional(trained, x)
    for other_grads, (y_other, aux_other) in (with_nnx(layer, x), with_linen(variables, x)):
        np.testing.assert_array_equal(y_other, y)
        _assert_same_tree(aux_other, aux)
        _assert_same_tree(other_grads, grads)


def test_optimizers_leave_the_correction_bias_alone():
    """AdamW with weight decay would pull a trained bias toward zero: neither module lets it."""
    cfg = CONFIGS["deepseek_v3"]
    x = _x()
    tx = optax.adamw(1e-2, weight_decay=0.5)

    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0))
    _set_tree(layer, _perturbed(layer.params_tree()))
    before = layer.params_tree()
    opt = nnx.Optimizer(layer, tx, wrt=nnx.Param)

    @nnx.jit
    def step(layer, opt, x):
        opt.update(layer, nnx.grad(lambda m: _loss(*m(x)))(layer))

    step(layer, opt, x)
    after = layer.params_tree()
    assert not np.array_equal(after["router"]["kernel"], before["router"]["kernel"])
    np.testing.assert_array_equal(after["router"][UNTRAINED], before["router"][UNTRAINED])
    assert isinstance(layer.router[UNTRAINED], moejax.nnx.CorrectionBias)

    # Linen: the optimizer sees only the "params" collection.
    linen_layer = moejax.linen.MoE(cfg)
    variables = moejax.linen.to_variables(before)
    params = variables["params"]
    grads = jax.jit(jax.grad(lambda p: _loss(*linen_layer.apply({**variables, "params": p}, x))))(
        params
    )
    updates, _ = tx.update(grads, tx.init(params), params)
    new = moejax.linen.from_variables({**variables, "params": optax.apply_updates(params, updates)})
    assert not np.array_equal(new["router"]["kernel"], before["router"]["kernel"])
    np.testing.assert_array_equal(new["router"][UNTRAINED], before["router"][UNTRAINED])


def test_correction_bias_is_updated_outside_the_optimizer():
    cfg = CONFIGS["deepseek_v3"]
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0))
    _, aux = layer(_x())
    bias = layer.router[UNTRAINED]
    bias[...] = moejax.update_correction_bias(bias[...], aux.expert_counts, rate=0.1)
    counts = np.asarray(aux.expert_counts, np.float64)
    np.testing.assert_allclose(bias[...], 0.1 * np.sign(counts.mean() - counts))
    # The new bias changes the next routing: choice follows the bias, weights do not include it.
    _, aux_next = layer(_x())
    assert not np.array_equal(aux_next.topk_indices, aux.topk_indices)


def test_nnx_layer_on_a_mesh_is_the_sharded_layer_with_the_same_parameters():
    # `moejax.MoE(..., mesh=)`: parameters stored in the mesh's layout, calls run
    # `moe_apply_sharded` (whose outputs and gradients equal the single-device layer's:
    # tests/parallel/test_equivalence.py); an optimizer step and the correction-bias update
    # run under nnx.jit on the mesh and keep the layout.
    from moejax import parallel

    cfg = CONFIGS["deepseek_v3"]
    mesh = parallel.make_mesh((2, 4), ("data", "expert"))
    x = parallel.shard_activations(_x().reshape(8, 2, 16), mesh)
    strategy = parallel.Strategy(mode="expert", dispatcher="allgather")  # the quickest compile
    placed = moejax.MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh, strategy=strategy)
    single = moejax.MoE(cfg, rngs=nnx.Rngs(0))
    _assert_same_tree(jax.device_get(placed.params_tree()), single.params_tree())
    w_up = placed.experts["w_up"][...]
    assert w_up.sharding.spec == parallel.param_partition_specs(cfg, mesh)["experts"]["w_up"]
    assert w_up.addressable_shards[0].data.shape[0] == cfg.num_experts // 4
    (y, aux), (y1, aux1) = placed(x), single(jax.device_get(x))
    np.testing.assert_allclose(y, y1, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(aux.expert_counts, aux1.expert_counts)
    opt = nnx.Optimizer(placed, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(layer, opt, x):
        def loss(m):
            y, aux = m(x)
            return _loss(y, aux), aux

        (_, aux), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
        opt.update(layer, grads)
        bias = layer.router[UNTRAINED]
        bias[...] = moejax.update_correction_bias(bias[...], aux.expert_counts, rate=0.1)

    before = jax.device_get(placed.params_tree())
    step(placed, opt, x)
    counts = np.asarray(aux.expert_counts, np.float64)
    want = before["router"][UNTRAINED] + 0.1 * np.sign(counts.mean() - counts)
    np.testing.assert_allclose(placed.router[UNTRAINED][...], want, rtol=1e-6)
    assert not np.array_equal(placed.experts["w_up"][...], before["experts"]["w_up"])
    assert placed.experts["w_up"][...].sharding.spec == w_up.sharding.spec
