"""Per-layer MLP kinds (`LMConfig.mlp_layer_types`): dense and MoE layers at any positions, the
HF spellings read into them, and scanned runs of repeated units equal to a plain loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import moe_apply, parallel
from moejax.models import (
    LMConfig,
    attention,
    init_lm_params,
    lm_forward,
    mlp_layer_types_of,
    presets,
    rms_norm,
    rope_tables,
    swiglu_mlp,
)
from moejax.models._layer_runs import layer_runs
from moejax.models._patterns import ScanRun, scan_runs
from moejax.testing import assert_close

D, M = "dense", "moe"
# Dense width 48 differs from the expert width 32 (and from the default moe.d_ff * top_k = 64).
BASE = presets.get("micro").replace(dense_d_ff=48)
PATTERNS = {
    "dense_moe_moe": (D, M, M),
    "moe_dense_moe_dense": (M, D, M, D),
    "dense_then_3_moe": (D, M, M, M),
}


def _cfg(kinds) -> LMConfig:
    return BASE.replace(num_layers=len(kinds), mlp_layer_types=kinds)


def _tokens(seed=0, b=2, s=16):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (b, s)), jnp.int32)


def _loop_forward(params, tokens, cfg):
    """The reference: one block after the other, as written in `LMConfig`'s docstring."""
    cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta)
    x = params["embed"]["embedding"][tokens]
    counts = []
    for kind, layer in zip(cfg.mlp_kinds, params["layers"], strict=True):
        h = rms_norm(x, layer["attn_norm"]["scale"], cfg.norm_eps)
        x = x + attention(layer["attn"], h, cos, sin, implementation="xla")
        h = rms_norm(x, layer["ffn_norm"]["scale"], cfg.norm_eps)
        if kind == "moe":
            y, aux = moe_apply(layer["moe"], h, cfg.moe)
            counts.append(aux.expert_counts)
        else:
            y = swiglu_mlp(layer["mlp"], h)
        x = x + y
    x = rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps)
    return x @ params["unembed"]["kernel"], jnp.stack(counts)


def _top_scans(fn, *args) -> list[int]:
    """The lengths of the `scan`s at the top level of the traced program."""
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return [e.params["length"] for e in eqns if e.primitive.name == "scan"]


@pytest.mark.parametrize("name", PATTERNS)
def test_pattern_scanned_and_not_equal_the_loop(name):
    cfg = _cfg(PATTERNS[name])
    params = init_lm_params(cfg, jax.random.key(1))
    assert params["layers"][0][{D: "mlp", M: "moe"}[cfg.mlp_kinds[0]]]
    for i, kind in enumerate(cfg.mlp_kinds):
        if kind == D:
            assert params["layers"][i]["mlp"]["w_gate"].shape == (cfg.d_model, 48)
    tokens = _tokens()
    want, want_counts = jax.jit(functools.partial(_loop_forward, cfg=cfg))(params, tokens)
    scans = {}
    for scan in (False, True):
        fwd = functools.partial(lm_forward, cfg=cfg, scan_layers=scan)
        got, aux = jax.jit(fwd)(params, tokens)
        assert_close(got, want, err_msg=f"scan={scan}")
        np.testing.assert_array_equal(aux.expert_counts, want_counts)
        scans[scan] = _top_scans(fwd, params, tokens)
    # The MoE layers' own loops (the blocked implementation) sit at the top level when
    # unscanned; scanned, only those outside every run do, next to one scan per run.
    runs = layer_runs(cfg)
    per_moe = len(scans[False]) // cfg.num_moe_layers
    inside = {i for r in runs for i in range(r.start, r.start + r.unit * r.repeats)}
    outside = len([i for i in cfg.moe_layers if i not in inside])
    assert len(scans[True]) == len(runs) + per_moe * outside
    assert all(r.repeats in scans[True] for r in runs)


def test_scanned_gradients_equal_unscanned():
    cfg = _cfg(PATTERNS["dense_moe_moe"])
    params = init_lm_params(cfg, jax.random.key(2))
    tokens = _tokens(seed=1)

    def loss(params, scan):
        logits, aux = lm_forward(params, tokens, cfg, scan_layers=scan)
        return jnp.mean(logits**2) + 0.01 * aux.load_balance_loss.sum()

    g0 = jax.jit(jax.grad(functools.partial(loss, scan=False)))(params)
    g1 = jax.jit(jax.grad(functools.partial(loss, scan=True)))(params)
    assert_close(g1, g0)


