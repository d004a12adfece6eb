"""Exact resume after kill -9, SIGTERM handling, and interrupted saves (subprocesses running
experiments/train_lm.py, compared with in-process runs)."""

import os
import shutil
import signal
import time

import numpy as np
from _helpers import (
    MODEL,
    TRAIN,
    assert_trees_equal,
    cli,
    corpus,
    finished_steps,
    mesh,
    output,
    popen,
)

from moejax.training import Checkpointer, train
from moejax.training.metrics import read_records

STEPS = 40  # the schedule's length; the killed run never gets near it


def _wait_for(proc, condition, what, timeout=400):
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(
                f"run exited (rc={proc.returncode}) before {what}:\n" + output(proc)[-3000:]
            )
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_kill_9_then_resume_is_bit_identical_and_ignores_interrupted_saves(tmp_path):
    run_dir = tmp_path / "killed"
    ckpt_dir = run_dir / "checkpoints"
    proc = popen(
        cli(
            "--steps",
            STEPS,
            "--checkpoint-every",
            1,
            "--out",
            run_dir,
            "--no-outputs",
            "--eval-batches",
            0,
        ),
        tmp_path / "killed.log",
    )
    _wait_for(proc, lambda: len(finished_steps(ckpt_dir)) >= 2, "two finished checkpoints")
    proc.send_signal(signal.SIGKILL)  # may land mid-save: that save must not count
    proc.wait()
    latest = max(finished_steps(ckpt_dir))
    assert latest < STEPS - 3
    # A save cut short at a later step (as if killed before orbax's final rename): its tmp
    # directory, with truncated files, must never be taken as the latest checkpoint.
    partial = ckpt_dir / f"{latest + 1}.orbax-checkpoint-tmp-1234"
    shutil.copytree(ckpt_dir / str(latest), partial, dirs_exist_ok=True)
    for root, _, files in os.walk(partial):
        for name in files:
            with open(os.path.join(root, name), "r+b") as f:
                f.truncate(1)
    assert Checkpointer(str(ckpt_dir), MODEL, TRAIN).latest_step() == latest

    stop = latest + 3
    cfg = TRAIN.replace(steps=STEPS, checkpoint_every=0, eval_batches=0)
    kw = dict(mesh=mesh(), stop_at=stop, progress=False, outputs=False)
    resumed = train(MODEL, cfg, corpus(), run_dir=str(run_dir), **kw)
    straight = train(MODEL, cfg, corpus(), run_dir=str(tmp_path / "straight"), **kw)
    assert resumed.steps_this_run == 3 and straight.steps_this_run == stop
    assert_trees_equal(resumed.state, straight.state)  # params, Adam moments, RNG, counters
    # The history: the killed process's steps up to the checkpoint, then the resumed ones, are
    # exactly the uninterrupted run's (records after the checkpoint were dropped on resume).
    history = read_records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in history] == list(range(1, stop + 1))
    assert [r["loss"] for r in history] == [r["loss"] for r in straight.records]
    assert [r["expert_counts"] for r in history] == [r["expert_counts"] for r in straight.records]


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    proc = popen(
        cli("--steps", 1000, "--checkpoint-every", 0, "--eval-batches", 0, "--out", run_dir),
        tmp_path / "run.log",
    )
    metrics = run_dir / "metrics.jsonl"
    _wait_for(proc, lambda: len(read_records(metrics)) >= 2, "two steps")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    out = output(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "stopped early" in out and "Traceback" not in out
    last = read_records(metrics)[-1]["step"]
    assert 2 <= last < 1000
    assert os.listdir(run_dir / "checkpoints") == [str(last)]  # finished, no tmp left behind
    assert (run_dir / "loss.png").exists() and (run_dir / "routing_trace.npy").exists()
    assert np.load(run_dir / "routing_trace.npy").shape[0] == last
