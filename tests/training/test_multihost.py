"""train_lm.py under jax.distributed: 2 processes x 4 simulated CPU devices on 127.0.0.1 form
one 8-device mesh, and train exactly like one process with 8 devices; their checkpoints carry a
checksum of every array, verified on resume."""

import dataclasses
import json
import os
import shutil
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
from _helpers import MODEL, TRAIN, cli, corpus, finished_steps, free_port, mesh, output, popen

from moejax.training import Checkpointer, abstract_state, state_shardings, train
from moejax.training.checkpoint import restore_target
from moejax.training.metrics import read_records

HERE = os.path.dirname(os.path.abspath(__file__))

STEPS = 3


def test_two_processes_train_like_one(tmp_path):
    run_dir = tmp_path / "two"
    port = free_port()
    flags = [
        "--steps",
        STEPS,
        "--out",
        run_dir,
        "--no-outputs",
        "--eval-batches",
        0,
        "--num-processes",
        2,
        "--coordinator",
        f"127.0.0.1:{port}",
    ]
    procs = [
        # Without the shared compilation cache: each process compiles its own executables (a
        # suite run once hung at shutdown with two processes sharing the cache directory).
        popen(
            cli(*flags, "--process-id", i, "--jax-cache", "none"),
            tmp_path / f"p{i}.log",
            devices=4,
            compilation_cache=False,
        )
        for i in range(2)
    ]
    try:
        for p in procs:
            p.wait(timeout=400)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n\n".join(f"--- process {i}:\n{output(p)[-3000:]}" for i, p in enumerate(procs))
    assert all(p.returncode == 0 for p in procs), logs
    two = read_records(run_dir / "metrics.jsonl")  # written by process 0 only
    assert finished_steps(run_dir / "checkpoints") == [STEPS]  # saved by both processes

    one = train(
        MODEL,
        TRAIN.replace(steps=STEPS, eval_batches=0),
        corpus(),
        run_dir=str(tmp_path / "one"),
        mesh=mesh(),
        progress=False,
        outputs=False,
    ).records
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
    assert [r["expert_counts"] for r in two] == [r["expert_counts"] for r in one]
    # The same math, its collectives now crossing a process boundary (gloo sums in another
    # order): equal to the last ulp or two, not bit for bit.
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-6)


