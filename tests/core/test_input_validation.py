"""Bad inputs to the layer API: each is one clear `TypeError`/`ValueError` naming the field or the
parameter path, raised before anything is traced, for `moe_apply`, the NNX and Linen modules and
`moe_apply_sharded`; an empty batch gives the same empty output and zero aux everywhere; valid
inputs of every kind (presets, bf16, placement's `[P, ...]` experts) pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moejax
import moejax.linen
from moejax import parallel, presets
from moejax._validate import check_params
from moejax.parallel import slots
from moejax.parallel.layer import physical_config
from moejax.placement import Placement

SIZES = dict(d_model=16, d_ff=32, num_experts=8, top_k=2, block_size=8)
CFG = moejax.MoEConfig(**SIZES)  # swiglu: w_gate, w_up, w_down
RELU = CFG.replace(activation="relu")
SHARED = CFG.replace(num_shared_experts=1, shared_d_ff=16)
SIGMOID = CFG.replace(router="sigmoid", score_correction_bias=True)
X = jnp.ones((2, 4, 16))
X8 = jnp.ones((8, 4, 16))  # B divides over the 2 x 4 mesh's token shards
# 8 experts on 4 expert devices, 3 slots each: P = 12 physical expert slots.
PLACEMENT = Placement(np.array([0, 5, 0, 1, 2, 5, 3, 4, 5, 6, 7, 1]), 8, 4, 3)


def _params(cfg=CFG):
    return moejax.init_moe_params(cfg, jax.random.key(0))


def _with(group, name, value, cfg=CFG):
    """CFG's params with `group/name` set to `value` (or removed when value is None)."""
    params = _params(cfg)
    params[group] = dict(params[group])
    if value is None:
        del params[group][name]
    else:
        params[group][name] = value
    return params


def _mesh():
    return parallel.make_mesh((2, 4), ("data", "expert"))


def _apply(params, x=X, cfg=CFG, **kw):
    return lambda: moejax.moe_apply(params, x, cfg, **kw)


def _sharded(params, x=X8, cfg=CFG, **kw):
    return lambda: parallel.moe_apply_sharded(params, x, cfg, _mesh(), **kw)


def _placed(experts_of):
    table = slots.slot_table(PLACEMENT)
    params = _params()
    params["experts"] = experts_of(params["experts"], table)
    return _sharded(params, slot_table=table)


def _nnx(x):
    return lambda: moejax.MoE(CFG, rngs=nnx.Rngs(0))(x)


def _linen(variables, x=X):
    return lambda: moejax.linen.MoE(CFG).apply(variables, x)


def _config(**changes):
    return lambda: moejax.MoEConfig(**{**SIZES, **changes})


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[], Callable[[], object]]  # builds the failing call (lazily: cheap collection)
    error: type[Exception]
    match: str  # a regex the message must contain: the field or path and what is expected


