"""Every dispatcher x mode x pipeline degree equals the single-device layer, forward (y and aux)
and gradients (wrt x and every parameter), on every mesh shape and axis subset."""

import pytest
from _common import (
    CAPACITY,
    DROPLESS,
    SHARED,
    SIZES,
    inputs,
    make_params,
    sharded,
    single_device,
)

from moejax import presets
from moejax.parallel import PIPELINE_DEGREES, Strategy
from moejax.testing import assert_close

EXPERT_DISPATCHERS = ("dropless", "allgather")
# The full product on the mesh with both an expert and a model axis (4 x 2): tokens split 4 ways,
# 16 local tokens, so 8 chunks hold 2 tokens each.
FULL_PRODUCT = [
    Strategy(mode="expert", dispatcher=d, chunks=c)
    for d in EXPERT_DISPATCHERS
    for c in PIPELINE_DEGREES
] + [Strategy(mode=m, chunks=c) for m in ("data", "tensor") for c in PIPELINE_DEGREES]
# Other meshes and axis subsets: each mode and dispatcher at least once, small buckets (rounds).
OTHER_MESHES = [
    ("e8", Strategy(dispatcher="dropless", bucket=2, chunks=2)),
    ("e8", Strategy(mode="tensor", chunks=1)),
    ("d2e4", Strategy(mode="data")),
    ("d1e8", Strategy(dispatcher="dropless", bucket=1)),
    ("d2e2m2", Strategy(dispatcher="dropless", bucket=3, chunks=2)),
    ("d2e2m2", Strategy(mode="tensor", chunks=2)),
    ("d8", Strategy(dispatcher="dropless")),
    ("m8", Strategy(dispatcher="dropless")),
    ("d4m2", Strategy(mode="data")),
]


def _check(cfg, mesh_name, strategy, implementation, stagger=False):
    params, x = make_params(cfg), inputs()
    (_, (y0, aux0)), g0 = single_device(cfg, implementation)(params, x)
    (_, (y, aux)), g = sharded(cfg, mesh_name, strategy, implementation, stagger)(params, x)
    assert_close(y, y0, err_msg="y")
    assert_close(aux, aux0, err_msg="aux")
    assert_close(g, g0, err_msg="grad")
    return aux0


@pytest.mark.parametrize("strategy", FULL_PRODUCT, ids=str)
def test_full_product_matches_single_device(strategy):
    _check(DROPLESS, "e4m2", strategy, "ragged_dot")


@pytest.mark.parametrize(("mesh_name", "strategy"), OTHER_MESHES, ids=str)
def test_meshes_match_single_device(mesh_name, strategy):
    _check(DROPLESS, mesh_name, strategy, "ragged_dot")


@pytest.mark.parametrize("chunks", PIPELINE_DEGREES)
def test_capacity_all_to_all_matches_and_reports_drops(chunks):
    """GShard buffers with capacity routing: the same drops as one device, reported in aux."""
    aux = _check(CAPACITY, "d2e4", Strategy(dispatcher="capacity", chunks=chunks), "ragged_dot")
    assert int(aux.num_dropped) > 0  # capacity_factor 0.75 must drop, or the test is hollow


@pytest.mark.parametrize(
    ("mesh_name", "strategy"),
    [
        ("e4m2", Strategy(dispatcher="capacity", chunks=2)),
        ("d2e2m2", Strategy(dispatcher="dropless", chunks=2)),
        ("e8", Strategy(mode="data")),
        ("e8", Strategy(mode="tensor", chunks=2)),
    ],
    ids=str,
)
def test_capacity_routing_other_dispatchers_blocked(mesh_name, strategy):
    _check(CAPACITY, mesh_name, strategy, "blocked")


@pytest.mark.parametrize(
    ("mesh_name", "strategy"),
    [("d2e2m2", Strategy(dispatcher="dropless")), ("e4m2", Strategy(mode="tensor", chunks=2))],
    ids=str,
)
def test_shared_experts_and_blocked(mesh_name, strategy):
    _check(SHARED, mesh_name, strategy, "blocked")


@pytest.mark.parametrize(
    ("cfg", "strategy"),
    [
        (CAPACITY, Strategy(dispatcher="capacity", chunks=4)),
        (DROPLESS, Strategy(chunks=1)),
        (DROPLESS, Strategy(chunks=2)),
        (DROPLESS, Strategy(chunks=4)),
        # 2 local tokens per chunk, 1 row per pair and round: several leftover rounds per chunk.
        (DROPLESS, Strategy(chunks=4, bucket=4)),
    ],
    ids=["capacity_staged", "dropless_1", "dropless_2", "dropless_4", "dropless_4_rounds"],
)
def test_staggered_pipelines_match_single_device(cfg, strategy):
    """Staged pipelines (optimization barriers between chunks' stages) change the schedule only."""
    _check(cfg, "d2e4", strategy, "ragged_dot", stagger=True)


@pytest.mark.parametrize(
    ("cfg", "strategy"),
    [
        (presets.expert_choice(**SIZES, top_k=2), Strategy(dispatcher="capacity", chunks=2)),
        (
            presets.deepseek_v3(
                **SIZES, top_k=3, num_groups=4, topk_groups=2, score_correction_bias=True
            ),
            Strategy(dispatcher="dropless", bucket=2),
        ),
    ],
    ids=["expert_choice", "deepseek_v3"],
)
def test_other_routers_match_single_device(cfg, strategy):
    """Expert choice (capacity per sequence, K = E slots) and group-limited sigmoid routing."""
    _check(cfg, "d2e4", strategy, "ragged_dot")
