"""A converted directory that is missing, foreign or corrupted is one line naming it, exit 2,
from every command that reads one: `generate` (MODEL), `train_lm --init-from`, `convert_hf
to-hf` (no traceback, nothing written)."""

from __future__ import annotations

import json
import os
import shutil

import _hf_decoder_reference as ref
import numpy as np
import pytest

from moejax.cli import convert_hf, generate, train_lm
from moejax.interop.hf import convert_to_orbax, load_converted_params, read_converted


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("converted_errors")
    config = ref.CONFIGS["qwen3_moe"]
    ref.write_checkpoint(str(root / "hf"), config, ref.random_state_dict(config, seed=5))
    convert_to_orbax(str(root / "hf"), str(root / "conv"))
    np.save(root / "tokens.npy", np.arange(4096, dtype=np.int32) % config["vocab_size"])
    return root / "conv"


def _largest_file(path):
    files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
    return max(files, key=os.path.getsize)


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _truncate(path):
    """Cut the file to half its length: arrays whose bytes lay past the cut cannot be read."""
    os.truncate(path, os.path.getsize(path) // 2)


def _tamper(d):
    """Rewrite the parameters through orbax with one value changed, keeping checksums.json: every
    array reads, one holds other values than the checksums say. (A flipped byte in the file is
    either, depending on where in the compressed stream the writer put that array's chunk.)"""
    import orbax.checkpoint as ocp

    path = os.path.join(d, "params")
    params = load_converted_params(d, read_converted(d)[0])
    experts = params["layers"][1]["moe"]["experts"]
    experts["w_up"] = np.array(experts["w_up"])
    experts["w_up"][3, 5, 7] += 1
    shutil.rmtree(path)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, params)
    ckptr.wait_until_finished()


# case -> (how the directory is spoiled, what the line says)
CASES = {
    "missing": (lambda d: shutil.rmtree(d), "no such directory"),
    "foreign": (
        lambda d: (shutil.rmtree(d), os.makedirs(d), _write(os.path.join(d, "notes.txt"), "hi")),
        "not a converted model directory",
    ),
    "model_json_not_json": (
        lambda d: _write(os.path.join(d, "model.json"), '{"format": '),
        "is not JSON",
    ),
    "model_json_foreign_field": (
        lambda d: _edit_config(d, lambda c: c.update(expert_colour="blue")),
        "no field 'expert_colour'",
    ),
    "params_truncated": (
        lambda d: _truncate(_largest_file(os.path.join(d, "params"))),
        "parameters cannot be read",
    ),
    "params_tampered": (_tamper, "array layers[1].moe.experts.w_up fails its checksum"),
}


def _edit_config(d, edit):
    path = os.path.join(d, "model.json")
    with open(path) as f:
        model = json.load(f)
    edit(model["config"])
    with open(path, "w") as f:
        json.dump(model, f)


def _commands(d, tmp, tokens):
    return {
        "generate": (generate.main, [d, "--ids", "1,2", "--no-progress"]),
        "train_lm": (
            train_lm.main,
            [
                "--init-from",
                d,
                "--out",
                os.path.join(tmp, "run"),
                "--data",
                tokens,
                "--no-progress",
                "--no-outputs",
                "--jax-cache",
                "none",
            ],
        ),  # fmt: skip
        "to-hf": (convert_hf.main, ["to-hf", d, os.path.join(tmp, "hf"), "--no-progress"]),
    }


@pytest.mark.parametrize("command", ["generate", "train_lm", "to-hf"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_spoiled_converted_directory_is_one_line(converted, case, command, tmp_path, capsys):
    spoil, says = CASES[case]
    d = str(tmp_path / "conv")
    shutil.copytree(converted, d)
    spoil(d)
    tokens = str(converted.parent / "tokens.npy")
    main, argv = _commands(d, str(tmp_path / "out"), tokens)[command]
    os.makedirs(tmp_path / "out")
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error")]
    assert code == 2, err
    assert len(errors) == 1 and says in errors[0], err
    assert not any("Traceback" in line for line in err), err
    assert os.listdir(tmp_path / "out") == []  # nothing written


GENERATE_INPUTS = {  # argv after MODEL -> what the one line says
    ("--ids", "1,2", "--max-new-tokens", "0"): "--max-new-tokens=0: need >= 1",
    ("--ids", "1,2", "--temperature", "-1"): "--temperature=-1.0",
    ("--ids", "1,2", "--temperature", "nan"): "--temperature=nan",
    ("--ids", "1,2", "--top-p", "0.5"): "greedy decoding ignores it",
    ("--ids", "1,2", "--temperature", "1", "--top-p", "1.5"): "--top-p=1.5",
    ("--ids", "1,x"): "--ids='1,x'",
    ("--ids", "1,99999"): "prompt id 99999: outside the model's vocabulary [0, 64)",
    ("--ids", ",".join(["1"] * 64)): "the prompt is 64 tokens",
    ("--prompt", ""): "--prompt: empty",
    ("--ids", "1", "--mesh", "2,x"): "--mesh='2,x'",
}


@pytest.mark.parametrize("argv", list(GENERATE_INPUTS), ids=lambda a: " ".join(a)[:40])
def test_generate_input_errors_are_one_line(converted, argv, capsys):
    code = generate.main([str(converted), *argv, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith("error: ") and GENERATE_INPUTS[argv] in err, err


def test_generate_says_when_it_cuts_max_new_tokens(converted, capsys):
    """A --max-new-tokens past the model's context is cut there with a notice, not silently."""
    code = generate.main([str(converted), "--ids", "1,2", "--max-new-tokens", str(10**12),
                          "--no-progress"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "--max-new-tokens=1000000000000: 62 fit after the 2-token prompt" in err
    assert len(out.strip().split(",")) == 64


def test_generate_on_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "model.txt").write_text("hi")
    assert generate.main([str(tmp_path / "model.txt"), "--ids", "1"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_to_hf_from_a_missing_checkpoint_is_one_line(converted, tmp_path, capsys):
    missing = tmp_path / "runs" / "olmoe" / "checkpoints" / "300"
    out = tmp_path / "hf"
    argv = ["to-hf", str(converted), str(out), "--checkpoint", str(missing), "--no-progress"]
    assert convert_hf.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {missing}: no such directory (a training checkpoint step")
    assert err.count("\n") == 1 and not out.exists()
