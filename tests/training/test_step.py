"""The train step: non-finite guard, correction-bias update outside the optimizer, optimizer
masks, configs."""

import numpy as np
import pytest
from _helpers import MODEL, TRAIN, assert_trees_equal, corpus, host_tree, mesh

import moejax
from moejax.data import BatchIterator
from moejax.testing import assert_close, kernels_run
from moejax.training import (
    TrainConfig,
    global_batch,
    init_train_state,
    learning_rate_schedule,
    make_train_step,
)
from moejax.training.optimizer import decay_mask, param_labels


def _batches(n):
    it = BatchIterator(corpus().tokens, TRAIN.batch_size, MODEL.max_seq_len, seed=0)
    return [it.next() for _ in range(n)]


def test_non_finite_step_is_skipped_bit_for_bit_and_training_goes_on():
    m = mesh()
    step = make_train_step(MODEL, TRAIN, m)
    g1, g2 = _batches(2)
    bad = g1.copy()
    bad[:, 0] = MODEL.vocab_size  # out-of-vocabulary id: the embedding lookup gives NaN

    state, m1 = step(init_train_state(MODEL, TRAIN, m), global_batch(g1, m))
    before = host_tree(state)
    state, mb = step(state, global_batch(bad, m))
    assert not bool(mb.finite) and not np.isfinite(float(mb.loss))
    after_bad = host_tree(state)
    assert_trees_equal(after_bad.params, before.params)
    assert_trees_equal(after_bad.opt_state, before.opt_state)
    assert (int(after_bad.step), int(after_bad.updates), int(after_bad.skipped)) == (2, 1, 1)
    state, m2 = step(state, global_batch(g2, m))

    clean, _ = step(init_train_state(MODEL, TRAIN, m), global_batch(g1, m))
    clean, n2 = step(clean, global_batch(g2, m))
    # The skipped step changed nothing the math depends on: the next update is the same.
    assert_trees_equal(state.params, clean.params)
    assert_trees_equal(state.opt_state, clean.opt_state)
    assert float(m2.loss) == float(n2.loss) and bool(m2.finite)
    assert float(m2.learning_rate) == float(learning_rate_schedule(TRAIN)(1))


def test_correction_bias_moves_against_the_load_outside_the_optimizer():
    m = mesh()
    state = init_train_state(MODEL, TRAIN, m)
    state, metrics = make_train_step(MODEL, TRAIN, m)(state, global_batch(_batches(1)[0], m))
    counts = np.asarray(metrics.expert_counts)  # [Lm, E]
    assert counts.sum(1).tolist() == [TRAIN.batch_size * MODEL.max_seq_len * 2] * 2
    for j, i in enumerate(MODEL.moe_layers):
        bias = state.params["layers"][i]["moe"]["router"]["score_correction_bias"]
        want = moejax.update_correction_bias(
            np.zeros(8, np.float32), counts[j], TRAIN.bias_update_rate
        )
        np.testing.assert_array_equal(np.asarray(bias), np.asarray(want))


def test_optimizer_masks():
    params = {
        "layers": [
            {"moe": {"router": {"kernel": np.zeros((4, 2)), "score_correction_bias": np.zeros(2)}}}
        ],
        "final_norm": {"scale": np.zeros(4)},
    }
    labels = param_labels(params)
    assert labels["layers"][0]["moe"]["router"] == {
        "kernel": "train",
        "score_correction_bias": "frozen",
    }
    assert labels["final_norm"]["scale"] == "train"
    mask = decay_mask(params)
    assert mask["layers"][0]["moe"]["router"]["kernel"] and not mask["final_norm"]["scale"]


@pytest.mark.parametrize(
    "change,field",
    [
        ({"steps": 0}, "steps"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"warmup_steps": 400}, "warmup_steps"),
        ({"b2": 1.0}, "b2"),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"keep_checkpoints": 0}, "keep_checkpoints"),
    ],
)
def test_invalid_train_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field}="):
        TrainConfig(**change)


def test_lr_schedule_warms_up_then_decays():
    sched = learning_rate_schedule(TrainConfig(steps=100, warmup_steps=10, learning_rate=2.0))
    lrs = np.array([float(sched(i)) for i in range(101)])
    np.testing.assert_allclose(lrs[:11], np.linspace(0, 2, 11), rtol=1e-6)
    assert np.all(np.diff(lrs[10:]) <= 0) and lrs[100] == pytest.approx(0.2)


def test_micro_lm_train_step_with_pallas_kernels_on_the_2x4_mesh():
    """One step of the micro LM (sigmoid routing, shared expert) on the data x expert mesh with
    `implementation="pallas"` (the kernels interpreted on CPU, inside shard_map) gives the loss
    and parameters of the same step on the XLA `blocked` path."""
    m = mesh()
    batch = global_batch(_batches(1)[0], m)
    out = {}
    for impl in ("pallas", "blocked"):
        step = make_train_step(MODEL, TRAIN, m, implementation=impl)
        state = init_train_state(MODEL, TRAIN, m)
        if impl == "pallas":
            calls = set(kernels_run(step, state, batch, platform="cpu"))
            assert calls == {"gmm/interpret", "gmm_t/interpret", "tgmm/interpret"}, calls
        out[impl] = step(state, batch)
    (state_p, metrics_p), (state_b, metrics_b) = out["pallas"], out["blocked"]
    assert bool(metrics_p.finite) and dict(m.shape) == {"data": 2, "expert": 4}
    np.testing.assert_allclose(float(metrics_p.loss), float(metrics_b.loss), rtol=2e-6)
    assert_close(state_p.params, state_b.params, err_msg="params after one step")