def _two_processes(tmp_path, *args, name, worker="_checkpoint_two_processes.py"):
    """Run `worker` as processes 0 and 1 (argv: port, process id, `args`, output path); their
    JSON results."""
    port = free_port()
    worker = os.path.join(HERE, worker)
    outs = [tmp_path / f"{name}{i}.json" for i in range(2)]
    procs = [
        popen(
            [sys.executable, worker, str(port), str(i), *map(str, args), str(outs[i])],
            tmp_path / f"{name}{i}.log",
            devices=4,
            compilation_cache=False,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        for p in procs:
            p.wait(timeout=400)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n\n".join(f"--- process {i}:\n{output(p)[-3000:]}" for i, p in enumerate(procs))
    assert all(p.returncode == 0 for p in procs), logs
    return [json.loads(o.read_text()) for o in outs]


def _rewrite_one_weight(ckpts, step, name):
    """Rewrite checkpoint `step`'s state through orbax (here, one process) with one weight
    changed, keeping its metadata and checksums: damage orbax reads back without complaint."""
    args = ocp.args
    target = restore_target(abstract_state(MODEL, TRAIN), state_shardings(MODEL, TRAIN, mesh()))
    raw = ocp.CheckpointManager(str(ckpts), item_names=("state", "meta", "checksums"))
    items = raw.restore(
        step,
        args=args.Composite(
            state=args.StandardRestore(dataclasses.asdict(target)),
            meta=args.JsonRestore(),
            checksums=args.JsonRestore(),
        ),
    )
    experts = items["state"]["params"]["layers"][1]["moe"]["experts"]
    assert name == "params.layers[1].moe.experts.w_up"
    experts["w_up"] = experts["w_up"].at[3, 5, 7].add(1e-3)
    shutil.rmtree(ckpts / str(step))
    raw.reload()
    raw.save(step, args=args.Composite(state=args.StandardSave(items["state"]),
                                       meta=args.JsonSave(items["meta"]),
                                       checksums=args.JsonSave(items["checksums"])))  # fmt: skip
    raw.wait_until_finished()
    raw.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_two_process_checkpoint_is_verified_on_resume(tmp_path):
    ckpts = tmp_path / "checkpoints"
    saved = _two_processes(tmp_path, "save", ckpts, name="save")
    # The expert weights span both processes' devices: no process has a host copy of them.
    assert "params.layers[1].moe.experts.w_up" in saved[0]["spans_processes"]
    sums = json.loads((ckpts / "4" / "checksums" / "metadata").read_text())
    assert sums["algorithm"] == "fmixsum64"
    assert len(sums["arrays"]) > 10 and None not in sums["arrays"].values()

    # One process with 8 devices verifies what two processes wrote: the same checksums.
    target = restore_target(abstract_state(MODEL, TRAIN), state_shardings(MODEL, TRAIN, mesh()))
    ck = Checkpointer(str(ckpts), MODEL, TRAIN)
    ck.restore(4, target)
    ck.close()

    name = "params.layers[1].moe.experts.w_up"
    _rewrite_one_weight(ckpts, 4, name)
    resumed = _two_processes(tmp_path, "resume", ckpts, name="resume")
    for r in resumed:  # both processes detect it and restore checkpoint 2
        assert r["step"] == 2 and r["verified"] and r["is_step_2"], r
        assert r["lines"] == [
            f"skipped checkpoint {ckpts}/4: array {name} fails its checksum; moved aside to "
            "4.corrupt"
        ]
    assert sorted(os.listdir(ckpts)) == ["2", "4.corrupt"]


def test_two_processes_apply_process_0s_placement_decisions(tmp_path):
    run_dir = tmp_path / "run"
    got = _two_processes(tmp_path, run_dir, name="placement", worker="_placement_two_processes.py")
    zero, one = got
    # Process 1's own controller would accept nothing; process 0's re-places several times.
    assert one["warmup_steps"] == 10**9 and zero["warmup_steps"] == 0
    assert zero["summary"]["replacements"] >= 2 and len(zero["events"]) >= 2
    # Both applied the same re-placements, logged the same checks, end on the same tables and
    # report the same summary (wall times aside: each process's own).
    for key in ("events", "checks", "tables", "summary", "step"):
        assert zero[key] == one[key], key
    # Each process timed the hardware; both got process 0's figures.
    assert zero["measured"] == one["measured"] and zero["measured"]["name"] == "measured"
    # What process 0 wrote is what both applied.
    written = [json.loads(line) for line in (run_dir / "placement_events.jsonl").open()]
    assert [(e["layer"], e["old"], e["new"], e["applied_after_step"]) for e in written] == [
        (e["layer"], e["old"], e["new"], e["applied_after_step"]) for e in one["events"]
    ]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_one_process_checkpoint_is_verified_by_two_processes(tmp_path):
    """CRC-32s written by one process, checked by two: each array spanning them is gathered."""
    from _checkpoint_two_processes import DATA, at

    from moejax.training import init_train_state

    ckpts = tmp_path / "checkpoints"
    state = init_train_state(MODEL, TRAIN, mesh())
    ck = Checkpointer(str(ckpts), MODEL, TRAIN)
    for step in (2, 4):
        ck.save(at(state, step), data_state=DATA, placements=[], mesh=mesh())
    ck.close()
    assert json.loads((ckpts / "4" / "checksums" / "metadata").read_text())["algorithm"] == "crc32"
    name = "params.layers[1].moe.experts.w_up"
    _rewrite_one_weight(ckpts, 4, name)
    for r in _two_processes(tmp_path, "resume", ckpts, name="resume"):
        assert r["step"] == 2 and r["verified"] and r["is_step_2"], r
        assert r["lines"] == [
            f"skipped checkpoint {ckpts}/4: array {name} fails its checksum; moved aside to "
            "4.corrupt"
        ]
