"""A run directory belongs to one run at a time (`moejax.training.rundir`), and a resumed run
says what changed (`moejax.training.resume`): refused for another model, batch or seed, applied
with one line for the rest."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from _helpers import MODEL, ROOT, TRAIN, cli, env, finished_steps, mesh, output, popen
from test_reliability import _data_state, _main

from moejax.training import Checkpointer, RunDirBusy, init_train_state, rundir

_HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from moejax.training.rundir import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def _hold(run_dir):
    """A subprocess holding `run_dir`'s lock (as a run would) until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER.format(root=ROOT), str(run_dir)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_on_a_locked_directory_exits_2_naming_the_holder(capsys, tmp_path):
    out = tmp_path / "run"
    holder = _hold(out)
    try:
        code, _, err = _main(capsys, out, "--no-outputs")
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith(f"error: --out: run directory {out} is in use by another run: pid ")
    assert f"pid {holder.pid} on host " in err
    assert os.listdir(out) == [rundir.LOCK_NAME]  # nothing else touched


def test_a_stale_lock_of_a_killed_run_is_taken_over_with_a_message(tmp_path):
    out = tmp_path / "run"
    holder = _hold(out)
    with pytest.raises(RunDirBusy, match=f"pid {holder.pid}"), rundir.run_lock(str(out)):
        pass
    holder.send_signal(signal.SIGKILL)  # the kernel drops its flock; the file still names it
    holder.wait()
    lines = []
    with rundir.run_lock(str(out), log=lines.append):
        info = json.loads((out / rundir.LOCK_NAME).read_text())
        assert info["pid"] == os.getpid()
        with rundir.run_lock(str(out)):  # re-entrant within the process
            pass
        assert json.loads((out / rundir.LOCK_NAME).read_text())["pid"] == os.getpid()
    assert len(lines) == 1 and f"pid {holder.pid}" in lines[0] and "no longer holds it" in lines[0]
    assert (out / rundir.LOCK_NAME).read_text() == ""  # released: empty, kept
    with rundir.run_lock(str(out), log=lines.append):  # a released lock: no message
        pass
    assert len(lines) == 1


def test_lazy_lock_is_taken_by_the_nested_one_and_kept_until_the_outer_ends(tmp_path):
    out = tmp_path / "run"
    with rundir.run_lock(str(out), lazy=True):
        assert not out.exists()  # nothing created before the inner lock
        with rundir.run_lock(str(out)):
            pass
        holder = subprocess.run(
            [sys.executable, "-c", _HOLDER.format(root=ROOT), str(out)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert holder.returncode != 0 and "in use by another run" in holder.stderr
    assert (out / rundir.LOCK_NAME).read_text() == ""


@pytest.mark.slow  # two real runs (compiles, 8 steps)
def test_two_concurrent_runs_on_one_out(tmp_path):
    """The probe's case: two `train_lm.py` started together on one --out. The second exits 2
    naming the first; the first finishes with its own checkpoints and consecutive metrics."""
    out = tmp_path / "run"
    args = cli("--out", out, "--no-outputs", "--strategy", "default", "--jax-cache", "none")
    first = popen(args, tmp_path / "first.log")
    deadline = time.time() + 300
    while not (out / rundir.LOCK_NAME).exists() or not (out / rundir.LOCK_NAME).read_text():
        assert first.poll() is None and time.time() < deadline, output(first)
        time.sleep(0.2)
    second = subprocess.run(args, env=env(), capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"in use by another run: pid {first.pid}" in second.stderr
    assert first.wait(timeout=600) == 0, output(first)
    with open(out / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == list(range(1, TRAIN.steps + 1))
    assert finished_steps(out / "checkpoints")[-1] == TRAIN.steps


# ---------------------------------------------------------------------------------------------
# Resume: what may change


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A micro run directory with a checkpoint at step 4 (written by `Checkpointer`)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    state = init_train_state(MODEL, TRAIN, mesh())
    state = dataclasses.replace(state, step=state.step + 4)
    ck = Checkpointer(str(out / "checkpoints"), MODEL, TRAIN)
    ck.save(state, data_state=_data_state(4), placements=[], mesh=mesh(), wait=True)
    ck.close()
    return out


@pytest.mark.parametrize(
    "args,says",
    [
        (["--seed", "5"], "--seed=5: checkpoint {ckpt} was written with TrainConfig.seed=0, this "
         "run has 5: a resumed run keeps it"),
        (["--batch-size", "16"], "--batch-size=16: checkpoint {ckpt} was written with "
         "TrainConfig.batch_size=8"),
        (["--seq-len", "8"], "--seq-len=8: checkpoint {ckpt} was written with TrainConfig.seq_len"),
        (["--preset", "tiny"], "--preset=tiny: checkpoint {ckpt} was written for a different "
         "model: "),
        (["--bf16-moments"], "--bf16-moments: checkpoint {ckpt} was written with "
         "TrainConfig.moment_dtype=None, this run has 'bfloat16': a resumed run keeps it (the "
         "saved Adam moments are stored in it)"),
    ],
)  # fmt: skip
def test_resume_refuses_another_model_batch_or_seed(capsys, saved_run, args, says):
    before = sorted(os.listdir(saved_run))
    code, _, err = _main(capsys, saved_run, "--no-outputs", *args)
    assert code == 2 and "\n" not in err, err
    assert says.format(ckpt=f"{saved_run}/checkpoints/4") in err, err
    assert finished_steps(saved_run / "checkpoints") == [4]
    assert sorted(os.listdir(saved_run)) == sorted({*before, rundir.LOCK_NAME})


def test_resume_applies_other_changes_with_one_line(capsys, saved_run, tmp_path):
    """--lr and --steps apply from the resumed step, listed in one line (here the run stops at
    once: --stop-at is the checkpoint's step)."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    code, _, err = _main(
        capsys, run, "--no-outputs", "--lr", "0.15", "--steps", "10", "--stop-at", "4",
        "--eval-batches", "0",
    )  # fmt: skip
    assert code == 0, err
    notice = [line for line in err.splitlines() if "changed settings" in line]
    assert notice == [
        "moejax: resumed with changed settings, applied from step 4: steps 8 -> 10, "
        "learning_rate 0.01 -> 0.15, eval_batches 4 -> 0"
    ], err


def test_a_read_only_run_directory_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A read-only `--out` (or its checkpoints/) is `RunDirError` naming it, before the run
    takes the lock (not a Permission denied traceback at the first write). As root, chmod does
    not stop writes, so `os.access` answers as a non-root user would."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("")
    os.chmod(out / "checkpoints", 0o555)
    try:
        if os.geteuid() == 0:
            real_access = os.access

            def access(path, mode):
                if mode & os.W_OK and not os.stat(path).st_mode & 0o200:
                    return False
                return real_access(path, mode)

            monkeypatch.setattr(rundir.os, "access", access)
        with pytest.raises(rundir.RunDirError, match="checkpoints is read-only"):
            rundir.check_run_dir(str(out))
    finally:
        os.chmod(out / "checkpoints", 0o755)
