"""The GPU/TPU branch of the dropless exchange (`ragged_all_to_all`), run on CPU.

XLA:CPU cannot compile `ragged-all-to-all`, so the CPU layer runs the padded branch. Here the
ragged branch is forced on CPU with `jax.lax.ragged_all_to_all` replaced by an emulation made of
all-gathers (its documented semantics, checked on the documentation's own example), so its
offsets and sizes, forward and backward, round 0 and the leftover rounds, are checked against the
single-device layer with the routings that stress them.
"""

import importlib.util
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import DROPLESS, inputs, make_params, sharded, single_device
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import PartitionSpec as P

from moejax import parallel
from moejax.parallel import Strategy, dispatch_dropless
from moejax.testing import assert_close, force_routing


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all` from all-gathers: source `s` writes its slice
    `operand[input_offsets[me] : + send_sizes[me]]` at `output_offsets[me]` of this device's
    `output`. The result is NaN unless `recv_sizes` matches what the sources send (the op's
    contract)."""
    gather = lambda a: jax.lax.all_gather(a, axis_name)  # noqa: E731  [N, ...] by source
    ops, starts, sizes, at = map(gather, (operand, input_offsets, send_sizes, output_offsets))
    me = jax.lax.axis_index(axis_name)
    j = jnp.arange(output.shape[0])
    result = output
    for s in range(ops.shape[0]):
        k = j - at[s, me]
        inside = (k >= 0) & (k < sizes[s, me])
        rows = jnp.take(ops[s], starts[s, me] + k, axis=0, mode="clip")
        result = jnp.where(inside[:, None], rows, result)
    ok = jnp.all(recv_sizes == sizes[:, me])
    return jnp.where(ok, result, jnp.nan)


def test_emulation_follows_the_documented_example():
    """The example of `jax.lax.ragged_all_to_all`'s docstring, axis of size 2."""
    mesh = parallel.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
    args = [
        [[1, 2, 2], [3, 4, 0]],  # operand
        [[0] * 4, [0] * 4],  # output
        [[0, 1], [0, 1]],  # input_offsets
        [[1, 2], [1, 1]],  # send_sizes
        [[0, 0], [1, 2]],  # output_offsets
        [[1, 1], [2, 1]],  # recv_sizes
    ]
    args = [
        jnp.asarray(a, jnp.float32 if i < 2 else jnp.int32).reshape(-1) for i, a in enumerate(args)
    ]

    def body(operand, output, *rest):
        return emulated_ragged_all_to_all(
            operand[:, None], output[:, None], *rest, axis_name="expert"
        )

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert"), check_vma=True
    )
    out = np.asarray(jax.jit(f)(*args)).reshape(2, 4)
    np.testing.assert_array_equal(out, [[1, 3, 0, 0], [2, 2, 4, 0]])


@pytest.fixture
def ragged_on_cpu(monkeypatch):
    """The dropless exchange takes its ragged branch on CPU, through the emulation."""
    monkeypatch.setattr(
        dispatch_dropless, "_RAGGED_PLATFORMS", (*dispatch_dropless._RAGGED_PLATFORMS, "cpu")
    )
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)


def _params(kind):
    params = make_params(DROPLESS)
    return force_routing(params, 0) if kind == "all_on_one" else params


@pytest.mark.parametrize(
    ("kind", "mesh_name", "strategy"),
    [
        ("all_on_one", "e8", Strategy(bucket=2)),  # leftover rounds up to 4 (8 rows per pair)
        ("all_on_one", "d2e4", Strategy(bucket=4, chunks=2, stagger=True)),
        ("random", "e4m2", Strategy(bucket=2, chunks=4, stagger=True)),
        ("random", "d2e2m2", Strategy(chunks=2)),
    ],
    ids=str,
)
def test_ragged_branch_matches_single_device(ragged_on_cpu, kind, mesh_name, strategy):
    params, x = _params(kind), jnp.abs(inputs())
    (_, (y0, aux0)), g0 = single_device(DROPLESS, "ragged_dot")(params, x)
    strategy = strategy.replace(dispatcher="dropless", exchange="ragged")
    fn = sharded(DROPLESS, mesh_name, strategy, "ragged_dot")
    (_, (y, aux)), g = fn(params, x)
    assert int(aux.num_dropped) == 0
    assert_close(y, y0, err_msg="y")
    assert_close(aux, aux0, err_msg="aux")
    assert_close(g, g0, err_msg="grad")
    # The emulation (all-gathers) ran, not the padded exchange.
    text = fn.lower(params, x).as_text()
    assert "all_gather" in text or "all-gather" in text


def test_programs_here_are_not_served_from_the_persistent_cache(monkeypatch, tmp_path):
    """pytest imports tests/training/conftest.py in every worker of a full run; its persistent
    compilation cache must not reach this directory's programs. (With jaxlib 0.12.0.1 the
    `all_on_one-d2e4` program above, loaded back from that cache, gave NaN rows about one run in
    seven: collectives paired wrongly across the simulated devices.)"""
    for key in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        monkeypatch.delenv(key, raising=False)  # restored after the test
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the conftest's cache goes here
    path = pathlib.Path(__file__).parents[1] / "training" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_training_conftest", path)
    before = jax.config.jax_compilation_cache_dir
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))  # as collection does
        compilation_cache.reset_cache()  # whatever jax decided before, decide again
        jax.jit(lambda a: jnp.sin(a) * 3.25 + 0.5)(jnp.arange(7.0)).block_until_ready()
        assert jax.config.jax_compilation_cache_dir is None
        assert not any(tmp_path.rglob("*-cache")), sorted(tmp_path.rglob("*"))
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()
