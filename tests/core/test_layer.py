"""Every implementation equals the per-expert loop reference, forward and gradients, for every
router family, activation and drop policy; adversarial routing; fp32 and bf16."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax import presets
from moejax.testing import assert_close, force_routing, kernels_run, random_params

SIZES = dict(d_model=16, d_ff=24, num_experts=8, block_size=8)
CONFIGS = {
    "mixtral": presets.mixtral(**SIZES),
    "olmoe_no_norm": presets.olmoe(**SIZES, top_k=3),
    "qwen2_shared_gate": presets.qwen2_moe(**SIZES, top_k=2, shared_d_ff=8),
    "deepseek_v3": presets.deepseek_v3(**SIZES, top_k=3, num_groups=4, topk_groups=2),
    "gpt_oss": presets.gpt_oss(**SIZES, top_k=2, swiglu_limit=1.5),
    "switch": presets.switch(**SIZES, capacity_factor=1.0),
    "switch_absolute": presets.switch(**SIZES, expert_capacity=3),
    "capacity_top2": presets.mixtral(**SIZES, drop_policy="capacity", capacity_factor=0.75),
    "expert_choice": presets.expert_choice(**SIZES, top_k=2),
    "geglu": presets.mixtral(**SIZES, activation="geglu"),
    "gelu_bias": presets.mixtral(**SIZES, activation="gelu", expert_bias=True),
    "relu_shared": presets.mixtral(**SIZES, activation="relu", num_shared_experts=2),
}
IMPLS = ["ragged_dot", "blocked", "pallas"]
# Pallas runs in interpret mode on CPU: ~2x the compile time of the XLA paths. The default run
# keeps one config per router kind plus capacity mode; the rest run with `-m slow`.
PALLAS_DEFAULT = {"mixtral", "deepseek_v3", "gpt_oss", "switch", "expert_choice"}


def impl_params(names, pallas_default=PALLAS_DEFAULT):
    """`(name, impl)` pairs, pallas outside `pallas_default` marked slow."""
    return [
        pytest.param(
            name,
            impl,
            id=f"{name}-{impl}",
            marks=[pytest.mark.slow] if impl == "pallas" and name not in pallas_default else [],
        )
        for name in names
        for impl in IMPLS
    ]


def make_params(cfg, key=0):
    return random_params(cfg, seed=key)  # non-zero biases: every bias path is exercised


def inputs(key=1, b=2, s=16, d=16, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(key).normal(size=(b, s, d)), dtype)


@functools.partial(jax.jit, static_argnames=("config", "implementation"))
def apply(params, x, config, implementation):
    """`moejax.moe_apply`, jitted: eager dispatch of its ops costs more than one compile."""
    return moejax.moe_apply(params, x, config, implementation=implementation)


def loss_fn(impl, cfg):
    def f(params, x):
        y, aux = moejax.moe_apply(params, x, cfg, implementation=impl)
        # A non-symmetric loss so every output element's gradient differs.
        w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
        loss = jnp.sum(y.astype(jnp.float32) * w) + 0.1 * aux.load_balance_loss
        return loss + 0.01 * aux.z_loss, (y, aux)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


@functools.cache
def reference_result(name):
    """Loss, output, aux and gradients of the reference, computed once per config."""
    cfg = CONFIGS[name]
    return loss_fn("reference", cfg)(make_params(cfg), inputs())


@pytest.mark.parametrize("name,impl", impl_params(sorted(CONFIGS)))
def test_forward_and_grads_match_reference(name, impl):
    cfg = CONFIGS[name]
    (loss, (y, aux)), grads = loss_fn(impl, cfg)(make_params(cfg), inputs())
    (loss_ref, (y_ref, aux_ref)), grads_ref = reference_result(name)
    assert_close(y, y_ref)
    assert_close(aux, aux_ref)
    assert_close(loss, loss_ref)
    assert_close(grads, grads_ref)
    if impl == "pallas":  # the interpreted Pallas kernels computed the experts, not a fallback
        calls = set(kernels_run(loss_fn(impl, cfg), make_params(cfg), inputs(), platform="cpu"))
        assert calls == {"gmm/interpret", "gmm_t/interpret", "tgmm/interpret"}, calls
    # Every parameter gets a gradient (except the correction bias, which routing only selects on).
    for path, g in jax.tree_util.tree_flatten_with_path(grads[0])[0]:
        if "score_correction_bias" not in jax.tree_util.keystr(path):
            assert np.abs(np.asarray(g)).max() > 0, jax.tree_util.keystr(path)


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_on_one_expert_drop_nothing(impl, top_k):
    cfg = presets.mixtral(**SIZES, top_k=top_k)
    params = force_routing(make_params(cfg), expert=5)
    x = jnp.abs(inputs())
    y, aux = apply(params, x, cfg, implementation=impl)
    y_ref, _ = apply(params, x, cfg, implementation="reference")
    counts = np.asarray(aux.expert_counts)
    assert counts[5] == 32 and counts.sum() == 32 * top_k
    assert float(aux.dropped_fraction) == 0.0 and not bool(aux.dropped_mask.any())
    assert (counts == 0).sum() == 8 - top_k  # empty experts
    assert_close(y, y_ref)
    g = jax.jit(jax.grad(lambda p: apply(p, x, cfg, implementation=impl)[0].sum()))(params)
    g_ref = jax.jit(jax.grad(lambda p: apply(p, x, cfg, implementation="reference")[0].sum()))(
        params
    )
    assert_close(g, g_ref)
    # Empty experts get exactly zero weight gradient.
    empty = np.flatnonzero(counts == 0)
    assert np.all(np.asarray(g["experts"]["w_up"])[empty] == 0)


def _one_token_case():
    e, d = SIZES["num_experts"], SIZES["d_model"]
    cfg = presets.mixtral(**SIZES, top_k=1)
    # Logits = 30 * one_hot(i): features 0..E-1 of token i are e_i, the router reads only them.
    kernel = np.zeros((d, e), np.float32)
    kernel[np.arange(e), np.arange(e)] = 30.0
    params = {**make_params(cfg), "router": {"kernel": jnp.asarray(kernel)}}
    x = jnp.concatenate([jnp.eye(e), inputs(s=e)[0, :, e:]], axis=1)  # [T = E, D]
    return cfg, params, x


@functools.cache
def _one_token_reference():
    cfg, params, x = _one_token_case()
    return loss_fn("reference", cfg)(params, x)


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_one_token_per_expert(impl):
    """E tokens, token i routed to expert i alone: every group holds exactly one row."""
    e = SIZES["num_experts"]
    cfg, params, x = _one_token_case()
    (_, (y, aux)), grads = loss_fn(impl, cfg)(params, x)
    (_, (y_ref, _)), grads_ref = _one_token_reference()
    np.testing.assert_array_equal(aux.topk_indices[:, 0], np.arange(e))
    np.testing.assert_array_equal(aux.expert_counts, np.ones(e))
    np.testing.assert_array_equal(aux.kept_counts, np.ones(e))
    assert_close(y, y_ref)
    assert_close(grads, grads_ref)
    # Every expert computed one row, so every expert's weights get a gradient.
    assert np.all(np.abs(np.asarray(grads[0]["experts"]["w_down"])).max(axis=(1, 2)) > 0)


def test_capacity_mode_reports_exactly_the_dropped_assignments():
    cfg = presets.switch(**SIZES, expert_capacity=2)
    params = force_routing(make_params(cfg), expert=3)
    x = jnp.abs(inputs(s=5))  # every token wants expert 3; each sequence keeps its first two
    y, aux = apply(params, x, cfg, implementation="blocked")
    dropped = np.asarray(aux.dropped_mask).reshape(2, 5)
    np.testing.assert_array_equal(dropped, [[0, 0, 1, 1, 1]] * 2)
    assert float(aux.dropped_fraction) == pytest.approx(0.6)
    assert np.all(np.asarray(y)[:, 2:] == 0)  # dropped tokens output zero (Switch)
    assert np.all(np.abs(np.asarray(y)[:, :2]) > 0)


@pytest.mark.parametrize(
    "name,impl", impl_params(["mixtral", "deepseek_v3", "gpt_oss"], pallas_default={"mixtral"})
)
def test_bf16_matches_fp32_reference(name, impl):
    cfg = CONFIGS[name].replace(param_dtype="bfloat16")
    if name == "gpt_oss":
        # The clamp's derivative jumps at +-limit: with limit 1.5 a few pre-activations sit within
        # bf16 rounding of it and legitimately flip sides. The fp32 test covers limit 1.5.
        cfg = cfg.replace(swiglu_limit=7.0)
    params = make_params(cfg)
    x = inputs(dtype=jnp.bfloat16)
    y, aux = apply(params, x, cfg, implementation=impl)
    assert y.dtype == jnp.bfloat16 and aux.router_logits.dtype == jnp.float32
    params32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    y_ref, aux_ref = apply(params32, x.astype(jnp.float32), cfg, implementation="reference")
    # The router runs in fp32 from the same bf16-representable inputs: identical choices.
    np.testing.assert_array_equal(aux.topk_indices, aux_ref.topk_indices)
    assert_close(y, y_ref, jnp.bfloat16)
    grads = loss_fn(impl, cfg)(params, x)[1]
    grads_ref = loss_fn("reference", cfg)(params32, x.astype(jnp.float32))[1]
    # Gradients sum over T*K rows in bf16: compared at bf16 tolerance on the largest entry.
    assert_close(grads, grads_ref, jnp.bfloat16)


def test_one_expert_equals_dense_mlp():
    cfg = moejax.MoEConfig(d_model=16, d_ff=24, num_experts=1, top_k=1)
    params, x = make_params(cfg), inputs()
    e = params["experts"]
    dense = (jax.nn.silu(x @ e["w_gate"][0]) * (x @ e["w_up"][0])) @ e["w_down"][0]
    for impl in ["reference", *IMPLS]:
        assert_close(apply(params, x, cfg, implementation=impl)[0], dense)


@pytest.mark.parametrize("impl", IMPLS)
def test_dropless_equals_capacity_mode_with_capacity_at_least_tokens(impl):
    cfg = CONFIGS["mixtral"]
    params, x = make_params(cfg), inputs()
    y, aux = moejax.moe_apply(params, x, cfg, implementation=impl)
    big = cfg.replace(drop_policy="capacity", expert_capacity=16)  # = tokens per sequence
    y_cap, aux_cap = moejax.moe_apply(params, x, big, implementation=impl)
    np.testing.assert_array_equal(y, y_cap)
    assert float(aux_cap.dropped_fraction) == 0.0


def test_sequence_axis_counts_capacity_per_sequence():
    cfg = presets.switch(**SIZES, expert_capacity=2)
    params = force_routing(make_params(cfg), expert=0)
    x = jnp.abs(inputs(b=3, s=4))
    _, aux = apply(params, x, cfg, implementation="blocked")
    assert int(aux.kept_counts[0]) == 3 * 2  # two per sequence, not two in all
    _, aux_flat = apply(params, x.reshape(12, 16), cfg, implementation="blocked")
    assert int(aux_flat.kept_counts[0]) == 2


def test_expert_choice_each_expert_takes_capacity_tokens():
    cfg = CONFIGS["expert_choice"]  # capacity = ceil(1.0 * 16 * 2 / 8) = 4 per sequence
    params, x = make_params(cfg), inputs()
    _, aux = apply(params, x, cfg, implementation="blocked")
    np.testing.assert_array_equal(aux.kept_counts, np.full(8, 2 * 4))
    assert aux.topk_indices.shape == (32, 8)


def test_auto_is_decided_by_the_compile_target_not_the_host():
    """One traced program: lowered for CPU it runs the XLA blocked loop, for GPU the Triton
    kernels, for TPU the Mosaic kernels (forward gmm, backward gmm_t and tgmm)."""
    cfg = CONFIGS["mixtral"]
    step, args = loss_fn("auto", cfg), (make_params(cfg), inputs())
    assert kernels_run(step, *args, platform="cpu") == []
    for platform, backend in (("cuda", "triton"), ("tpu", "mosaic")):
        calls = kernels_run(step, *args, platform=platform)
        assert sorted(set(calls)) == [f"{k}/{backend}" for k in ("gmm", "gmm_t", "tgmm")]
        assert len(calls) == 9  # gate, up, down projections: one of each kernel
    # "pallas" differs from "auto" only off accelerators.
    assert kernels_run(loss_fn("pallas", cfg), *args, platform="tpu") == calls


def test_implementation_switch_rejects_unknown_and_auto_is_blocked_on_cpu():
    assert moejax.resolve_implementation("auto", "cpu") == "blocked"
    assert moejax.resolve_implementation("auto", "gpu") == "pallas"
    assert moejax.resolve_implementation("auto", "tpu") == "pallas"
    with pytest.raises(ValueError, match="implementation='fast'"):
        moejax.resolve_implementation("fast")


def test_wrong_input_width_raises():
    cfg = CONFIGS["mixtral"]
    with pytest.raises(ValueError, match="d_model=16"):
        moejax.moe_apply(make_params(cfg), jnp.ones((4, 8)), cfg)
