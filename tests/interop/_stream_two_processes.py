"""Subprocess of `test_hf_stream.py`: one of 2 processes x 4 CPU devices (jax.distributed on
127.0.0.1) loading a checkpoint onto one 8-device `expert` mesh. Prints JSON: the experts
whose tensors this process read, and the experts its devices hold.

  python _stream_two_processes.py <checkpoint dir> <coordinator host:port> <process id>
"""

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402


def main():
    path, coordinator, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=pid)
    from moejax import parallel
    from moejax.interop.hf import SafetensorsCheckpoint, load_hf_model

    read = []
    original = SafetensorsCheckpoint.read

    def recording(self, name, shape=None, row=None):
        read.append(name)
        return original(self, name, shape, row)

    SafetensorsCheckpoint.read = recording
    mesh = parallel.make_mesh((8,), ("expert",))
    cfg, params, _ = load_hf_model(path, mesh=mesh)
    SafetensorsCheckpoint.read = original
    experts_read = sorted(
        {int(m.group(1)) for n in read if (m := re.search(r"experts\.(\d+)\.", n))}
    )
    leaf = params["layers"][0]["moe"]["experts"]["w_gate"]
    held = sorted(
        e for shard in leaf.addressable_shards for e in range(cfg.moe.num_experts)[shard.index[0]]
    )
    # this process's shards hold what a whole single-process read gives
    source = SafetensorsCheckpoint(path)
    for shard in leaf.addressable_shards:
        for k, e in enumerate(range(cfg.moe.num_experts)[shard.index[0]]):
            name = f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"
            want = source.read(name).T.astype(np.float32)
            np.testing.assert_array_equal(np.asarray(shard.data)[k], want)
    print(json.dumps({"read": experts_read, "held": held}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
