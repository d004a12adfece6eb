"""Batch split (micro-batches side by side through every block, staggered per stage) changes the
schedule, never the math: the steps of the unsplit, unsharded run, with every dispatcher, with
FSDP, tensor parallelism, remat and scanned layers, under placement and with the Pallas kernels;
and the routing statistics of the whole batch, exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import MODEL, TRAIN
from test_scale import _mesh, _reference, _steps

from moejax import models, parallel
from moejax.models import lm_forward
from moejax.parallel import slots
from moejax.placement import Placement
from moejax.testing import assert_close, kernels_run
from moejax.training import global_batch, init_train_state, make_train_step
from moejax.training import placed as train_placed

SLOW = pytest.mark.slow
BATCH16 = TRAIN.replace(batch_size=16)  # 2 sequences per device on 8 token shards


def _split_steps(train_cfg, mesh_name, k, strategy="auto", implementation="auto", n=3):
    mesh = None if mesh_name is None else _mesh(mesh_name)
    step = make_train_step(
        MODEL, train_cfg, mesh, strategy=strategy, implementation=implementation, batch_split=k
    )
    return _steps(MODEL, train_cfg, mesh, n=n, step=step)


@pytest.mark.parametrize(
    "mesh_name, k, strategy, remat, scan",
    [
        (None, 4, "auto", "none", False),
        ("d2e4", 2, parallel.Strategy(dispatcher="dropless"), "none", False),
        ("d2e4", 2, parallel.Strategy(dispatcher="allgather", chunks=2), "full", False),
        ("f2e2m2", 2, "auto", "dots_saveable", True),
        pytest.param("d2f2e2", 2, parallel.Strategy(mode="data"), "none", True, marks=SLOW),
        pytest.param("f8", 2, parallel.Strategy(mode="tensor"), "full", False, marks=SLOW),
    ],
)  # fmt: skip
def test_split_steps_equal_the_unsplit_unsharded_steps(mesh_name, k, strategy, remat, scan):
    ref_state, ref_losses = _reference(MODEL, BATCH16)
    cfg = BATCH16.replace(remat=remat, scan_layers=scan)
    state, losses = _split_steps(cfg, mesh_name, k, strategy)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    assert_close(state.params, ref_state.params, err_msg=f"{mesh_name} k={k} {strategy}")
    assert_close(state.opt_state, ref_state.opt_state, np.float32, err_msg="Adam moments")


def test_split_step_with_the_pallas_kernels():
    """The interpreted Pallas kernels run for each micro-batch, and the step is the blocked one."""
    m = _mesh("d2e4")
    state = init_train_state(MODEL, BATCH16, m)
    batch = global_batch(np.asarray(jax.random.randint(jax.random.key(0), (16, 17), 0, 256)), m)
    out = {}
    for impl in ("pallas", "blocked"):
        step = make_train_step(MODEL, BATCH16, m, implementation=impl, batch_split=2)
        if impl == "pallas":
            calls = set(kernels_run(step, state, batch, platform="cpu"))
            assert calls == {"gmm/interpret", "gmm_t/interpret", "tgmm/interpret"}, calls
        out[impl] = step(init_train_state(MODEL, BATCH16, m), batch)
    loss = {impl: float(metrics.loss) for impl, (_, metrics) in out.items()}
    np.testing.assert_allclose(loss["pallas"], loss["blocked"], rtol=2e-6)
    assert_close(out["pallas"][0].params, out["blocked"][0].params, err_msg="params")


def _tokens(b=16, s=16):
    return jax.random.randint(jax.random.key(1), (b, s), 0, MODEL.vocab_size)


def test_split_statistics_are_the_whole_batch_statistics():
    """Counts add up and the load-balance loss is re-formed from the merged f and P: exactly the
    whole batch's, not the mean of the micro-batches' losses (which differs)."""
    params = models.init_lm_params(MODEL, jax.random.key(0))
    _, whole = lm_forward(params, _tokens(), MODEL)
    _, split = lm_forward(params, _tokens(), MODEL, batch_split=4)
    np.testing.assert_array_equal(split.expert_counts, whole.expert_counts)
    for name in ("load_balance_loss", "z_loss", "router_entropy", "routed_fraction", "mean_probs"):
        got, want = getattr(split, name), getattr(whole, name)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
    quarters = [lm_forward(params, t, MODEL)[1] for t in models.split_rows(_tokens(), 4)]
    naive = np.mean([q.load_balance_loss for q in quarters], axis=0)
    assert np.max(np.abs(naive - whole.load_balance_loss)) > 1e-5  # the trap merge_stats avoids


def test_split_rows_keep_each_devices_rows_and_merge_back():
    x = jnp.arange(16)
    parts = models.split_rows(x, 2)
    np.testing.assert_array_equal(parts[0], x[0::2])
    np.testing.assert_array_equal(models.merge_rows(parts), x)


def test_split_forward_under_placement_equals_unsplit():
    """Replicated experts (physical slots), data x expert mesh: the split forward and its
    gradients are the unsplit ones. (A replica's share of an expert's rows depends on the
    rows' positions, so gradients are compared per logical expert, summed over replicas, as
    training combines them.)"""
    m = _mesh("d2e4")
    placement = Placement(np.array([0, 5, 0, 1, 2, 5, 3, 4, 5, 6, 7, 1]), 8, 4, 3)
    table = slots.slot_table(placement)
    params = models.init_lm_params(MODEL, jax.random.key(0))
    physical = lambda moe: {**moe, "experts": slots.to_physical(moe["experts"], table)}  # noqa: E731
    layers = [
        {**layer, "moe": physical(layer["moe"])} if MODEL.is_moe(i) else layer
        for i, layer in enumerate(params["layers"])
    ]
    params = {**params, "layers": layers}
    tables = (table,) * MODEL.num_moe_layers

    def loss(p, k):
        logits, aux = lm_forward(p, _tokens(), MODEL, mesh=m, slot_tables=tables, batch_split=k)
        return jnp.mean(logits**2) + aux.load_balance_loss.mean()

    grads = {k: jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, k) for k in (1, 2)}
    np.testing.assert_allclose(grads[2][0], grads[1][0], rtol=2e-6)
    logical = {k: train_placed.combine_grads(g, tables, MODEL) for k, (_, g) in grads.items()}
    assert_close(logical[2], logical[1], err_msg="gradients under placement")


@pytest.mark.parametrize("k, why", [(0, "positive int"), (3, "does not split"), (True, "positive")])
def test_bad_batch_split_is_one_clear_error(k, why):
    params = models.init_lm_params(MODEL, jax.random.key(0))
    with pytest.raises(ValueError, match=why):
        lm_forward(params, _tokens(b=8), MODEL, batch_split=k)
