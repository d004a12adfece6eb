"""`train_lm.py --upcycle-from` a dense moejax run: the MoE run starts from its MLPs and trains;
the summary names the recipes in use."""

import json

import pytest
from _helpers import MODEL, TRAIN, corpus

from moejax.cli import train_lm
from moejax.models import dense_lm_config
from moejax.training import train


@pytest.mark.slow  # two training runs (~1-2 min of CPU)
def test_upcycle_from_a_dense_run_trains_and_says_so(capsys, tmp_path):
    dense_dir = tmp_path / "dense"
    dense_cfg = dense_lm_config(MODEL, d_ff=64)
    train(
        dense_cfg, TRAIN.replace(steps=4, warmup_steps=1), corpus(), run_dir=str(dense_dir),
        progress=False, outputs=False,
    )  # fmt: skip
    out = tmp_path / "moe"
    args = ["--preset", "micro", "--out", str(out), "--no-progress", "--max-bytes", "200000"]
    args += ["--upcycle-from", str(dense_dir), "--upcycle-granularity", "2", "--steps", "8"]
    code = train_lm.main(args)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    line = next(ln for ln in printed.out.splitlines() if ln.startswith("training recipe"))
    assert line.endswith(f"| upcycled from {dense_dir} (granularity 2, noise 0)"), line
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0], losses


def test_upcycle_from_a_directory_without_checkpoints_is_one_line(capsys, tmp_path):
    out = tmp_path / "moe"
    code = train_lm.main(
        ["--preset", "micro", "--out", str(out), "--no-progress", "--upcycle-from", str(tmp_path)]
    )
    err = capsys.readouterr().err.strip()
    assert (
        code == 2
        and err == f"error: --upcycle-from={tmp_path}: no moejax training checkpoint there"
    )
