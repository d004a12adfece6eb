"""Scale-out layouts change memory and speed, never the math.

FSDP (parameters and Adam moments split over `fsdp`, gathered per layer), tensor parallelism
(heads and widths over `model`), rematerialisation policies and scanned layers, alone and
together, give the losses and parameters of the unsharded step; so do dynamic placement with
them on, and a checkpoint written under another layout.
"""

import os
import shutil

import jax
import numpy as np
import pytest
from _helpers import MODEL, TRAIN, corpus, host_tree
from jax.sharding import PartitionSpec as P
from test_placement import PLACED, ScriptedController

from moejax import parallel
from moejax.data import BatchIterator
from moejax.models import lm_partition_specs, presets
from moejax.testing import assert_close
from moejax.training import global_batch, init_train_state, make_train_step, placed, train
from moejax.training import presets as train_presets

MESHES = {
    "f8": ((8,), ("fsdp",)),
    "d2f2e2": ((2, 2, 2), ("data", "fsdp", "expert")),
    "f2e2m2": ((2, 2, 2), ("fsdp", "expert", "model")),
    "f2e4": ((2, 4), ("fsdp", "expert")),
    "d2e4": ((2, 4), ("data", "expert")),
}
STEPS = 3


def _mesh(name):
    return parallel.make_mesh(*MESHES[name])


def _steps(model, train_cfg, mesh, n=STEPS, step=None):
    it = BatchIterator(corpus().tokens, train_cfg.batch_size, model.max_seq_len, seed=0)
    step = step or make_train_step(model, train_cfg, mesh)
    state, losses = init_train_state(model, train_cfg, mesh), []
    for _ in range(n):
        state, metrics = step(state, global_batch(it.next(), mesh))
        losses.append(float(metrics.loss))
    return state, np.array(losses)


_REFERENCE = {}


def _reference(model, train_cfg, n=STEPS):
    key = (model, train_cfg, n)
    if key not in _REFERENCE:
        _REFERENCE[key] = _steps(model, train_cfg, None, n)
    return _REFERENCE[key]


def _check(model, train_cfg, mesh_name, remat, scan, n=STEPS):
    ref_state, ref_losses = _reference(model, train_cfg, n)
    cfg = train_cfg.replace(remat=remat, scan_layers=scan)
    state, losses = _steps(model, cfg, _mesh(mesh_name), n)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    assert_close(state.params, ref_state.params, err_msg=f"{mesh_name} {remat} scan={scan}")
    assert_close(state.opt_state, ref_state.opt_state, np.float32, err_msg="Adam moments")
    return state


@pytest.mark.parametrize(
    "mesh_name, remat, scan",
    [
        ("f8", "none", False),
        ("d2f2e2", "full", True),
        ("f2e2m2", "dots_saveable", True),
        pytest.param("f2e2m2", "none", False, marks=pytest.mark.slow),
        pytest.param("d2e4", "full", False, marks=pytest.mark.slow),
        pytest.param("f2e4", "dots_saveable", True, marks=pytest.mark.slow),
    ],
)
def test_micro_steps_equal_the_unsharded_steps(mesh_name, remat, scan):
    state = _check(MODEL, TRAIN, mesh_name, remat, scan)
    if "fsdp" in MESHES[mesh_name][1]:  # the weights really are split over fsdp
        wq = state.params["layers"][0]["attn"]["wq"]
        assert "fsdp" in str(wq.sharding.spec[0]), wq.sharding.spec


@pytest.mark.slow  # 61 s: the micro cases above show the same equality on this mesh; tiny adds size
def test_tiny_steps_equal_the_unsharded_steps():
    tiny, cfg = presets.get("tiny"), train_presets.get("tiny").replace(batch_size=8)
    _check(tiny, cfg, "f2e2m2", "full", True, n=2)


def test_partition_specs_follow_the_rules():
    specs = lm_partition_specs(presets.get("mixtral_8x7b"), _mesh("f2e2m2"))
    layer = specs["layers"][0]
    # Dense weights: D over fsdp and expert, heads over model.
    assert layer["attn"]["wq"] == P(("fsdp", "expert"), "model", None)
    assert layer["attn"]["wo"] == P("model", None, ("fsdp", "expert"))
    # Expert weights: E over expert, so D over fsdp only.
    assert layer["moe"]["experts"]["w_up"] == P("expert", "fsdp", "model")
    assert layer["moe"]["experts"]["w_down"] == P("expert", "model", "fsdp")
    assert layer["moe"]["router"]["kernel"] == P(("fsdp", "expert"), None)  # E never split
    assert specs["embed"]["embedding"] == P(None, ("fsdp", "expert"))
    # A width that does not divide over fsdp stays whole; heads that do not divide are an error.
    micro_on_8 = lm_partition_specs(MODEL.replace(vocab_size=256), _mesh("f8"))
    assert micro_on_8["layers"][0]["attn_norm"]["scale"] == P(None)
    with pytest.raises(ValueError, match="num_kv_heads=2: does not divide over the mesh.s model"):
        lm_partition_specs(MODEL, parallel.make_mesh((2, 4), ("fsdp", "model")))


