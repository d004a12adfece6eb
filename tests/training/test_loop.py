"""The training loop: outputs (metrics, trace, TensorBoard, plots, checkpoints), restoring onto
another mesh shape, and checkpoints that must be refused."""

import json
import os
import shutil

import numpy as np
import pytest
from _helpers import MODEL, TRAIN, corpus, mesh

from moejax.placement import load_trace
from moejax.testing import assert_close
from moejax.training import Checkpointer, CheckpointError, abstract_state, rundir, train
from moejax.training.checkpoint import restore_target


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 micro steps on the 2 x 4 mesh, checkpoints at 4 and 8, all outputs."""
    run_dir = str(tmp_path_factory.mktemp("straight"))
    result = train(MODEL, TRAIN, corpus(), run_dir=run_dir, mesh=mesh(), progress=False)
    return run_dir, result


def test_run_writes_metrics_trace_tensorboard_plots_and_checkpoints(straight):
    run_dir, result = straight
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, 9))
    rows = TRAIN.batch_size * MODEL.max_seq_len * MODEL.moe.top_k
    for r in records:
        assert np.sum(r["expert_counts"], axis=1).tolist() == [rows] * MODEL.num_moe_layers
        assert len(r["device_imbalance"]) == MODEL.num_moe_layers
        assert all(v >= 1.0 for v in r["device_imbalance"])
        assert r["tokens_per_s"] > 0 and r["flops_per_s"] > 0 and not r["skipped"]
        assert all(0 < h <= np.log(MODEL.moe.num_experts) + 1e-6 for h in r["router_entropy"])
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # it learns, even in 8 steps
    trace = load_trace(os.path.join(run_dir, "metrics.jsonl"))  # the placement simulator's input
    assert trace.shape == (8, MODEL.num_moe_layers, MODEL.moe.num_experts)
    np.testing.assert_array_equal(trace, np.load(os.path.join(run_dir, "routing_trace.npy")))
    events = os.listdir(os.path.join(run_dir, "tensorboard"))
    assert any(name.startswith("events.out.tfevents") for name in events)
    for png in ("loss.png", "expert_load.png"):
        with open(os.path.join(run_dir, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["4", "8"]
    assert result.step == 8 and result.final_loss is not None and result.eval_loss is not None


def test_restore_onto_another_mesh_shape_continues_the_same_run(straight, tmp_path):
    run_dir, result = straight
    shutil.copytree(os.path.join(run_dir, "checkpoints", "4"), tmp_path / "checkpoints" / "4")
    other = train(
        MODEL,
        TRAIN,
        corpus(),
        run_dir=str(tmp_path),
        mesh=mesh((4, 2)),
        progress=False,
        outputs=False,
    )
    assert other.steps_this_run == 4
    leaf = other.state.params["layers"][0]["moe"]["experts"]["w_up"]
    assert dict(leaf.sharding.mesh.shape) == {"data": 4, "expert": 2}
    # Same math, other reduction order: fp32-close, not bit-identical.
    assert_close(other.state.params, result.state.params, np.float32)
    assert [r["step"] for r in other.records] == [5, 6, 7, 8]
    np.testing.assert_allclose(
        [r["loss"] for r in other.records], [r["loss"] for r in result.records[4:]], rtol=1e-5
    )


def test_checkpoint_of_another_model_is_refused(straight):
    run_dir, _ = straight
    wider = MODEL.replace(num_heads=8, num_kv_heads=4)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), wider, TRAIN)
    with pytest.raises(CheckpointError, match="different model: num_heads=4 there, 8 here"):
        ckpt.restore(8, restore_target(abstract_state(wider, TRAIN), None))


def test_corrupt_checkpoint_is_a_one_line_error_and_nothing_is_overwritten(straight, tmp_path):
    run_dir, _ = straight
    shutil.copytree(os.path.join(run_dir, "checkpoints", "8"), tmp_path / "checkpoints" / "8")
    data = tmp_path / "checkpoints" / "8" / "state" / "ocdbt.process_0" / "d"
    for chunk in os.listdir(data):  # the array data files: cut short, as by a failing disk
        with open(data / chunk, "r+b") as f:
            f.truncate(3)
    before = _snapshot(tmp_path)
    match = r"no intact checkpoint in .*\(tried steps 8: checkpoint .*/8: array data cannot be"
    with pytest.raises(CheckpointError, match=match) as err:
        train(MODEL, TRAIN, corpus(), run_dir=str(tmp_path), mesh=mesh(), progress=False)
    assert "\n" not in str(err.value)
    # No metrics, no new checkpoint, nothing rewritten; only the run directory's lock file, which
    # stays once taken (`rundir.RunLock.release`), is left, released (empty).
    lock = str(tmp_path / rundir.LOCK_NAME)
    after = _snapshot(tmp_path)
    assert after.pop(lock)[0] == 0
    assert after == before


def _snapshot(root):
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            st = os.stat(os.path.join(d, name))
            out[os.path.join(d, name)] = (st.st_size, st.st_mtime_ns)
    return out
