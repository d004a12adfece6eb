"""Subprocess of `test_hf_stream.py`: load a checkpoint onto an 8-device mesh and print the host
memory figures (bytes) as JSON: RSS before, the peak while loading, RSS after, and what the
placed arrays hold.

  python _stream_load_rss.py <checkpoint dir> <mesh axes, e.g. fsdp=2,expert=4>
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

from moejax import parallel  # noqa: E402
from moejax.interop.hf import load_hf_model  # noqa: E402


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def main():
    path, mesh_text = sys.argv[1], sys.argv[2]
    names, sizes = zip(*(p.split("=") for p in mesh_text.split(",")), strict=True)
    mesh = parallel.make_mesh(tuple(int(s) for s in sizes), names)
    jax.device_put(jax.numpy.zeros(8), jax.sharding.NamedSharding(mesh, jax.P()))  # warm up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
    before = _status("VmRSS")
    cfg, params, _ = load_hf_model(path, mesh=mesh)
    jax.block_until_ready(params)
    peak, after = _status("VmHWM"), _status("VmRSS")
    placed = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
    print(json.dumps({"before": before, "peak": peak, "after": after, "placed": placed}))


if __name__ == "__main__":
    main()