def test_scan_runs():
    assert scan_runs((D, M, M)) == (ScanRun(1, 1, 2),)
    assert scan_runs((M, D, M, D)) == (ScanRun(0, 2, 2),)
    assert scan_runs((D, M, M, M)) == (ScanRun(1, 1, 3),)
    assert scan_runs((D,) * 3 + (M,) * 58) == (ScanRun(0, 1, 3), ScanRun(3, 1, 58))
    assert scan_runs((D, M, D, M, D)) == (ScanRun(0, 2, 2),)  # the last dense layer unscanned
    assert scan_runs((M,)) == ()
    # A moe_every pattern keeps its one run from layer 0, a single unit included.
    assert layer_runs(BASE.replace(num_layers=3, moe_every=2)) == (ScanRun(0, 2, 1),)


def test_hf_spellings():
    n = {"num_hidden_layers": 6}
    assert mlp_layer_types_of(n) == (M,) * 6
    assert mlp_layer_types_of(n | {"first_k_dense_replace": 3}) == (D,) * 3 + (M,) * 3
    assert mlp_layer_types_of(n | {"first_k_dense_replace": 1, "moe_layer_freq": 2}) == (
        (D, D, M, D, M, D)  # DeepSeek-V2: i >= k and i % freq == 0
    )
    assert mlp_layer_types_of(n | {"decoder_sparse_step": 2}) == (D, M) * 3  # (i + 1) % step
    assert mlp_layer_types_of(n | {"decoder_sparse_step": 1, "mlp_only_layers": [0, 5]}) == (
        (D, M, M, M, M, D)
    )
    types = ["dense", "sparse", "sparse", "dense", "sparse", "sparse"]
    assert mlp_layer_types_of(n | {"mlp_layer_types": types}) == (D, M, M, D, M, M)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"first_k_dense_replace": 7}, "first_k_dense_replace=7"),
        ({"mlp_layer_types": ["dense"] * 5}, "mlp_layer_types"),
        ({"mlp_layer_types": ["dense"] * 5 + ["hash"]}, r"\['hash'\]"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ({"moe_layer_freq": [1, 0]}, "moe_layer_freq"),
        ({"mlp_only_layers": [6]}, "mlp_only_layers"),
    ],
)
def test_hf_spellings_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        mlp_layer_types_of({"num_hidden_layers": 6} | fields)


def test_config_checks():
    assert _cfg([D, M]).mlp_layer_types == (D, M)  # a list is stored as a tuple (hashable)
    with pytest.raises(ValueError, match="one per layer"):
        BASE.replace(mlp_layer_types=(D, M, M))
    with pytest.raises(ValueError, match="mlp_layer_types"):
        BASE.replace(mlp_layer_types=(D, "sparse"))
    with pytest.raises(ValueError, match="moe_every"):
        BASE.replace(num_layers=2, moe_every=2, mlp_layer_types=(D, M))
    cfg = _cfg((D, M, M))
    assert cfg.moe_layers == (1, 2) and not cfg.is_moe(0) and cfg.num_moe_layers == 2


def test_sharded_placed_pattern_equals_single_device():
    """[dense, moe, moe] scanned on a 2 x 4 mesh with every MoE layer's experts re-placed
    (replicas, moved experts) computes the single-device model."""
    from moejax.placement import Placement
    from moejax.training import placed

    cfg = _cfg((D, M, M))
    mesh = parallel.make_mesh((2, 4), ("data", "expert"))
    params = init_lm_params(cfg, jax.random.key(3))
    tokens = _tokens(seed=2, b=8)
    want, want_aux = jax.jit(functools.partial(lm_forward, cfg=cfg))(params, tokens)
    rng = np.random.default_rng(0)
    layouts = []
    for _ in cfg.moe_layers:
        table = np.concatenate([np.arange(8), rng.integers(0, 8, 4)])
        rng.shuffle(table)
        layouts.append(Placement.identity(8, 4, 3).with_table(table))
    tables = placed.slot_tables(layouts)
    physical = placed.map_experts(
        params, cfg, lambda j, e: jax.tree.map(lambda w: w[layouts[j].slot_to_expert], e)
    )
    fwd = functools.partial(lm_forward, cfg=cfg, mesh=mesh, scan_layers=True)
    got, aux = jax.jit(fwd)(physical, tokens, slot_tables=tables)
    assert_close(got, want)
    np.testing.assert_array_equal(aux.expert_counts, want_aux.expert_counts)
