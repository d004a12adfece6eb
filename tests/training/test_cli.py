"""The train_lm command (`moejax.cli.train_lm`) on bad input: one line on stderr, exit code 2,
nothing written."""

import json
import os
import re

import pytest
from _helpers import MODEL, TRAIN, mesh

from moejax.cli import train_lm
from moejax.training import SetupError, check_setup


def _run(capsys, tmp_path, *args, stdout=None):
    out = tmp_path / "run"
    code = train_lm.main(["--preset", "micro", "--out", str(out), "--no-progress", *args])
    printed = capsys.readouterr()
    if stdout is not None:
        stdout.append(printed.out)
    return code, printed.err.strip(), out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--preset", "huge"], "unknown preset 'huge': choose one of micro, tiny"),
        (
            ["--data", "/no/such/corpus.txt"],
            "--data: corpus path /no/such/corpus.txt: no such file or directory",
        ),
        (["--batch-size", "12"], "batch_size=12: does not divide over the 8 token shards"),
        (["--mesh", "2,x"], "--mesh='2,x': need comma-separated ints"),
        (["--mesh", "4,4"], "needs 16 devices, 8 are available"),
        (["--steps", "-3"], "TrainConfig.steps=-3: must be a positive int"),
        (["--strategy", "dropless,chunk=2"], "strategy 'dropless,chunk=2': cannot read 'chunk=2'"),
        (
            ["--strategy", "dropless,batch_split=2"],
            "--strategy=dropless,batch_split=2: batch_split=2 does not divide the 1 sequences",
        ),
        (["--strategy", "data", "--dispatcher", "allgather"], "--dispatcher pins a strategy"),
        (["--tune-budget", "-1"], "TuningConfig.budget=-1.0: must be >= 0"),
        (["--tune-candidates", "capacity"], "no candidate strategy fits the run: capacity: the"),
    ],
)
def test_bad_flags_are_one_line_errors(capsys, tmp_path, args, message):
    code, err, out = _run(capsys, tmp_path, *args)
    assert code == 2 and err.startswith("error: ") and "\n" not in err
    assert message in err
    assert not out.exists()


