"""Hugging Face -> orbax -> Hugging Face bit-identical (`moejax.interop.hf.convert_to_orbax`,
`convert_to_hf`), training continues from the converted weights (`train_lm.py --init-from`), bad
input is one line (`moejax.cli.convert_hf`)."""

from __future__ import annotations

import os

import _hf_decoder_reference as ref
import numpy as np
import pytest

from moejax.cli import convert_hf, train_lm
from moejax.interop.hf import SafetensorsCheckpoint, convert_to_hf, convert_to_orbax


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    sd = ref.random_state_dict(ref.CONFIGS["qwen3_moe"], seed=5)
    ref.write_checkpoint(str(root / "hf"), ref.CONFIGS["qwen3_moe"], sd, shards=2)
    cfg, family = convert_to_orbax(str(root / "hf"), str(root / "conv"))
    assert (family, cfg.moe.num_experts) == ("qwen3_moe", ref.CONFIGS["qwen3_moe"]["num_experts"])
    return root, sd


def _same_tensors(path, sd):
    got = SafetensorsCheckpoint(path)
    assert sorted(got.tensors) == sorted(sd)
    for name, want in sd.items():
        assert got.read(name).tobytes() == want.tobytes(), name


def test_to_orbax_and_back_is_bit_identical(converted):
    root, sd = converted
    convert_to_hf(str(root / "conv"), str(root / "back"))
    _same_tensors(root / "back", sd)


@pytest.mark.slow  # 38 s: compiles a train step on 8 devices
def test_training_continues_from_the_converted_model(converted, tmp_path):
    """One step at a learning rate of 1e-9 from the converted weights, exported back: in bf16
    the update is invisible, so every tensor comes back bit-identical (from the initialiser's
    weights nothing would)."""
    root, sd = converted
    tokens = np.random.default_rng(0).integers(0, 64, 20_000).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    run = tmp_path / "run"
    code = train_lm.main([
        "--preset", "micro", "--init-from", str(root / "conv"),
        "--data", str(tmp_path / "tokens.npy"),
        "--out", str(run), "--steps", "1", "--checkpoint-every", "1", "--lr", "1e-9",
        "--strategy", "default", "--no-progress", "--no-outputs", "--jax-cache", "none",
    ])  # fmt: skip
    assert code == 0
    step = run / "checkpoints" / "1"
    args = ["to-hf", str(root / "conv"), str(tmp_path / "hf"), "--checkpoint", str(step)]
    assert convert_hf.main([*args, "--no-progress"]) == 0
    _same_tensors(tmp_path / "hf", sd)


def test_bad_input_is_one_line(converted, capsys, tmp_path):
    root, _ = converted
    os.remove(root / "hf" / "model-00001-of-00002.safetensors")
    code = convert_hf.main(["to-orbax", str(root / "hf"), str(tmp_path / "x"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "model-00001-of-00002.safetensors" in err
    assert not (tmp_path / "x").exists() and os.listdir(tmp_path) == []
    (tmp_path / "nc").mkdir()
    assert (
        convert_hf.main(["to-hf", str(tmp_path / "nc"), str(tmp_path / "y"), "--no-progress"]) == 2
    )
    assert "not a converted model directory" in capsys.readouterr().err


def test_init_from_a_directory_that_is_not_converted(capsys, tmp_path):
    args = ["--preset", "micro", "--init-from", str(tmp_path), "--out", str(tmp_path / "run")]
    code = train_lm.main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "not a converted model directory" in err
    assert not (tmp_path / "run").exists()
