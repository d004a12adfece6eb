"""`TrainConfig.load_balance`: the loss the step weighs and logs. The global-batch loss (expert
fractions over every token shard and micro-batch of the step) is the same number, with the same
gradients, on one device, on the 2x4 mesh and over 4 micro-batches."""

import jax
import numpy as np
import pytest
from _helpers import MODEL, TRAIN, corpus, mesh

from moejax.data import BatchIterator
from moejax.models import lm_forward
from moejax.testing import assert_close
from moejax.training import global_batch, init_train_state, make_train_step

CFG = TRAIN.replace(batch_size=16, load_balance_weight=0.1, z_loss_weight=0.0)


def _one_step(train_cfg, mesh_=None):
    it = BatchIterator(corpus().tokens, train_cfg.batch_size, MODEL.max_seq_len, seed=0)
    batch = it.next()
    state = init_train_state(MODEL, train_cfg, mesh_)
    params0 = jax.tree.map(np.asarray, state.params) if mesh_ is None else None  # donated
    state, metrics = make_train_step(MODEL, train_cfg, mesh_)(state, global_batch(batch, mesh_))
    return batch, params0, state, metrics


def _hand_global(params, batch):
    """`E * sum_e f_e P_e` per MoE layer from one forward over the whole batch, in numpy."""
    _, aux = lm_forward(params, batch[:, :-1], MODEL, implementation="ragged_dot")
    f = np.asarray(aux.expert_counts, np.float64)
    f /= f.sum(-1, keepdims=True)
    p = np.asarray(aux.mean_probs, np.float64)
    return float(np.mean(MODEL.moe.num_experts * np.sum(f * p, -1)))


@pytest.fixture(scope="module")
def whole():
    return _one_step(CFG.replace(load_balance="global_batch"))


def test_global_batch_loss_over_4_micro_batches_is_the_whole_batch_one(whole):
    batch, params0, ref, ref_metrics = whole
    want = _hand_global(params0, batch)
    np.testing.assert_allclose(float(ref_metrics.load_balance_loss), want, rtol=1e-5)
    cfg = CFG.replace(load_balance="global_batch", microbatches=4)
    _, _, state, metrics = _one_step(cfg)
    np.testing.assert_allclose(float(metrics.load_balance_loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics.total_loss), float(ref_metrics.total_loss), rtol=2e-6)
    assert_close(state.params, ref.params, err_msg="params after one step")
    # the micro-batch loss over the same 4 micro-batches is another number
    _, _, _, micro = _one_step(CFG.replace(microbatches=4))
    assert abs(float(micro.load_balance_loss) - want) > 1e-4


@pytest.mark.slow  # compiles the sharded step (~1 min of CPU)
def test_global_batch_loss_on_the_2x4_mesh_is_the_one_device_one(whole):
    _, _, ref, ref_metrics = whole
    cfg = CFG.replace(load_balance="global_batch", microbatches=2)
    _, _, state, metrics = _one_step(cfg, mesh())
    np.testing.assert_allclose(
        float(metrics.load_balance_loss), float(ref_metrics.load_balance_loss), rtol=1e-5
    )
    assert_close(state.params, ref.params, err_msg="params after one step, 2x4 mesh")


def test_sequence_loss_is_weighed_and_logged():
    cfg = CFG.replace(load_balance="sequence")
    batch, params0, _, metrics = _one_step(cfg)
    _, aux = lm_forward(params0, batch[:, :-1], MODEL, implementation="ragged_dot")
    want = float(np.mean(aux.sequence_balance_loss))
    np.testing.assert_allclose(float(metrics.load_balance_loss), want, rtol=1e-5)
    assert abs(want - float(np.mean(aux.load_balance_loss))) > 1e-4
    np.testing.assert_allclose(
        float(metrics.total_loss), float(metrics.loss) + 0.1 * want, rtol=1e-6
    )


def test_unknown_load_balance_names_the_field():
    with pytest.raises(ValueError, match=r"TrainConfig.load_balance='batch'"):
        CFG.replace(load_balance="batch")
