"""Faults of a run under jax.distributed (`moejax.cli._distributed`, `moejax.cli._guard`,
`moejax.training.peers`): two train_lm processes on 127.0.0.1, 4 simulated CPU devices each,
the micro preset.

- processes given different runs (--batch-size, --seed, --preset, --data): one line per
  difference on every process, exit 2, before anything compiles (no Gloo connection);
- SIGTERM to one process: both stop after the same step with one checkpoint, exit 0; the
  resumed run ends bit-identical to an uninterrupted one (slow);
- kill -9 of one process (the coordinator, or the other) or SIGSTOP of the other: the survivor
  exits 6 within --peer-timeout with one line naming the process gone and the checkpoint to
  resume from, and a rerun resumes from it (slow);

plus the decision logic of `--distributed` with the environment mocked, the stderr filter on
the C++ reports of jax 0.10.2 and 0.12, and the disagreement lines.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import types

import pytest
from _helpers import MODEL, TRAIN, assert_trees_equal, cli, finished_steps, free_port, output, popen

from moejax.cli import _distributed, _guard, train_inputs, train_lm
from moejax.cli.train_inputs import InputError
from moejax.training import peers
from moejax.training.checkpoint import Checkpointer, restore_target
from moejax.training.metrics import read_records
from moejax.training.state import abstract_state

# --- decision logic (no processes) -------------------------------------------------------------

SLURM = {
    "SLURM_JOB_ID": "42",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
}

OMPI = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:34911"}
MEGA = "MEGASCALE_COORDINATOR_ADDRESS"


def _args(**kw):
    base = {"distributed": "auto", "coordinator": None, "num_processes": 1, "process_id": 0}
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, None),
        ({"HOME": "/root"}, None),
        (SLURM, "SLURM (job 42, 4 tasks)"),
        ({**SLURM, "SLURM_STEP_NUM_TASKS": "2"}, "SLURM (job 42, 2 tasks)"),
        ({**SLURM, "SLURM_NTASKS": "1"}, None),  # a single task: one process
        ({**SLURM, "SLURM_STEP_NUM_TASKS": "1"}, None),  # a 1-task srun inside a 4-task job
        ({k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}, None),  # sbatch only
        ({**OMPI, "OMPI_COMM_WORLD_SIZE": "8"}, "Open MPI (8 ranks)"),
        ({**OMPI, "OMPI_COMM_WORLD_SIZE": "1"}, None),
        ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}, "Cloud TPU (4 hosts)"),
        ({"TPU_WORKER_HOSTNAMES": "localhost"}, None),  # a single-host TPU VM
        ({"TPU_PROCESS_ADDRESSES": "a:1,b:1"}, "Cloud TPU (2 hosts)"),
        ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2"}, f"Cloud TPU multislice ({MEGA})"),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),  # a pod, not an indexed job
    ],
)  # fmt: skip
def test_cluster_environment_from_variables(environ, expected):
    assert _distributed.cluster_environment(environ) == expected


def test_kubernetes_needs_the_kubernetes_package():
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3"}
    found = _distributed.cluster_environment(env, find_spec=lambda name: object())
    assert found == "Kubernetes indexed job (JOB_COMPLETION_INDEX)"
    assert _distributed.cluster_environment(env, find_spec=lambda name: None) is None


def test_decide():
    decide = _distributed.decide
    # A single machine without flags: jax.distributed is not initialised.
    assert decide(_args(), {}).how is None
    # Explicit flags keep working, wherever the process runs.
    explicit = _args(coordinator="10.0.0.1:1234", num_processes=2, process_id=1)
    assert decide(explicit, {}).how == "explicit"
    assert decide(explicit, SLURM).how == "explicit"
    # On a cluster jax detects: initialize() without arguments.
    d = decide(_args(), SLURM)
    assert (d.how, d.why) == ("detect", "detected SLURM (job 42, 4 tasks)")
    assert decide(_args(distributed="on"), {}).how == "detect"
    assert decide(_args(distributed="off"), SLURM).how is None
    with pytest.raises(InputError, match="--num-processes > 1 needs --coordinator"):
        decide(_args(num_processes=2), {})
    assert decide(_args(num_processes=2), SLURM).how == "detect"
    with pytest.raises(InputError, match="--distributed=off: not with --coordinator"):
        decide(_args(distributed="off", coordinator="h:1"), {})


def test_disagreement_lines():
    records = [{"--batch-size": 8, "--seed": 0}, {"--batch-size": 16, "--seed": 0}]
    assert peers.disagreements(records) == ["--batch-size is 8 on process 0, 16 on process 1"]
    three = [{"--preset": "micro"}, {"--preset": "tiny"}, {"--preset": "micro"}, {}]
    assert peers.disagreements(three) == [
        '--preset is "micro" on processes 0, 2, "tiny" on process 1, not given on process 3'
    ]
    assert peers.disagreements([{"a": [1, 2]}, {"a": [1, 2]}]) == []


def test_the_run_record_holds_what_decides_the_run():
    parse = train_lm.parse_args
    one = parse(["--mesh", "data=2,expert=4", "--num-processes", "2", "--preset", "micro"])
    other = parse(["--mesh", "2,4", "--mesh-axes", "data,expert", "--num-processes", "2",
                   "--process-id", "1", "--no-progress", "--preset", "micro",
                   "--batch-size", str(TRAIN.batch_size)])  # fmt: skip
    # The same mesh written two ways, per-process flags, a flag given as the preset's value.
    flags = [_distributed.flags_record(a, mesh=train_inputs.mesh_text(a)) for a in (one, other)]
    assert flags[0] == flags[1]
    record = train_inputs.config_record
    assert record(*train_inputs.configs(one)) == record(*train_inputs.configs(other))
    assert flags[0]["--mesh"] == "data=2,expert=4"
    assert {"moejax version", "jax version", "jaxlib version", "--preset", "--data"} <= set(
        flags[0]
    )
    assert "--process-id" not in flags[0] and "--batch-size" not in flags[0]  # compared as configs
    assert "--batch-size" in record(*train_inputs.configs(one))


# --- the stderr filter --------------------------------------------------------------------------


# The C++ reports of jax's coordination client when a peer is lost, as the survivor printed them
# (process 0 gone, jax 0.12; process 1 gone, jax 0.10.2).
_LOGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_logs")


def _log(name: str) -> bytes:
    with open(os.path.join(_LOGS, name), "rb") as f:
        return f.read()


def _filtered(text: bytes, run_dir) -> str:
    out = []
    filt = _guard.Filter(str(run_dir), "5", out.append)
    for line in text.splitlines(keepends=True):
        filt.line(line)
    filt.close()
    return b"".join(out).decode()


def test_guard_turns_the_abort_into_one_line(tmp_path):
    (tmp_path / "checkpoints" / "8").mkdir(parents=True)
    (tmp_path / "checkpoints" / "12.orbax-checkpoint-tmp-3").mkdir()  # unfinished: not named
    ckpt = tmp_path / "checkpoints" / "8"
    assert _filtered(_log("leader_gone_jax012.txt"), tmp_path) == (
        "moejax: training preset 'micro'\n"
        "error: process 0 (the coordinator) is gone; this process stops too (exit 6); rerun "
        f"every process with the same flags to resume from step 8 ({ckpt})\n"
    )
    assert _filtered(_log("peer_gone_jax0102.txt"), tmp_path).splitlines() == [
        "[Gloo] Rank 0 is connected to 7 peer ranks.",
        "error: process 1 is gone (no heartbeat for 5 s); this process stops too (exit 6); rerun "
        f"every process with the same flags to resume from step 8 ({ckpt})",
    ]
    assert "starts from step 0" in _filtered(_log("peer_gone_jax0102.txt"), tmp_path / "none")


def test_guard_passes_other_log_lines_through(tmp_path):
    text = (
        b"W1203 07:42:58.357651   19544 preemption_sync_manager.cc:147] a warning alone\n"
        b"Traceback (most recent call last):\nValueError: a bug\n"
    )
    assert _filtered(text, tmp_path) == text.decode()  # no abort followed: nothing dropped


# --- two processes ------------------------------------------------------------------------------


def _launch(tmp_path, flags0=(), flags1=None, name="run"):
    port = free_port()
    procs = []
    for i, own in enumerate((flags0, flags0 if flags1 is None else flags1)):
        args = cli(
            "--out", tmp_path / name, "--num-processes", 2, "--process-id", i,
            "--coordinator", f"127.0.0.1:{port}", "--jax-cache", "none", "--eval-batches", 0,
            "--no-outputs", *own,
        )  # fmt: skip
        log = tmp_path / f"{name}.p{i}.log"
        procs.append(popen(args, log, devices=4, compilation_cache=False))
    return procs


def _wait(procs, timeout, since=None):
    """Seconds from `since` (default: now) until each process exited."""
    since = time.monotonic() if since is None else since
    ends = [None] * len(procs)
    try:
        while any(e is None for e in ends) and time.monotonic() - since < timeout:
            for i, p in enumerate(procs):
                if ends[i] is None and p.poll() is not None:
                    ends[i] = time.monotonic() - since
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join(f"--- process {i}:\n{output(p)[-3000:]}" for i, p in enumerate(procs))
    assert all(e is not None for e in ends), f"still running after {timeout} s\n{logs}"
    return ends, logs


def _errors(proc) -> list[str]:
    return [line for line in output(proc).splitlines() if line.startswith("error:")]


@pytest.mark.parametrize(
    "flags0, flags1, line",
    [
        (["--batch-size", 8], ["--batch-size", 16], "--batch-size is 8 on process 0, 16 on proc"),
        (["--seed", 1], ["--seed", 2], "--seed is 1 on process 0, 2 on process 1"),
        ([], ["--preset", "tiny"], '--preset is "micro" on process 0, "tiny" on process 1'),
        (["--data", "a"], ["--data", "b"], "--data is "),
    ],
    ids=["batch", "seed", "preset", "data"],
)  # fmt: skip
def test_processes_given_different_runs_exit_2_in_one_line(tmp_path, flags0, flags1, line):
    for name, size in (("a", 3000), ("b", 3001)):  # the same file name, another size
        (tmp_path / name).mkdir()
        (tmp_path / name / "text.txt").write_bytes(b"x" * size)
    flags0 = [tmp_path / f if f in ("a", "b") else f for f in flags0]
    flags1 = [tmp_path / f if f in ("a", "b") else f for f in flags1]
    procs = _launch(tmp_path, flags0, flags1)
    ends, logs = _wait(procs, timeout=120)
    assert [p.returncode for p in procs] == [2, 2], logs
    for p in procs:
        errors = _errors(p)
        assert len(errors) == 1 and errors[0].startswith(f"error: processes disagree: {line}"), logs
        text = output(p)
        assert "Traceback" not in text and "Gloo" not in text, logs  # nothing compiled or ran
    if line == "--data is ":
        assert '(1 files, 3000 bytes)" on process 0' in errors[0], errors[0]
        assert '(1 files, 3001 bytes)" on process 1' in errors[0], errors[0]
    assert not (tmp_path / "run").exists()  # nothing written
    print(f"exit times (s, from start, including jax's import): {ends}")


def _final_state(run_dir, step):
    """The whole train state of `run_dir`'s checkpoint `step`, restored on one device."""
    ckpt = Checkpointer(
        str(run_dir / "checkpoints"), MODEL, TRAIN, keep=sys.maxsize, async_save=False
    )
    try:
        return ckpt.restore(step, restore_target(abstract_state(MODEL, TRAIN), None))[0]
    finally:
        ckpt.close()


