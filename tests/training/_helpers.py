"""Shared pieces of the training tests: the micro run, subprocess launching, comparisons."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np

from moejax import data, parallel
from moejax.models import presets
from moejax.training import presets as train_presets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = presets.get("micro")
TRAIN = train_presets.get("micro")  # 8 steps, batch 8 x 16, checkpoint every 4
CORPUS_BYTES = 200_000


def corpus():
    return data.default_corpus(max_bytes=CORPUS_BYTES)


def mesh(shape=(2, 4)):
    return parallel.make_mesh(shape, ("data", "expert"))


def cli(*args):
    """Argument list of a train_lm run (`python -m moejax.cli.train_lm`) of the micro preset
    (quiet, small corpus)."""
    base = ["--preset", "micro", "--max-bytes", str(CORPUS_BYTES), "--no-progress"]
    return [sys.executable, "-m", "moejax.cli.train_lm", *base, *map(str, args)]


def env(devices=8, compilation_cache=True):
    out = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        # As tests/conftest.py sets it: the same programs, so compilation-cache hits.
        "JAX_DEFAULT_MATMUL_PRECISION": "highest",
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    if not compilation_cache:
        out.pop("JAX_COMPILATION_CACHE_DIR", None)
        out["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return out


def popen(args, log_path, devices=8, compilation_cache=True):
    """Start a subprocess writing stdout and stderr to `log_path` (a file, never a pipe: an
    unread pipe that fills up blocks the child, and with jax.distributed the whole group)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            args, env=env(devices, compilation_cache), stdout=log, stderr=subprocess.STDOUT
        )
    proc.log_path = log_path
    return proc


def output(proc) -> str:
    """Everything the subprocess has written so far."""
    with open(proc.log_path) as f:
        return f.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finished_steps(ckpt_dir) -> list[int]:
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())


def host_tree(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_trees_equal(a, b):
    """Bit-for-bit equality of two pytrees of arrays."""
    la, ta = jax.tree.flatten(host_tree(a))
    lb, tb = jax.tree.flatten(host_tree(b))
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)
