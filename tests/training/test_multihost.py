"""train_lm.py under jax.distributed: 2 processes x 4 simulated CPU devices on 127.0.0.1 form
one 8-device mesh, and train exactly like one process with 8 devices."""

import numpy as np
from _helpers import MODEL, TRAIN, cli, corpus, finished_steps, free_port, mesh, output, popen

from moejax.training import train
from moejax.training.metrics import read_records

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