def _metrics_lines(run_dir, at_least):
    path = run_dir / "metrics.jsonl"
    return path.exists() and len(path.read_text().splitlines()) >= at_least


def _until(condition, procs, timeout=300):
    start = time.monotonic()
    while not condition():
        assert all(p.poll() is None for p in procs), [output(p)[-2000:] for p in procs]
        assert time.monotonic() - start < timeout
        time.sleep(0.1)


STEPS = 16  # micro: checkpoints every 4 steps


@pytest.mark.slow  # three two-process runs (~40 s each on 2 cores)
def test_sigterm_to_one_process_stops_both_then_resumes_bit_identically(tmp_path):
    flags = ["--steps", STEPS]
    ends, logs = _wait(_launch(tmp_path, flags, name="whole"), timeout=400)
    whole = read_records(tmp_path / "whole" / "metrics.jsonl")
    assert [r["step"] for r in whole] == list(range(1, STEPS + 1)), logs

    procs = _launch(tmp_path, flags, name="cut")
    _until(lambda: _metrics_lines(tmp_path / "cut", 2), procs)
    sent = time.monotonic()
    procs[1].send_signal(signal.SIGTERM)  # the process that is not the coordinator
    ends, logs = _wait(procs, timeout=120, since=sent)
    assert [p.returncode for p in procs] == [0, 0], logs
    records = read_records(tmp_path / "cut" / "metrics.jsonl")
    stop = records[-1]["step"]
    assert stop < STEPS, logs
    assert finished_steps(tmp_path / "cut" / "checkpoints")[-1] == stop  # saved once, by both
    assert f"stopped by SIGTERM on process 1: checkpoint of step {stop} saved" in output(procs[0])
    print(f"SIGTERM to process 1: stopped after step {stop}; exits {ends} s after the signal")

    procs = _launch(tmp_path, flags, name="cut")
    ends, logs = _wait(procs, timeout=400)
    assert [p.returncode for p in procs] == [0, 0], logs
    assert f"resumed from checkpoint step {stop} " in output(procs[0])
    resumed = read_records(tmp_path / "cut" / "metrics.jsonl")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]  # bit for bit
    assert [r["expert_counts"] for r in resumed] == [r["expert_counts"] for r in whole]
    # Parameters, Adam moments, step and counters: bit for bit.
    assert_trees_equal(
        _final_state(tmp_path / "whole", STEPS), _final_state(tmp_path / "cut", STEPS)
    )


