"""The placement cost model's hardware figures, measured on the mesh a run trains on.

`moejax.placement` ships datasheet figures for H100 and TPU v5p. A controller deciding for the
machine it runs on should use that machine's figures: on 8 simulated CPU devices sharing two
cores a matmul is ~10^5x slower than on an H100 while a device-to-device copy is a memory copy,
so the balance between compute, all-to-all and replica sync, which is all the controller
weighs, is nothing like a GPU's. `measure_hardware` times, on every device of the mesh at once
(as in a training step), one expert-shaped matmul (`T·K` rows of `D x F`) and one all-to-all of
those rows over the `expert` axis, and returns a `HardwareModel` of the medians.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from moejax.parallel import mesh as mesh_lib
from moejax.placement import HardwareModel, Workload


def _median_s(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_hardware(mesh, workload: Workload, *, repeats: int = 5) -> HardwareModel:
    """Per-device FLOP/s and all-to-all bytes/s of `mesh`, timed on `workload`'s shapes.

    Args:
      mesh: a `moejax.parallel` mesh with an `expert` axis of at least 2 devices.
      workload: the layer shape (`T·K` rows, `D`, `F`, activation bytes).
      repeats: timed runs after one warm-up; the medians are used.

    Returns:
      `HardwareModel("measured", flops_per_s, link_bytes_per_s)` (one flat network).

    Raises:
      ValueError: the mesh has no `expert` axis of >= 2 devices.
    """
    n = mesh_lib.axis_size(mesh, mesh_lib.EXPERT)
    if n < 2:
        raise ValueError(f"measuring the all-to-all needs an expert axis of >= 2, got {n}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    axes = tuple(mesh.axis_names)
    shards = int(np.prod([mesh.shape[a] for a in axes]))
    rows = max(n, workload.rows_per_step // n * n)  # [R] per device, a multiple of N
    dtype = {2: jnp.bfloat16, 4: jnp.float32}.get(workload.activation_bytes, jnp.float32)
    d, f = workload.d_model, workload.d_ff
    key = jax.random.key(0)
    x = jax.random.normal(key, (shards * rows, d), dtype)
    w = jax.random.normal(key, (d, f), dtype) / np.sqrt(d)
    spec = PartitionSpec(axes)

    matmul = jax.jit(
        jax.shard_map(
            lambda x, w: x @ w, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=spec
        )
    )

    def exchange(x):  # [R, D] -> [N, R / N, D], swapped over the expert axis
        x = x.reshape(n, rows // n, d)
        return jax.lax.all_to_all(x, mesh_lib.EXPERT, 0, 0, tiled=True).reshape(rows, d)

    all_to_all = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=spec, out_specs=spec))
    flops = 2.0 * rows * d * f
    sent = rows * d * workload.activation_bytes * (n - 1) / n
    return HardwareModel(
        "measured",
        flops_per_s=flops / _median_s(matmul, x, w, repeats=repeats),
        link_bytes_per_s=sent / _median_s(all_to_all, x, repeats=repeats),
    )