def test_placement_with_fsdp_remat_and_scan_trains_like_without(tmp_path):
    """Re-placing every 4 steps, on an fsdp x expert mesh, with full remat and scanned layers:
    the logical parameters follow the unplaced, unsharded-layout run."""
    steps = 8
    base = PLACED.replace(steps=steps, expert_slots_per_device=0)
    common = dict(progress=False, outputs=False, tensorboard=False, async_checkpoints=False)
    ref = train(MODEL, base, corpus(), run_dir=str(tmp_path / "ref"), mesh=_mesh("d2e4"), **common)
    cfg = PLACED.replace(steps=steps, remat="full", scan_layers=True)
    got = train(
        MODEL, cfg, corpus(), run_dir=str(tmp_path / "placed"), mesh=_mesh("f2e4"),
        controller=ScriptedController, **common,
    )  # fmt: skip
    np.testing.assert_allclose(
        [r["loss"] for r in got.records], [r["loss"] for r in ref.records], rtol=1e-5
    )
    want = host_tree(ref.state.params)
    logical = placed.to_logical(got.state, got.placements, MODEL, cfg, _mesh("f2e4"))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max()),
        host_tree(logical.params),
        want,
    )


def test_checkpoint_written_on_one_layout_restores_onto_another(tmp_path):
    """4 steps on data x expert without scan, then 4 more restored onto fsdp x expert x model
    with remat and scanned layers: the run of 8 steps on the first layout, fp32-close."""
    cfg = TRAIN.replace(steps=8, checkpoint_every=4, eval_batches=0)
    common = dict(progress=False, outputs=False, tensorboard=False, async_checkpoints=False)
    straight = train(
        MODEL, cfg, corpus(), run_dir=str(tmp_path / "a"), mesh=_mesh("d2e4"), **common
    )
    src = os.path.join(straight.run_dir, "checkpoints", "4")
    shutil.copytree(src, tmp_path / "b" / "checkpoints" / "4")
    other_cfg = cfg.replace(remat="full", scan_layers=True)
    resumed = train(
        MODEL, other_cfg, corpus(), run_dir=str(tmp_path / "b"), mesh=_mesh("f2e2m2"), **common
    )
    assert resumed.steps_this_run == 4
    wq = resumed.state.params["layers"][0]["attn"]["wq"]
    assert wq.sharding.spec == P(("fsdp", "expert"), "model", None)
    assert_close(resumed.state.params, straight.state.params, np.float32)
    np.testing.assert_allclose(
        [r["loss"] for r in resumed.records], [r["loss"] for r in straight.records[4:]], rtol=1e-5
    )


def test_microbatches_accumulate_the_whole_batch_gradient():
    """4 micro-batches of the micro batch, with the load-balance loss off (it is the one term
    averaged over micro-batches rather than computed on the whole batch): the same steps."""
    cfg = TRAIN.replace(load_balance_weight=0.0, batch_size=16)
    ref_state, ref_losses = _reference(MODEL, cfg, 2)
    state, losses = _steps(MODEL, cfg.replace(microbatches=4, scan_layers=True), None, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    assert_close(state.params, ref_state.params, err_msg="params")


@pytest.mark.slow
def test_microbatches_on_a_mesh_with_remat():
    cfg = TRAIN.replace(load_balance_weight=0.0, batch_size=16)
    ref_state, _ = _reference(MODEL, cfg, 2)
    sharded, _ = _steps(MODEL, cfg.replace(microbatches=2, remat="full"), _mesh("f2e4"), 2)
    assert_close(sharded.params, ref_state.params, err_msg="params, sharded")


def test_dense_then_moe_interleave_scans_its_unit_and_runs_the_tail():
    """Layers dense, MoE, dense (`moe_every=2`, 3 layers): one scanned unit of two blocks and a
    leftover dense block, with FSDP and tensor parallelism, equal the unscanned one device."""
    model = MODEL.replace(num_layers=3, moe_every=2)
    assert model.moe_layers == (1,)
    _check(model, TRAIN, "f2e2m2", "full", True, n=2)
