"""A 2-process run (2 x 4 simulated CPU devices, jax.distributed on 127.0.0.1) of the
expert-parallel layer equals the single-process 8-device result, outputs and gradients."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from _common import DROPLESS, STRATEGY_2P, inputs, make_params, sharded

from moejax.testing import assert_close

WORKER = os.path.join(os.path.dirname(__file__), "_two_process_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # ~70 s on the shared 2-core machine: two jax processes, gloo, 2 compiles
def test_two_processes_match_single_process(tmp_path):
    out = tmp_path / "result.npz"
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(port), str(i), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n\n".join(logs)[-4000:]
    got = dict(np.load(out))

    (loss, (y, aux)), grads = sharded(DROPLESS, "e8", STRATEGY_2P, "ragged_dot")(
        make_params(DROPLESS), inputs()
    )
    expected = {"loss": loss, "y": y, "counts": aux.expert_counts, "grads": grads}
    flat = {
        jax.tree_util.keystr(p): np.asarray(v)
        for p, v in jax.tree_util.tree_flatten_with_path(expected)[0]
    }
    assert sorted(flat) == sorted(got)
    np.testing.assert_array_equal(got.pop("['counts']"), flat.pop("['counts']"))
    assert_close(got, flat, np.float32)
