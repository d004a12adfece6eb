"""Balance losses of the layer: the sequence-wise form (DeepSeek-V3) against hand-computed
values and a per-sequence loop, on one device and on the 2x4 mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax import _routing, parallel
from moejax._types import Routing


def _routing_of(index, probs):
    index = jnp.asarray(index, jnp.int32)
    probs = jnp.asarray(probs, jnp.float32)
    return Routing(
        logits=jnp.log(probs),
        probs=probs,
        expert_index=index,
        weight=jnp.ones(index.shape, jnp.float32),
        kept=jnp.ones(index.shape, bool),
    )


def test_sequence_balance_loss_by_hand():
    """E=4, K=2, two sequences of 3 tokens; sequence 0 has uniform probabilities, sequence 1
    (.7, .1, .1, .1).
    All tokens on experts 0, 1: (4 / (2 * 3)) * (3 * .25 + 3 * .25) = 1.0 and
    (4 / 6) * (3 * .7 + 3 * .1) = 1.6, mean 1.3.
    Sequence 1 on experts 2, 3 instead: its loss is (4 / 6) * (3 * .1 + 3 * .1) = 0.4, mean 0.7;
    the Switch form over the whole batch sees every expert with f = .25: 4 * .25 * sum(P) = 1.0.
    """
    uniform, skewed = [0.25] * 4, [0.7, 0.1, 0.1, 0.1]
    probs = [uniform] * 3 + [skewed] * 3
    r = _routing_of([[0, 1]] * 6, probs)
    assert float(_routing.sequence_balance_sum(r, 4, 2)) / 2 == pytest.approx(1.3, rel=1e-6)
    r = _routing_of([[0, 1]] * 3 + [[2, 3]] * 3, probs)
    assert float(_routing.sequence_balance_sum(r, 4, 2)) / 2 == pytest.approx(0.7, rel=1e-6)
    assert float(_routing.load_balance_loss(r, 4)) == pytest.approx(1.0, rel=1e-6)


def _loop_reference(aux, probs_fn, b, s, e, k):
    """Per-sequence loop: mean_b (E / (K S)) sum_e count_be * P_be."""
    idx = np.asarray(aux.topk_indices).reshape(b, s, k)
    probs = np.asarray(probs_fn(np.asarray(aux.router_logits, np.float64))).reshape(b, s, e)
    losses = []
    for i in range(b):
        counts = np.bincount(idx[i].ravel(), minlength=e)
        losses.append(e / (k * s) * np.sum(counts * probs[i].mean(0)))
    return np.mean(losses)


def _softmax(z):
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _sigmoid_normalised(z):
    s = 1 / (1 + np.exp(-z))
    return s / s.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    "router, probs_fn, extra",
    [
        ("softmax", _softmax, {}),
        ("sigmoid", _sigmoid_normalised, {"score_correction_bias": True}),
    ],
)
def test_sequence_balance_loss_matches_a_loop_one_device_and_mesh(router, probs_fn, extra):
    b, s, e, k = 8, 6, 8, 2
    cfg = moejax.MoEConfig(d_model=16, d_ff=8, num_experts=e, top_k=k, router=router, **extra)
    params = moejax.init_moe_params(cfg, jax.random.key(1))
    if extra:  # a non-zero bias changes the choice, not P (DeepSeek-V3's s' is unbiased)
        bias = jnp.linspace(-0.5, 0.5, e)
        params["router"]["score_correction_bias"] = bias
    x = jax.random.normal(jax.random.key(2), (b, s, 16))
    _, aux = moejax.moe_apply(params, x, cfg, implementation="ragged_dot")
    want = _loop_reference(aux, probs_fn, b, s, e, k)
    np.testing.assert_allclose(float(aux.sequence_balance_loss), want, rtol=1e-5)
    assert abs(float(aux.sequence_balance_loss) - float(aux.load_balance_loss)) > 1e-3
    mesh = parallel.make_mesh((2, 4), ("data", "expert"))
    _, sharded = parallel.moe_apply_sharded(params, x, cfg, mesh, implementation="ragged_dot")
    np.testing.assert_allclose(float(sharded.sequence_balance_loss), want, rtol=1e-5)
