"""Structural overlap on the real XLA:GPU schedule, compiled deviceless on this CPU machine.

Needs the CUDA plugin wheels (`python -m pallas_kernels.targets --install`); skips otherwise.
XLA:CPU has only synchronous all-to-all, so this is the only overlap evidence available without
a GPU: staged pipelining puts expert GEMMs inside all-to-all windows; the unstaggered split does
not (DotMerger re-merges its matmuls after all dispatches).
"""

import jax
import jax.numpy as jnp
import pytest

import moejax
from moejax import aot, parallel
from pallas_kernels import targets

pytestmark = [
    pytest.mark.deviceless,
    # A deviceless executable cannot be loaded back from the persistent compilation cache the
    # training tests enable in this worker; jax warns and compiles anyway.
    pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry"),
    pytest.mark.skipif(targets.missing("cuda") is not None, reason=str(targets.missing("cuda"))),
]


def test_staged_pipeline_overlaps_gemms_with_all_to_all():
    cfg = moejax.MoEConfig(d_model=512, d_ff=1024, num_experts=8, top_k=2, drop_policy="capacity")
    mesh = aot.mesh("cuda", (8,), ("expert",))
    windows = {}
    for stagger in (True, False):
        strategy = parallel.Strategy(dispatcher="capacity", chunks=4)

        def fn(p, x, stagger=stagger, strategy=strategy):
            return parallel.moe_apply_sharded(
                p, x, cfg, mesh, strategy=strategy, implementation="ragged_dot", stagger=stagger
            )[0]

        _, (params, x) = aot.layer_program(cfg, mesh, strategy, tokens=64 * 256, seq_len=256)
        x = jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding)
        windows[stagger] = aot.windows.overlap(aot.compile_program(fn, (params, x)).text)
    staged, plain = windows[True], windows[False]
    assert len(staged) == len(plain) == 12  # 4 chunks x (counts, rows, return) all-to-alls
    # Staged: chunk i's expert GEMMs run inside chunk i+1's exchange windows.
    assert sum(n for _, n in staged) >= 3, staged
    # Negative control: the unstaggered split gets no GEMM inside any window.
    assert sum(n for _, n in plain) == 0, plain
