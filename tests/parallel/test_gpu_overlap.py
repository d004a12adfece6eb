"""Structural overlap on the real XLA:GPU schedule, compiled deviceless on this CPU machine.

Needs the CUDA plugin wheels importable in a subprocess (`MOEJAX_CUDA_PLUGIN_PATH`, a directory
made with `pip install --no-deps --target DIR jax-cuda13-plugin==<jax> jax-cuda13-pjrt==<jax>`);
skips otherwise. XLA:CPU has only synchronous all-to-all, so this is the only overlap evidence
available without a GPU: staged pipelining puts expert GEMMs inside all-to-all windows; the
unstaggered split does not (DotMerger re-merges its matmuls after all dispatches).
"""

import json
import os
import subprocess
import sys

import pytest

PLUGIN = os.environ.get("MOEJAX_CUDA_PLUGIN_PATH", "")
SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding
import moejax
from moejax import parallel
from moejax.parallel import gpu_hlo
cfg = moejax.MoEConfig(d_model=512, d_ff=1024, num_experts=8, top_k=2, dispatch="capacity")
mesh = gpu_hlo.gpu_mesh((8,), ("expert",))
specs = parallel.param_partition_specs(cfg, mesh)
shapes = jax.eval_shape(lambda: moejax.init_moe_params(cfg, jax.random.key(0)))
params = jax.tree.map(lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype,
                      sharding=NamedSharding(mesh, p)), shapes, specs)
x = jax.ShapeDtypeStruct((64, 256, 512), jnp.float32,
                         sharding=NamedSharding(mesh, parallel.activation_spec(mesh, 3)))
out = {}
for chunks, stagger in [(4, True), (4, False)]:
    st = parallel.Strategy(dispatcher="capacity", chunks=chunks)
    f = jax.jit(lambda p, x: parallel.moe_apply_sharded(p, x, cfg, mesh, strategy=st,
                implementation="ragged_dot", stagger=stagger)[0])
    out[f"{chunks}-{stagger}"] = gpu_hlo.overlap(f.lower(params, x).compile().as_text())
print(json.dumps(out))
"""


@pytest.mark.slow  # two deviceless GPU compiles, ~30 s
@pytest.mark.skipif(
    not os.path.isdir(os.path.join(PLUGIN, "jax_plugins")),
    reason="set MOEJAX_CUDA_PLUGIN_PATH to a dir with jax-cuda13-plugin/pjrt (deviceless compile)",
)
def test_staged_pipeline_overlaps_gemms_with_all_to_all():
    env = {**os.environ, "PYTHONPATH": PLUGIN, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=400
    )
    assert res.returncode == 0, res.stderr[-3000:]
    windows = json.loads(res.stdout.strip().splitlines()[-1])
    staged, plain = windows["4-True"], windows["4-False"]
    assert len(staged) == len(plain) == 12  # 4 chunks x (counts, rows, return) all-to-alls
    # Staged: chunk i's expert GEMMs run inside chunk i+1's exchange windows.
    assert sum(n for _, n in staged) >= 3, staged
    # Negative control: the unstaggered split gets no GEMM inside any window.
    assert sum(n for _, n in plain) == 0, plain
