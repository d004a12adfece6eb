"""Router replay through the LM: `lm_forward(return_experts=True)` records every MoE layer's
experts; `replay_experts` takes them back (unscanned, scanned, batch split, on the 2x4 mesh),
and `train_step` takes them as a batch field."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moejax import parallel
from moejax.models import init_lm_params, lm_forward, presets
from moejax.training import init_train_state, make_train_step
from moejax.training import presets as train_presets

MODEL = presets.get("micro").replace(num_layers=3, moe_every=1)  # sigmoid router, shared expert
B, S = 8, 12
TOKENS = jax.random.randint(jax.random.key(5), (B, S + 1), 0, 256)


def _loss_and_grads(cfg, params, replay=None, **kw):
    def loss(p):
        logits, aux = lm_forward(
            p, TOKENS[:, :-1], cfg, implementation="ragged_dot", replay_experts=replay, **kw
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()
        return ce + 0.1 * aux.load_balance_loss.mean(), aux

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def _other(cfg, seed=9):
    keys = jax.random.split(jax.random.key(seed), cfg.num_moe_layers * B * S)
    perm = jax.vmap(lambda k: jax.random.permutation(k, cfg.moe.num_experts))(keys)
    return perm[:, : cfg.moe.top_k].reshape(cfg.num_moe_layers, B, S, -1).astype(jnp.int32)


@pytest.mark.parametrize(
    "kw",
    [{}, {"scan_layers": True}, pytest.param({"batch_split": 2}, marks=pytest.mark.slow)],
    ids=["plain", "scan", "split"],
)
def test_lm_replay_of_own_choice_is_bit_identical(kw):
    params = init_lm_params(MODEL, jax.random.key(0))
    logits, aux = lm_forward(
        params, TOKENS[:, :-1], MODEL, implementation="ragged_dot", return_experts=True, **kw
    )
    assert aux.expert_index.shape == (MODEL.num_moe_layers, B, S, MODEL.moe.top_k)
    (loss, aux0), grads = _loss_and_grads(MODEL, params, **kw)
    assert aux0.expert_index is None  # not asked, not returned
    (loss_r, _), grads_r = _loss_and_grads(MODEL, params, aux.expert_index, **kw)
    np.testing.assert_array_equal(loss_r, loss)
    if "batch_split" not in kw:
        jax.tree.map(np.testing.assert_array_equal, grads_r, grads)
    else:
        # Measured (jax 0.10.2, XLA:CPU): with two micro-batches side by side the loss and the
        # gradients of blocks 1 and 2 are bit-identical, block 0's and the embedding's differ
        # by at most 2e-9 (1-2 ulp): XLA compiles that block's backward differently when the
        # program has the replay input (the same math; not found which fusion differs).
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=4e-9), grads_r, grads
        )
        jax.tree.map(np.testing.assert_array_equal, grads_r["layers"][1:], grads["layers"][1:])
    # other choices: every layer, every token routes exactly those experts
    other = _other(MODEL)
    _, aux_o = lm_forward(
        params, TOKENS[:, :-1], MODEL, implementation="ragged_dot", replay_experts=other,
        return_experts=True, **kw,
    )  # fmt: skip
    np.testing.assert_array_equal(aux_o.expert_index, other)
    assert (np.asarray(aux.expert_index) != np.asarray(other)).any()


@pytest.mark.parametrize(
    "kinds",
    [("dense", "moe", "moe"), ("dense", "moe", "moe") * 2],
    ids=["dense_moe_moe", "2x_dense_moe_moe"],
)
def test_lm_replay_scanned_pattern(kinds):
    # Scanned runs of a per-layer pattern: [D, M, M] is layer 0 unscanned then [M] x 2;
    # twice it is one run of 2 units of [D, M, M] (two MoE layers per unit), so the
    # [Lm, ...] replays are sliced per run and regrouped per unit.
    from moejax.models._layer_runs import layer_runs

    cfg = presets.get("micro").replace(num_layers=len(kinds), mlp_layer_types=kinds)
    assert any(r.unit > 1 for r in layer_runs(cfg)) == (len(kinds) == 6)
    params = init_lm_params(cfg, jax.random.key(0))
    _, aux = lm_forward(
        params, TOKENS[:, :-1], cfg, implementation="ragged_dot", return_experts=True,
        scan_layers=True,
    )  # fmt: skip
    (loss, _), grads = _loss_and_grads(cfg, params, scan_layers=True)
    (loss_r, _), grads_r = _loss_and_grads(cfg, params, aux.expert_index, scan_layers=True)
    np.testing.assert_array_equal(loss_r, loss)
    jax.tree.map(np.testing.assert_array_equal, grads_r, grads)
    other = _other(cfg)
    _, aux_o = lm_forward(
        params, TOKENS[:, :-1], cfg, implementation="ragged_dot", replay_experts=other,
        return_experts=True, scan_layers=True,
    )  # fmt: skip
    np.testing.assert_array_equal(aux_o.expert_index, other)  # each layer its own row


@pytest.mark.slow  # compiles the sharded LM (~1 min of CPU)
def test_lm_replay_on_the_2x4_mesh_equals_one_device():
    params = init_lm_params(MODEL, jax.random.key(0))
    other = _other(MODEL)
    (loss, aux), grads = _loss_and_grads(MODEL, params, other)
    mesh = parallel.make_mesh((2, 4), ("data", "expert"))
    (loss_m, aux_m), grads_m = _loss_and_grads(MODEL, params, other, mesh=mesh)
    np.testing.assert_allclose(loss_m, loss, rtol=1e-5)
    np.testing.assert_array_equal(aux_m.expert_counts, aux.expert_counts)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), grads_m, grads)


def test_lm_replay_bad_shape_names_the_argument():
    params = init_lm_params(MODEL, jax.random.key(0))
    bad = jnp.zeros((MODEL.num_moe_layers - 1, B, S, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"replay_experts.shape=\(2, 8, 12, 2\): need \(3, 8"):
        lm_forward(params, TOKENS[:, :-1], MODEL, replay_experts=bad)


@pytest.mark.parametrize("microbatches", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_train_step_replays_the_batch_field(microbatches):
    train_cfg = train_presets.get("micro").replace(batch_size=B, microbatches=microbatches)
    state = init_train_state(MODEL, train_cfg)
    params0 = jax.tree.map(jnp.array, state.params)
    _, aux = lm_forward(params0, TOKENS[:, :-1], MODEL, return_experts=True)
    new, metrics = make_train_step(MODEL, train_cfg)(state, TOKENS)
    step = make_train_step(MODEL, train_cfg, replay_experts=True)
    state = init_train_state(MODEL, train_cfg)
    replay_batch = {"tokens": TOKENS, "replay_experts": aux.expert_index}
    new_r, metrics_r = step(state, replay_batch)
    np.testing.assert_array_equal(metrics_r.total_loss, metrics.total_loss)
    jax.tree.map(np.testing.assert_array_equal, new_r.params, new.params)
    # other experts: another loss, and the counts are the replayed ones
    state = init_train_state(MODEL, train_cfg)
    other = _other(MODEL)
    _, metrics_o = step(state, {"tokens": TOKENS, "replay_experts": other})
    want = jax.vmap(lambda i: jnp.bincount(i.ravel(), length=MODEL.moe.num_experts))(other)
    np.testing.assert_array_equal(metrics_o.expert_counts, want)
