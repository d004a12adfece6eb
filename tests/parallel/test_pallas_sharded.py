"""`implementation="pallas"` under `moe_apply_sharded`: the Pallas kernels (interpreted on CPU)
run inside `shard_map(check_vma=True)` on meshes with `data`, `expert` and `model` axes, forward
and backward, and equal the single-device layer (one LM train step with them on the 2 x 4 mesh:
tests/training/test_step.py).

Before the kernels' VJP matched its cotangents' varying axes to its primals', every mesh with a
`data` or `model` axis failed to trace here ("Custom VJP bwd rule must produce an output with
the same type ...")."""

import collections

import pytest
from _common import CAPACITY, DROPLESS, SHARED, inputs, make_params, sharded, single_device

from moejax.parallel import Strategy
from moejax.testing import assert_close, kernels_run

CASES = [
    ("d2e4", DROPLESS, Strategy(dispatcher="dropless", bucket=3)),
    ("d2e2m2", DROPLESS, Strategy(dispatcher="dropless", chunks=2)),
    ("d1e8", DROPLESS, Strategy(dispatcher="dropless")),
    ("d2e4", CAPACITY, Strategy(dispatcher="capacity")),
    ("d2e2m2", SHARED, Strategy(dispatcher="allgather")),
    ("d2e2m2", DROPLESS, Strategy(mode="data")),
    ("d2e2m2", DROPLESS, Strategy(mode="tensor")),
]


@pytest.mark.parametrize(("mesh_name", "cfg", "strategy"), CASES, ids=lambda c: str(c)[:40])
def test_pallas_sharded_matches_single_device(mesh_name, cfg, strategy):
    params, x = make_params(cfg), inputs()
    step = sharded(cfg, mesh_name, strategy, "pallas")
    (_, (y, aux)), g = step(params, x)
    (_, (y0, aux0)), g0 = single_device(cfg, "ragged_dot")(params, x)
    assert_close(y, y0, err_msg="y")
    assert_close(aux, aux0, err_msg="aux")
    assert_close(g, g0, err_msg="grad")
    # The kernels ran: each of the three expert projections (gate, up, down) has its gmm, and in
    # the backward its gmm_t and tgmm (dispatchers that loop in rounds may recompute the
    # forward), and nothing else computed the expert FFN.
    calls = collections.Counter(kernels_run(step, params, x, platform="cpu"))
    assert set(calls) == {"gmm/interpret", "gmm_t/interpret", "tgmm/interpret"}, calls
    assert calls["gmm_t/interpret"] == calls["tgmm/interpret"] >= 3, calls
    assert calls["gmm/interpret"] >= 3, calls


def test_pallas_layer_compiles_for_gpu_and_tpu_with_the_real_kernels():
    """The same sharded program, lowered for cuda and tpu: Triton and Mosaic calls, no other."""
    cfg, strategy = DROPLESS, Strategy(dispatcher="dropless", bucket=3)
    step = sharded(cfg, "d2e4", strategy, "auto")
    args = (make_params(cfg), inputs())
    assert kernels_run(step, *args, platform="cpu") == []  # "auto" on CPU: the blocked XLA path
    for platform, backend in (("cuda", "triton"), ("tpu", "mosaic")):
        calls = set(kernels_run(step, *args, platform=platform))
        assert calls == {f"{k}/{backend}" for k in ("gmm", "gmm_t", "tgmm")}, platform