def test_empty_corpus_file(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err, out = _run(capsys, tmp_path, "--data", str(empty))
    assert (code, err) == (2, f"error: --data: corpus file is empty: {empty}")
    assert not out.exists()


def test_foreign_checkpoint_directory(capsys, tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "notes.txt").write_text("mine")
    code, err, _ = _run(capsys, tmp_path)
    assert code == 2 and "is not a moejax checkpoint directory: unexpected entry 'notes.txt'" in err
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoints"]
    assert (ckpt / "notes.txt").read_text() == "mine"


def test_step_directory_without_metadata(capsys, tmp_path):
    step = tmp_path / "run" / "checkpoints" / "5"
    step.mkdir(parents=True)
    (step / "junk").write_text("x")
    code, err, _ = _run(capsys, tmp_path)
    assert code == 2 and "checkpoints/5: no readable metadata" in err and "\n" not in err
    assert sorted(os.listdir(step)) == ["junk"]


def test_experts_that_do_not_divide_over_the_expert_axis():
    six = MODEL.replace(moe=MODEL.moe.replace(num_experts=6))
    with pytest.raises(SetupError, match=r"num_experts=6: does not divide over the mesh's expert"):
        check_setup(six, TRAIN, mesh((2, 4)))


def test_a_model_without_moe_layers_is_refused_with_what_to_do():
    dense = MODEL.replace(mlp_layer_types=("dense",) * MODEL.num_layers, dense_d_ff=64)
    with pytest.raises(SetupError, match=r"no MoE layer; .*moejax.models.upcycle"):
        check_setup(dense, TRAIN, None)


def test_placement_with_measured_hardware(capsys, tmp_path):
    out = tmp_path / "run"
    args = ["--preset", "micro", "--out", str(out), "--no-progress", "--placement"]
    code = train_lm.main([*args, "--placement-hardware", "measured"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert (out / "placement_events.jsonl").exists()
    assert "expert re-placements" in printed.out and "placement overhead" in printed.out
    assert "placement cost model" in printed.out and "measured on this cpu mesh" in printed.out
    assert "placement checks" in printed.out  # every check, in placement_decisions.jsonl
    (outputs,) = [line for line in printed.out.splitlines() if line.startswith("outputs: ")]
    for name in ("placement_decisions.jsonl", "placement_controller.json", "loss.png"):
        assert name in outputs and (out / name).exists()

    # --strategy auto, the default: 8 steps cannot pay for a compile, so it keeps the default
    # and says so (tuning within the budget: tests/training/test_tuning.py).
    assert re.search(r"\nparallel strategy +\| dropless \(kept, not re-timed\)\n", printed.out)
    assert "kept dropless: a compile is estimated at" in printed.out
    assert (out / "tuning_events.jsonl").exists()


def test_the_outputs_line_names_what_the_run_wrote_and_its_compilation_cache(tmp_path):
    import types

    for name in ("metrics.jsonl", "loss.png", "placement_decisions.jsonl"):
        (tmp_path / name).write_text("")
    (tmp_path / "jax_cache").mkdir()
    args = types.SimpleNamespace(placement=True)
    result = types.SimpleNamespace(placement={"replacements": 0}, tuning=None)
    line = train_lm.outputs_line(str(tmp_path), args, result, str(tmp_path / "jax_cache"))
    assert line == (
        f"outputs: {tmp_path}/{{metrics.jsonl, loss.png, placement_decisions.jsonl}}; "
        f"compilation cache: {tmp_path / 'jax_cache'} (reused by reruns)"
    )
    assert "compilation cache" not in train_lm.outputs_line(str(tmp_path), args, result, None)


def test_strategy_auto_times_the_candidates_and_keeps_the_fastest(capsys, tmp_path):
    out = tmp_path / "run"
    args = ["--preset", "micro", "--out", str(out), "--no-progress", "--steps", "12"]
    tune = ["--tune-budget", "inf", "--tune-candidates", "allgather;data", "--tune-steps", "2"]
    code = train_lm.main([*args, *tune, "--eval-batches", "0"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    events = [json.loads(line) for line in (out / "tuning_events.jsonl").open()]
    assert [e["kind"] for e in events] == ["probe", "measured"]
    times = events[1]["times"]  # the real clock: whichever was faster here wins
    assert set(times) == {"allgather", "data"} and events[1]["chosen"] == min(times, key=times.get)
    assert "parallel strategy" in printed.out and "fastest median step of 2 timed" in printed.out


def test_a_layout_that_does_not_fit_gets_one_line_per_mistake(capsys, tmp_path):
    args = ["--mesh", "fsdp=1,expert=2,model=4", "--batch-size", "9"]
    stdout = []
    code, err, out = _run(capsys, tmp_path, *args, stdout=stdout)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2 and lines[0].startswith("error: ")
    assert stdout == [""], "no training banner before the error"
    assert "TrainConfig.batch_size=9: does not divide over the 2 token shards" in lines[0]
    assert "LMConfig.num_kv_heads=2: does not divide over the mesh's model axis of 4" in lines[1]
    assert not out.exists()
    code, err, _ = _run(capsys, tmp_path, "--mesh", "fsdp=2,expert=4", "--mesh-axes", "a,b")
    assert code == 2 and "names its axes: drop --mesh-axes" in err


def test_named_mesh_with_fsdp_remat_and_scan_trains(capsys, tmp_path):
    args = ["--mesh", "fsdp=2,expert=4", "--remat", "full", "--scan", "--steps", "2"]
    out = tmp_path / "run"
    code = train_lm.main(
        ["--preset", "micro", "--out", str(out), "--no-progress", "--no-outputs", *args]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "mesh {'fsdp': 2, 'expert': 4}" in printed.out
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_expert_precision_flags_set_the_moe_config():
    from moejax.cli import train_inputs

    args = train_lm.build_parser().parse_args(
        ["--preset", "micro", "--expert-precision", "fp8", "--fp8-grad-format", "e5m2"]
    )
    model_cfg, _ = train_inputs.configs(args)
    assert model_cfg.moe.expert_precision == "fp8" and model_cfg.moe.fp8_grad_format == "e5m2"
    default, _ = train_inputs.configs(train_lm.build_parser().parse_args(["--preset", "micro"]))
    assert default.moe.expert_precision == "bf16"
