"""Integrity end to end: `convert_hf.py to-hf --checkpoint` verifies the training checkpoint's
checksums as a resumed run does, converted directories carry checksums that `to-hf` and
`train_lm.py --init-from` verify (on one device or a mesh, by either algorithm),
and NaN/Inf weights are refused unless `--allow-nonfinite`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import _hf_decoder_reference as ref
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from moejax.cli import convert_hf, train_lm
from moejax.interop.hf import (
    ConvertedDirError,
    NonFiniteError,
    SafetensorsCheckpoint,
    load_converted_params,
    read_converted,
    save_converted,
)
from moejax.interop.hf._converted import PARAMS_DIR
from moejax.training import Checkpointer, init_train_state
from moejax.training import presets as train_presets

# Failing orbax restores leave tensorstore callbacks on a closed event loop (harmless).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
TRAIN = train_presets.get("micro")
BAD = "layers[1].moe.experts.w_up"  # the weight tampered with


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    config = ref.CONFIGS["qwen3_moe"]
    ref.write_checkpoint(str(root / "hf"), config, ref.random_state_dict(config, seed=2))
    assert convert_hf.main(["to-orbax", str(root / "hf"), str(root / "conv"), "--no-progress"]) == 0
    return root


def _one_wrong_weight(params: dict, value=-1.9e30) -> dict:
    experts = params["layers"][1]["moe"]["experts"]
    experts["w_up"] = np.array(experts["w_up"])
    experts["w_up"][3, 5, 7] = value
    return params


def _tampered_copy(converted, tmp_path, value=-1.9e30):
    """The converted directory with one weight rewritten through orbax (which reads it back
    without complaint), its checksums.json unchanged."""
    conv = tmp_path / "conv"
    shutil.copytree(converted / "conv", conv)
    cfg, _, _ = read_converted(str(conv))
    params = _one_wrong_weight(load_converted_params(str(conv), cfg), value)
    shutil.rmtree(conv / PARAMS_DIR)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(str(conv / PARAMS_DIR), params)
    ckptr.wait_until_finished()
    return conv


def _one_line(capsys, says):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    return err


def test_converted_directory_carries_checksums_that_restoring_verifies(converted, tmp_path, capsys):
    sums = json.loads((converted / "conv" / "checksums.json").read_text())
    assert f"{BAD}" in sums["arrays"] and len(sums["arrays"]) > 10
    conv = _tampered_copy(converted, tmp_path)
    cfg, _, _ = read_converted(str(conv))
    with pytest.raises(ConvertedDirError, match=rf"array {re.escape(BAD)} fails"):
        load_converted_params(str(conv), cfg)
    assert convert_hf.main(["to-hf", str(conv), str(tmp_path / "hf"), "--no-progress"]) == 2
    _one_line(capsys, f"array {BAD} fails its checksum")
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow  # 12 s: compiles the initialiser on 8 devices before the weights are read
def test_init_from_a_flipped_converted_model_exits_2(converted, tmp_path, capsys):
    """The probe's case: `--init-from` trained on a flipped weight, exit 0. Now one line."""
    conv = _tampered_copy(converted, tmp_path)
    tokens = np.random.default_rng(0).integers(0, 64, 20_000).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    code = train_lm.main([
        "--preset", "micro", "--init-from", str(conv), "--data", str(tmp_path / "tokens.npy"),
        "--out", str(tmp_path / "run"), "--steps", "1", "--strategy", "default",
        "--no-progress", "--no-outputs", "--jax-cache", "none",
    ])  # fmt: skip
    assert code == 2
    _one_line(capsys, f"array {BAD} fails its checksum")
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(
        tmp_path / "run" / "checkpoints"
    )


def test_nonfinite_converted_weights_are_refused_unless_allowed(converted, tmp_path, capsys):
    cfg, hf_config, family = read_converted(str(converted / "conv"))
    params = _one_wrong_weight(load_converted_params(str(converted / "conv"), cfg), np.nan)
    conv = tmp_path / "nan"
    save_converted(str(conv), cfg, params, hf_config, family)  # its checksums hold the NaN
    with pytest.raises(NonFiniteError, match=rf"array {re.escape(BAD)}: 1 of"):
        load_converted_params(str(conv), cfg)
    assert np.isnan(load_converted_params(str(conv), cfg, allow_nonfinite=True)["layers"][1]["moe"][
        "experts"]["w_up"][3, 5, 7])  # fmt: skip
    out = tmp_path / "hf"
    assert convert_hf.main(["to-hf", str(conv), str(out), "--no-progress"]) == 2
    _one_line(capsys, "1 of 6144 values are NaN or Inf; pass --allow-nonfinite")
    assert (
        convert_hf.main(["to-hf", str(conv), str(out), "--no-progress", "--allow-nonfinite"]) == 0
    )