W_UP = "params\\['experts'\\]\\['w_up'\\]"
BAD_INPUTS = [
    # MoEConfig booleans must be booleans (a truthy string or int silently turned them on).
    Case("norm_topk_prob_str", lambda: _config(norm_topk_prob="no"), TypeError, "norm_topk_prob"),
    Case("router_bias_int", lambda: _config(router_bias=2), TypeError, "router_bias=2"),
    Case("expert_bias_none", lambda: _config(expert_bias=None), TypeError, "expert_bias=None"),
    Case(
        "shared_gate_str",
        lambda: _config(num_shared_experts=1, shared_gate="True"),
        TypeError,
        "shared_gate='True'",
    ),
    Case(
        "score_bias_int",
        lambda: _config(router="sigmoid", score_correction_bias=1),
        TypeError,
        "score_correction_bias=1",
    ),
    # The params tree against the config.
    Case("params_list", lambda: _apply([1, 2]), TypeError, "params must be a dict"),
    Case("params_none", lambda: _apply(None), TypeError, "params must be a dict"),
    Case(
        "group_not_dict",
        lambda: _apply({**_params(), "experts": [1]}),
        TypeError,
        "params\\['experts'\\] must be a dict",
    ),
    Case(
        "missing_router",
        lambda: _apply({"experts": _params()["experts"]}),
        ValueError,
        "params\\['router'\\] is missing",
    ),
    Case(
        "missing_kernel",
        lambda: _apply(_with("router", "kernel", None)),
        ValueError,
        "params\\['router'\\]\\['kernel'\\] is missing: this config needs \\[D, E\\] = \\(16, 8\\)",
    ),
    Case(
        "missing_w_gate",
        lambda: _apply(_with("experts", "w_gate", None)),
        ValueError,
        "'w_gate'\\] is missing: this config needs \\[E, D, F\\] = \\(8, 16, 32\\)",
    ),
    Case(
        "missing_shared",
        lambda: _apply(_params(), cfg=SHARED),
        ValueError,
        "params\\['shared'\\] is missing",
    ),
    Case(
        "missing_correction_bias",
        lambda: _apply(_params(), cfg=SIGMOID),
        ValueError,
        "'score_correction_bias'\\] is missing",
    ),
    Case(
        "w_up_wrong_experts",
        lambda: _apply(_with("experts", "w_up", jnp.ones((4, 16, 32)))),
        ValueError,
        W_UP + " has shape \\(4, 16, 32\\): this config needs \\[E, D, F\\] = \\(8, 16, 32\\)",
    ),
    Case(
        "w_down_transposed",
        lambda: _apply(_with("experts", "w_down", jnp.ones((8, 16, 32)))),
        ValueError,
        "'w_down'\\] has shape \\(8, 16, 32\\): this config needs \\[E, F, D\\] = \\(8, 32, 16\\)",
    ),
    Case(
        "router_transposed",
        lambda: _apply(_with("router", "kernel", jnp.ones((8, 16)))),
        ValueError,
        "'kernel'\\] has shape \\(8, 16\\): this config needs \\[D, E\\]",
    ),
    Case(
        "w_gate_unused_relu",
        lambda: _apply(_params(), cfg=RELU),
        ValueError,
        "'w_gate'\\]: not used by this config \\(activation='relu' has no gate\\)",
    ),
    Case(
        "router_bias_unused",
        lambda: _apply(_with("router", "bias", jnp.zeros(8))),
        ValueError,
        "'bias'\\]: not used by this config \\(router_bias=False\\)",
    ),
    Case(
        "expert_bias_unused",
        lambda: _apply(_with("experts", "b_up", jnp.zeros((8, 32)))),
        ValueError,
        "'b_up'\\]: not used by this config \\(expert_bias=False\\)",
    ),
    Case(
        "shared_unused",
        lambda: _apply(_params(SHARED)),
        ValueError,
        "params\\['shared'\\]: not used by this config \\(num_shared_experts=0\\)",
    ),
    Case(
        "unknown_group",
        lambda: _apply({**_params(), "extra": {}}),
        ValueError,
        "params\\['extra'\\]: unknown group",
    ),
    Case(
        "unknown_leaf",
        lambda: _apply(_with("experts", "w_in", jnp.ones((8, 16, 32)))),
        ValueError,
        "'w_in'\\]: unknown name",
    ),
    Case(
        "leaf_float",
        lambda: _apply(_with("router", "kernel", 1.0)),
        TypeError,
        "'kernel'\\] must be an array \\[D, E\\]",
    ),
    Case(
        "leaf_int",
        lambda: _apply(_with("experts", "w_up", jnp.ones((8, 16, 32), jnp.int32))),
        TypeError,
        W_UP + " has dtype int32: must be floating",
    ),
    # x: a floating array [..., D], rank >= 2.
    Case("x_int", lambda: _apply(_params(), X.astype(jnp.int32)), TypeError, "x has dtype int32"),
    Case("x_bool", lambda: _apply(_params(), X > 0), TypeError, "x has dtype bool"),
    Case("x_rank1", lambda: _apply(_params(), jnp.ones(16)), ValueError, "need rank >= 2"),
    Case("x_rank0", lambda: _apply(_params(), jnp.ones(())), ValueError, "need rank >= 2"),
    Case("x_list", lambda: _apply(_params(), [[0.0] * 16]), TypeError, "x must be an array"),
    Case("x_width", lambda: _apply(_params(), jnp.ones((4, 8))), ValueError, "d_model=16"),
    Case("implementation", lambda: _apply(_params(), implementation="fast"), ValueError, "'fast'"),
    # The modules run the same checks.
    Case("nnx_x_int", lambda: _nnx(jnp.ones((4, 16), jnp.int32)), TypeError, "x has dtype int32"),
    Case("nnx_x_rank1", lambda: _nnx(jnp.ones(16)), ValueError, "need rank >= 2"),
    Case(
        "linen_foreign_tree",
        lambda: _linen(moejax.linen.to_variables(_params(RELU))),
        ValueError,
        "'w_gate'\\] is missing",
    ),
    Case(
        "linen_x_rank1",
        lambda: _linen(moejax.linen.to_variables(_params()), jnp.ones(16)),
        ValueError,
        "need rank >= 2",
    ),
    # The sharded layer: the same checks (no tracing), plus the mesh's.
    Case(
        "sharded_w_up",
        lambda: _sharded(_with("experts", "w_up", jnp.ones((4, 16, 32)))),
        ValueError,
        W_UP + " has shape",
    ),
    Case(
        "sharded_unused",
        lambda: _sharded(_params(), cfg=RELU),
        ValueError,
        "activation='relu' has no gate",
    ),
    Case("sharded_x_int", lambda: _sharded(_params(), X8.astype(int)), TypeError, "x has dtype"),
    Case("sharded_x_rank1", lambda: _sharded(_params(), jnp.ones(16)), ValueError, "rank >= 2"),
    Case(
        "sharded_batch",
        lambda: _sharded(_params(), jnp.ones((6, 4, 16))),
        ValueError,
        "x.shape\\[0\\]=6: does not divide over the 8 token shards of the mesh "
        "\\(data=2 x expert=4\\)",
    ),
    Case(
        "sharded_reference",
        lambda: _sharded(_params(), implementation="reference"),
        ValueError,
        "implementation='reference'",
    ),
    Case(
        "sharded_strategy",
        lambda: _sharded(_params(), strategy="fast"),
        ValueError,
        "strategy='fast'",
    ),
    Case(
        "placed_logical_experts",
        lambda: _placed(lambda experts, table: experts),
        ValueError,
        W_UP + " has shape \\(8, 16, 32\\): this config needs \\[P, D, F\\] = \\(12, 16, 32\\)",
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.name for c in BAD_INPUTS])
def test_bad_input_is_one_clear_error(case):
    call = case.call()
    with pytest.raises(case.error, match=case.match):
        call()


