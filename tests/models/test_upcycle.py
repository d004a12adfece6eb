"""`moejax.models.upcycle`: an MoE LM from a dense one. With identical experts (whole or in
granular shards) and softmax routing over normalised top-k its logits are the dense model's; it
trains; bad arguments name themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax.models import dense_lm_config, init_lm_params, lm_forward, presets, upcycle

BASE = presets.get("micro").replace(num_layers=2)
DENSE = dense_lm_config(BASE, d_ff=64)
TOKENS = jax.random.randint(jax.random.key(3), (4, 16), 0, 256)


def _moe(**kw):
    base = dict(d_model=32, d_ff=64, num_experts=4, top_k=2, block_size=8)
    return moejax.MoEConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def dense():
    params = init_lm_params(DENSE, jax.random.key(0))
    logits, _ = lm_forward(params, TOKENS, DENSE, implementation="ragged_dot")
    return params, logits


@pytest.mark.parametrize(
    "moe_kw, g",
    [
        ({}, 1),
        ({"d_ff": 32, "num_experts": 8, "top_k": 2}, 2),
        ({"d_ff": 16, "num_experts": 8, "top_k": 4}, 4),
    ],
    ids=["copies", "granular2", "granular4"],
)
def test_upcycled_logits_equal_the_dense_models(dense, moe_kw, g):
    params, want = dense
    moe_params, cfg = upcycle(params, DENSE, _moe(**moe_kw), granularity=g, seed=1)
    assert cfg.moe.num_experts == moe_kw.get("num_experts", 4)
    logits, aux = lm_forward(moe_params, TOKENS, cfg, implementation="ragged_dot")
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    # the tokens are spread over several copies: not one expert doing all the work
    assert int((np.asarray(aux.expert_counts) > 0).sum(-1).min()) >= 2 * g


def test_noise_or_partial_copies_break_the_equality(dense):
    params, want = dense
    noisy, cfg = upcycle(params, DENSE, _moe(), noise=0.05, seed=1)
    logits, _ = lm_forward(noisy, TOKENS, cfg, implementation="ragged_dot")
    assert float(jnp.abs(logits - want).max()) > 1e-3
    # g = 2 with top_k = 1: a token takes half a copy, scaled by 2: not the dense MLP
    part, cfg = upcycle(params, DENSE, _moe(d_ff=32, num_experts=8, top_k=1), granularity=2)
    logits, _ = lm_forward(part, TOKENS, cfg, implementation="ragged_dot")
    assert float(jnp.abs(logits - want).max()) > 1e-3


def test_upcycled_tiny_model_trains(dense):
    from moejax.training import TrainConfig, init_train_state, make_train_step

    params, _ = dense
    moe_params, cfg = upcycle(params, DENSE, _moe(num_experts=4, top_k=2), noise=0.01)
    train_cfg = TrainConfig(steps=12, batch_size=4, warmup_steps=2, learning_rate=3e-3)
    state = init_train_state(cfg, train_cfg)
    # copies: the step donates the state, and moe_params shares arrays with the `dense` fixture
    state = state.__class__(**{**vars(state), "params": jax.tree.map(jnp.copy, moe_params)})
    step = make_train_step(cfg, train_cfg, implementation="ragged_dot")
    batch = jnp.concatenate([TOKENS, TOKENS[:, :1]], axis=1)  # [B, S + 1]: memorise 4 rows
    losses = []
    for _ in range(12):
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(moe=_moe(d_ff=48)), r"moe_cfg.d_ff=48: times granularity=1 must equal .* 64"),
        (dict(moe=_moe(num_experts=5, d_ff=32), g=2), r"moe_cfg.num_experts=5: not a multiple"),
        (dict(moe=_moe(activation="gelu")), r"moe_cfg.activation='gelu'"),
        (dict(moe=_moe(num_shared_experts=1)), r"moe_cfg.num_shared_experts=1"),
        (dict(g=0), r"granularity=0: must be a positive int"),
        (dict(noise=-1.0), r"noise=-1.0"),
        (dict(source=BASE), r"dense_params\['layers'\]\[0\]: not a dense layer"),
    ],
)
def test_bad_arguments_name_themselves(dense, change, match):
    params, _ = dense
    if "source" in change:
        params = init_lm_params(change["source"], jax.random.key(0))
    with pytest.raises(ValueError, match=match):
        upcycle(
            params, DENSE, change.get("moe", _moe()), granularity=change.get("g", 1),
            noise=change.get("noise", 0.0),
        )  # fmt: skip


def test_an_all_dense_model_becomes_moe_where_the_pattern_says(dense):
    """A model whose `mlp_layer_types` are all dense (a Hugging Face Llama/Qwen as loaded): every
    layer MoE by default, or the layers `mlp_layer_types` names; the logits stay the dense ones."""
    params, want = dense
    all_dense = BASE.replace(mlp_layer_types=("dense", "dense"), dense_d_ff=64)
    mlp_params = {**params, "layers": [dict(layer) for layer in params["layers"]]}
    for layer in mlp_params["layers"]:  # the same MLPs, stored as dense `mlp` layers
        layer["mlp"] = {k: w[0] for k, w in layer.pop("moe")["experts"].items()}
    _, cfg = upcycle(mlp_params, all_dense, _moe())
    assert cfg.mlp_kinds == ("moe", "moe")
    moe_params, cfg = upcycle(mlp_params, all_dense, _moe(), mlp_layer_types=("dense", "moe"))
    assert cfg.mlp_kinds == ("dense", "moe") and cfg.mlp_d_ff == 64
    assert set(moe_params["layers"][0]) >= {"mlp"} and "moe" in moe_params["layers"][1]
    logits, _ = lm_forward(moe_params, TOKENS, cfg, implementation="ragged_dot")
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"mlp_layer_types=.*has 1 entries"):
        upcycle(mlp_params, all_dense, _moe(), mlp_layer_types=("moe",))