@pytest.mark.slow  # a two-process run to its second checkpoint, then a resume (~90 s on 2 cores)
@pytest.mark.parametrize(
    "victim, how",
    [(0, signal.SIGKILL), (1, signal.SIGKILL), (1, signal.SIGSTOP)],
    ids=["kill-coordinator", "kill-other", "stop-other"],
)
def test_a_lost_process_ends_the_other_in_one_line_then_resumes(tmp_path, victim, how):
    timeout_s = 5
    flags = ["--steps", 400, "--checkpoint-every", 2, "--peer-timeout", timeout_s]
    procs = _launch(tmp_path, flags)
    ckpts = tmp_path / "run" / "checkpoints"
    _until(lambda: len(finished_steps(ckpts)) >= 2, procs)
    newest = finished_steps(ckpts)[-1]
    sent = time.monotonic()
    procs[victim].send_signal(how)
    survivor = procs[1 - victim]
    try:
        (end,), logs = _wait([survivor], timeout=60, since=sent)
    finally:
        procs[victim].kill()  # a stopped process too
        procs[victim].wait()
    assert survivor.returncode == _distributed.EXIT_PEER_LOST, logs
    bound = 3 if victim == 0 else timeout_s + 3  # the coordinator's loss is seen at once
    assert end < bound, logs
    time.sleep(1)  # the filter writes its line as the survivor ends
    errors = _errors(survivor)
    who = "process 0 (the coordinator) is gone" if victim == 0 else "process 1 is gone"
    assert len(errors) == 1 and errors[0].startswith(f"error: {who}"), logs
    # The newest checkpoint when the line was written: the one at the kill, or one after it.
    step = int(errors[0].split("resume from step ")[1].split(" ")[0])
    assert step >= newest and step in finished_steps(ckpts), errors
    text = output(survivor)
    assert "Check failure" not in text and "Terminating process" not in text, logs
    assert "Traceback" not in text, logs
    name = signal.Signals(how).name
    print(
        f"{name} to process {victim}: the other exited {end:.2f} s later (rc {survivor.returncode})"
    )

    # As the line says: every process again, the same flags (two steps more), from that step.
    procs = _launch(tmp_path, [*flags, "--stop-at", step + 2])
    _, logs = _wait(procs, timeout=400)
    assert [p.returncode for p in procs] == [0, 0], logs
    assert f"resumed from checkpoint step {step} " in output(procs[0])
    assert read_records(tmp_path / "run" / "metrics.jsonl")[-1]["step"] == step + 2
