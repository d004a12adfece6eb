"""One of two processes (4 simulated CPU devices each) saving or resuming micro checkpoints of
one 8-device mesh with `Checkpointer`. Launched by `test_multihost.py`:
argv = port, process id, "save" or "resume", checkpoint directory, output JSON path.

save: checkpoints 2 and 4 of the micro state (its parameters shifted by the step, so that they
differ). resume: `restore_latest` as a resumed run calls it; writes the step restored, the lines
it logged, and whether the state is checkpoint 2's bit for bit (by its checksums)."""

import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _helpers import MODEL, TRAIN, mesh  # noqa: E402

from moejax.training import (  # noqa: E402
    Checkpointer,
    abstract_state,
    init_train_state,
    state_shardings,
)
from moejax.training.checkpoint import restore_target  # noqa: E402
from moejax.training.checksums import state_checksums  # noqa: E402

DATA = {"seed": 0, "epoch": 0, "position": 0}


def at(state, step):
    params = jax.tree.map(lambda x: x + float(step), state.params)
    step = jax.device_put(jnp.asarray(step, jnp.int32), state.step.sharding)  # global
    return dataclasses.replace(state, step=step, params=params)


def main(port, process_id, mode, directory, out):
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id)
    )
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    m = mesh()
    state = init_train_state(MODEL, TRAIN, m)
    result = {"process": jax.process_index()}
    if mode == "save":
        ck = Checkpointer(directory, MODEL, TRAIN)
        for step in (2, 4):
            ck.save(at(state, step), data_state=DATA, placements=[], mesh=m)
        ck.close()
        result["spans_processes"] = sorted(
            name
            for name, x in zip(
                state_checksums(state.__dict__), jax.tree.leaves(state.__dict__), strict=True
            )
            if not x.is_fully_addressable
        )
    else:
        target = restore_target(abstract_state(MODEL, TRAIN), state_shardings(MODEL, TRAIN, m))
        ck = Checkpointer(directory, MODEL, TRAIN)
        lines = []
        restored = ck.restore_latest(target, log=lines.append)
        ck.close()
        result.update(
            step=restored.step,
            verified=restored.verified,
            lines=lines,
            is_step_2=state_checksums(restored.state.__dict__)
            == state_checksums(at(state, 2).__dict__),
        )
    with open(out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:6])