def test_checks_run_before_tracing_and_cost_nothing_under_jit():
    """A jitted layer traces (and so validates) once; a bad tree fails at trace time, from our
    check, not from inside jax."""
    traces = []

    def f(params, x):
        traces.append(1)
        return moejax.moe_apply(params, x, CFG)[0]

    jitted = jax.jit(f)
    params = _params()
    for _ in range(3):
        jitted(params, X)
    assert len(traces) == 1
    with pytest.raises(ValueError, match="'w_up'\\] has shape"):
        jitted(_with("experts", "w_up", jnp.ones((4, 16, 32))), X)


@pytest.mark.parametrize("preset", sorted(presets.PRESETS))
def test_every_preset_tree_is_valid(preset):
    cfg = presets.PRESETS[preset](d_model=16, d_ff=32, num_experts=16)
    check_params(jax.eval_shape(lambda: moejax.init_moe_params(cfg, jax.random.key(0))), cfg)


def _empty_result(y, aux):
    assert y.shape == (0, 4, 16) and y.dtype == jnp.float32
    for name in ("router_logits", "topk_indices", "topk_weights", "dropped_mask"):
        assert getattr(aux, name).shape[0] == 0, name
    for name in ("expert_counts", "kept_counts", "routed_fraction", "mean_probs"):
        np.testing.assert_array_equal(getattr(aux, name), np.zeros(8), err_msg=name)
    for name in ("dropped_fraction", "load_balance_loss", "z_loss"):
        assert float(getattr(aux, name)) == 0.0, name
    return jax.tree.map(lambda a: (a.shape, a.dtype), aux)


EMPTY_CASES = {
    "dropless": CFG,
    "sigmoid_capacity": SIGMOID.replace(drop_policy="capacity"),
    "expert_choice": presets.expert_choice(**SIZES),
}


@pytest.mark.parametrize("cfg", EMPTY_CASES.values(), ids=EMPTY_CASES.keys())
def test_empty_batch_is_empty_output_and_zero_aux_everywhere(cfg):
    params, x = _params(cfg), jnp.ones((0, 4, 16))
    impls = ("reference", "ragged_dot", "blocked", "pallas", "auto")
    results = [moejax.moe_apply(params, x, cfg, implementation=i) for i in impls]
    sharded = parallel.shard_params(params, cfg, _mesh())
    results.append(parallel.moe_apply_sharded(sharded, x, cfg, _mesh()))
    results.append(moejax.linen.MoE(cfg).apply(moejax.linen.to_variables(params), x))
    results.append(jax.jit(lambda p, x: moejax.moe_apply(p, x, cfg))(params, x))
    shapes = [_empty_result(y, aux) for y, aux in results]
    assert all(s == shapes[0] for s in shapes)
    # The aux of a real batch has the same fields, dtypes and per-token widths.
    full = moejax.moe_apply(params, jnp.ones((1, 4, 16)), cfg)[1]
    assert jax.tree.map(lambda a: (a.shape[1:], a.dtype), full) == jax.tree.map(
        lambda s: (s[0][1:], s[1]), shapes[0], is_leaf=lambda s: isinstance(s, tuple)
    )


def test_valid_inputs_pass_bf16_numpy_and_placed_experts():
    cfg = CFG.replace(param_dtype="bfloat16")
    y, _ = moejax.moe_apply(_params(cfg), np.ones((3, 16), np.float32).astype(jnp.bfloat16), cfg)
    assert y.dtype == jnp.bfloat16
    table = slots.slot_table(PLACEMENT)
    params = _params()
    physical = {**params, "experts": slots.to_physical(params["experts"], table)}
    physical_cfg = physical_config(CFG, table)
    check_params(physical, CFG, experts_config=physical_cfg)