def _train_checkpoint(converted, tmp_path):
    """A training checkpoint (step 3) of the converted model: `<run>/checkpoints/3`."""
    cfg, _, _ = read_converted(str(converted / "conv"))
    state = init_train_state(cfg, TRAIN)
    state = dataclasses.replace(state, step=state.step + 3)
    ckpt = Checkpointer(str(tmp_path / "run" / "checkpoints"), cfg, TRAIN)
    ckpt.save(state, data_state={}, placements=[], wait=True)
    ckpt.close()
    return tmp_path / "run" / "checkpoints" / "3", state


def test_to_hf_checkpoint_verifies_the_crcs_as_train_lm_does(converted, tmp_path, capsys):
    """The probe's case: `to-hf --checkpoint` skipped the CRC-32 checks and exported a flipped
    weight, exit 0. Now: intact exports bit for bit; tampered is one line, exit 2."""
    step, state = _train_checkpoint(converted, tmp_path)
    args = ["to-hf", str(converted / "conv"), str(tmp_path / "ok"), "--checkpoint", str(step)]
    assert convert_hf.main([*args, "--no-progress"]) == 0
    got = SafetensorsCheckpoint(tmp_path / "ok")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    want = np.asarray(state.params["layers"][1]["moe"]["experts"]["w_up"][3]).T
    np.testing.assert_array_equal(got[name].astype(np.float32), want.astype(got[name].dtype))
    # Tamper: rewrite the state through orbax with one weight changed, keeping the checksums.
    mgr = ocp.CheckpointManager(str(step.parent), item_names=("state", "meta", "checksums"))
    items = mgr.restore(3, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(jax.tree.map(np.asarray, dataclasses.asdict(state))),
        meta=ocp.args.JsonRestore(), checksums=ocp.args.JsonRestore(),
    ))  # fmt: skip
    items["state"]["params"] = _one_wrong_weight(items["state"]["params"])
    shutil.rmtree(step)
    mgr.reload()
    mgr.save(3, args=ocp.args.Composite(
        state=ocp.args.StandardSave(items["state"]), meta=ocp.args.JsonSave(items["meta"]),
        checksums=ocp.args.JsonSave(items["checksums"]),
    ), force=True)  # fmt: skip
    mgr.wait_until_finished()
    mgr.close()
    args = ["to-hf", str(converted / "conv"), str(tmp_path / "bad"), "--checkpoint", str(step)]
    assert convert_hf.main([*args, "--no-progress"]) == 2
    _one_line(capsys, f"array params.{BAD} fails its checksum")
    assert not (tmp_path / "bad").exists()


def _mesh():
    from moejax import parallel

    return parallel.make_mesh((2, 4), ("data", "expert"))


def _rewrite_as(conv, algorithm):
    """Rewrite `conv`'s checksums.json with `algorithm` ("fmixsum64": as parameters that span
    processes are written)."""
    from moejax.training.checksums import state_checksums

    cfg, _, _ = read_converted(str(conv))
    sums = json.loads((conv / "checksums.json").read_text())
    arrays = state_checksums(load_converted_params(str(conv), cfg), algorithm)
    assert set(sums["arrays"]) == set(arrays)
    (conv / "checksums.json").write_text(json.dumps({**sums, "algorithm": algorithm,
                                                     "arrays": arrays}))  # fmt: skip


@pytest.mark.parametrize("algorithm", ["fmixsum64", "crc32"])
def test_converted_parameters_loaded_onto_a_mesh_are_verified(converted, tmp_path, algorithm):
    conv = tmp_path / "intact"
    shutil.copytree(converted / "conv", conv)
    tampered = _tampered_copy(converted, tmp_path, value=0.5)
    if algorithm == "fmixsum64":
        _rewrite_as(conv, algorithm)
        shutil.copy(conv / "checksums.json", tampered / "checksums.json")
    assert json.loads((conv / "checksums.json").read_text())["algorithm"] == algorithm
    cfg, _, _ = read_converted(str(conv))
    params = load_converted_params(str(conv), cfg, _mesh())  # verified on the mesh
    w = params["layers"][1]["moe"]["experts"]["w_up"]
    assert len(w.sharding.device_set) == 8 and not w.sharding.is_fully_replicated
    for mesh in (_mesh(), None):
        with pytest.raises(ConvertedDirError, match=rf"array {re.escape(BAD)} fails"):
            load_converted_params(str(tampered), cfg, mesh)
