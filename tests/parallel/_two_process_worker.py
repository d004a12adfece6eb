"""One of two processes (4 simulated CPU devices each) running the expert-parallel layer on one
8-device mesh. Launched by `test_multiprocess.py`: argv = port, process id, output .npz path."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _common import DROPLESS, STRATEGY_2P, inputs, make_params, sharded  # noqa: E402


def main(port: str, process_id: str, out: str) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id)
    )
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    fn = sharded(DROPLESS, "e8", STRATEGY_2P, "ragged_dot")
    (loss, (y, aux)), grads = fn(make_params(DROPLESS), inputs())
    result = multihost_utils.process_allgather(
        {"loss": loss, "y": y, "counts": aux.expert_counts, "grads": grads}, tiled=True
    )
    if jax.process_index() == 0:
        flat = {
            jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(result)[0]
        }
        np.savez(out, **flat)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
