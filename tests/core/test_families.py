"""Each model family's routing and layer output equal its published reference implementation.

The references are numpy transcriptions (`_hf_reference.py`, sources cited there) that take the
parameters in the published layout, so each test also checks how a checkpoint's tensors map onto
the moejax tree (gate/up order, GPT-OSS's interleaving, transposes). When torch and transformers
are importable, `test_matches_transformers_module` also runs the real Hugging Face modules and
checks both the transcription and moejax against them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import _hf_reference as hf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax import presets
from moejax.testing import assert_close, random_params

B, S = 2, 16
SIZES = dict(d_model=16, d_ff=24, num_experts=8, block_size=8)


@dataclasses.dataclass(frozen=True)
class Family:
    config: moejax.MoEConfig
    to_published: Callable  # moejax params -> published state dict
    block: Callable  # (state dict, x [B, S, D]) -> (y, routing dict)
    sorted_choice: bool = True  # the published top-k returns experts best first


FAMILIES = {
    "mixtral": Family(
        presets.mixtral(**SIZES), hf.to_hf_mixtral, functools.partial(hf.mixtral_block, top_k=2)
    ),
    "qwen3_moe": Family(
        presets.qwen3_moe(**SIZES, top_k=3),
        hf.to_hf_mixtral,
        functools.partial(hf.mixtral_block, top_k=3, norm_topk_prob=True),
    ),
    "olmoe": Family(
        presets.olmoe(**SIZES, top_k=3),
        hf.to_hf_mixtral,
        functools.partial(hf.mixtral_block, top_k=3, norm_topk_prob=False),
    ),
    "qwen2_moe": Family(
        presets.qwen2_moe(**SIZES, top_k=2, shared_d_ff=8),
        hf.to_hf_qwen2_moe,
        functools.partial(hf.qwen2_moe_block, top_k=2, norm_topk_prob=False),
    ),
    "deepseek_v2": Family(
        presets.deepseek_v2(**SIZES, top_k=3, routed_scaling_factor=2.0),
        hf.to_hf_deepseek_v2,
        functools.partial(hf.deepseek_v2_block, top_k=3, scaling=2.0),
        sorted_choice=False,  # DeepseekV2TopkRouter uses topk(sorted=False)
    ),
    "deepseek_v3": Family(
        presets.deepseek_v3(**SIZES, top_k=3, num_groups=4, topk_groups=2),
        hf.to_hf_deepseek_v3,
        functools.partial(
            hf.deepseek_v3_block,
            top_k=3,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            scaling=2.5,
        ),
        sorted_choice=False,  # DeepseekV3TopkRouter uses topk(sorted=False)
    ),
    "minimax_m2": Family(
        presets.minimax_m2(**SIZES, top_k=3),
        hf.to_hf_minimax_m2,
        functools.partial(hf.minimax_m2_block, top_k=3),
        sorted_choice=False,  # MiniMaxM2TopKRouter uses topk(sorted=False)
    ),
    "gpt_oss": Family(
        presets.gpt_oss(**SIZES, top_k=2, swiglu_limit=1.0),
        hf.to_hf_gpt_oss,
        functools.partial(hf.gpt_oss_block, top_k=2, limit=1.0, alpha=1.702),
    ),
    "switch": Family(
        presets.switch(**SIZES, expert_capacity=2),
        hf.to_hf_switch,
        functools.partial(hf.switch_block, expert_capacity=2),
    ),
    "tokens_choose_top2_capacity": Family(
        presets.mixtral(**SIZES, norm_topk_prob=False, drop_policy="capacity", expert_capacity=3),
        hf.to_flaxformer,
        functools.partial(hf.tokens_choose_block, num_selected_experts=2, expert_capacity=3),
    ),
    "expert_choice": Family(
        presets.expert_choice(**SIZES, expert_capacity=3),
        hf.to_flaxformer,
        functools.partial(hf.experts_choose_block, expert_capacity=3),
    ),
}


def make_params(cfg):
    return random_params(cfg, seed=0)  # non-zero biases: every bias path is exercised


def inputs():
    return jnp.asarray(np.random.default_rng(1).normal(size=(B, S, SIZES["d_model"])), jnp.float32)


@functools.cache
def published(name):
    """The published block's output and routing on this test's parameters and inputs."""
    fam = FAMILIES[name]
    params = make_params(fam.config)
    return fam.block(fam.to_published(params), np.asarray(inputs(), np.float64))


@functools.partial(jax.jit, static_argnames=("config", "implementation"))
def _apply(params, x, config, implementation):
    return moejax.moe_apply(params, x, config, implementation=implementation)


def _by_expert(index, weight):
    """Sort each token's (expert, weight) pairs by expert id (for unordered top-k)."""
    order = np.argsort(index, axis=-1)
    return np.take_along_axis(index, order, -1), np.take_along_axis(weight, order, -1)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_published_block(name):
    # "blocked" is what "auto" runs on CPU; test_layer shows every implementation equals the
    # reference for these router families, forward and gradients.
    fam = FAMILIES[name]
    y, aux = _apply(make_params(fam.config), inputs(), fam.config, "blocked")
    y_pub, routing = published(name)
    assert_close(y, y_pub, jnp.float32)
    if "logits" in routing:
        assert_close(aux.router_logits, routing["logits"], jnp.float32)
    index, weight = np.asarray(aux.topk_indices), np.asarray(aux.topk_weights)
    if name == "expert_choice":  # slot e of token t is expert e, kept iff e chose t
        kept = np.asarray(aux.kept_counts)
        np.testing.assert_array_equal(kept, routing["kept"].sum(0))
        np.testing.assert_array_equal(weight > 0, routing["kept"])
        assert_close(weight, routing["weight"], jnp.float32)
        return
    pub_index, pub_weight = routing["index"], routing["weight"]
    if not fam.sorted_choice:
        index, weight = _by_expert(index, weight)
        pub_index, pub_weight = _by_expert(pub_index, pub_weight)
    np.testing.assert_array_equal(index, pub_index)
    dropped = routing.get("dropped", np.zeros(pub_index.shape, bool))
    np.testing.assert_array_equal(aux.dropped_mask, dropped)
    assert float(aux.dropped_fraction) == pytest.approx(dropped.mean())
    # moejax zeroes the weight of a dropped assignment; the published routers keep it but never
    # use it (the token is not dispatched).
    assert_close(weight, np.where(dropped, 0.0, pub_weight), jnp.float32)


def test_test_data_exercise_every_published_feature():
    """Guards against hollow comparisons: each feature changes the result on this data."""
    x = np.asarray(inputs(), np.float64).reshape(B * S, -1)

    # DeepSeek-V3: the correction bias and the group limit each change some token's experts.
    fam = FAMILIES["deepseek_v3"]
    sd = fam.to_published(make_params(fam.config))
    kw = dict(top_k=3, n_group=4, topk_group=2, norm_topk_prob=True, scaling=2.5)

    def experts(state, **changes):
        return np.sort(hf.deepseek_v3_router(state, x, **{**kw, **changes})[2], axis=-1)

    unbiased = {**sd, "gate.e_score_correction_bias": 0 * sd["gate.e_score_correction_bias"]}
    assert (experts(unbiased) != experts(sd)).any()
    assert (experts(sd, topk_group=4) != experts(sd)).any()  # all groups kept = no limit

    # MiniMax-M2: the correction bias (no groups) changes some token's experts.
    fam = FAMILIES["minimax_m2"]
    sd = fam.to_published(make_params(fam.config))
    unbiased = {**sd, "e_score_correction_bias": 0 * sd["e_score_correction_bias"]}
    choice = [np.sort(hf.minimax_m2_router(s, x, top_k=3)[2], axis=-1) for s in (sd, unbiased)]
    assert (choice[0] != choice[1]).any()

    # GPT-OSS: both clamps are active on some pre-activations.
    p = make_params(FAMILIES["gpt_oss"].config)["experts"]
    gate = np.einsum("td,edf->etf", x, p["w_gate"]) + np.asarray(p["b_gate"])[:, None]
    up = np.einsum("td,edf->etf", x, p["w_up"]) + np.asarray(p["b_up"])[:, None]
    assert (gate > 1.0).any() and (np.abs(up) > 1.0).any()

    # Capacity routers drop some assignments and keep others; expert choice leaves some tokens
    # to no expert and gives some several.
    for name in ("switch", "tokens_choose_top2_capacity"):
        dropped = published(name)[1]["dropped"]
        assert dropped.any() and not dropped.all(), name
    per_token = published("expert_choice")[1]["kept"].sum(1)
    assert (per_token == 0).any() and (per_token > 1).any()


def test_losses_match_published_definitions():
    fam = FAMILIES["mixtral"]
    _, aux = _apply(make_params(fam.config), inputs(), fam.config, "blocked")
    logits = np.asarray(aux.router_logits, np.float64)
    # Mixtral's load_balancing_loss_func counts T*K assignments over T rows: K times moejax's.
    expected = hf.load_balancing_loss_mixtral(logits, 8, top_k=2)
    np.testing.assert_allclose(2 * float(aux.load_balance_loss), expected, rtol=1e-5)
    z = hf.router_z_loss(logits.reshape(B, S, -1))
    np.testing.assert_allclose(float(aux.z_loss), z, rtol=1e-5)
    # Switch averages f * P per sequence: equal to moejax's for one sequence.
    cfg = FAMILIES["switch"].config
    _, aux = _apply(make_params(cfg), inputs()[:1], cfg, "blocked")
    probs = hf.softmax(np.asarray(aux.router_logits, np.float64))[None]
    expected = hf.load_balancing_loss_switch(probs, np.asarray(aux.topk_indices).T)
    np.testing.assert_allclose(float(aux.load_balance_loss), expected, rtol=1e-5)


@pytest.mark.parametrize("activation", ["gelu", "geglu"])
def test_gelu_is_the_tanh_approximation(activation):
    from moejax._experts import activate

    cfg = presets.mixtral(**SIZES, activation=activation)
    gate = np.linspace(-4.0, 4.0, 33)
    up = np.cos(gate)
    got = activate(jnp.asarray(gate), jnp.asarray(up), cfg)
    expected = hf.gelu_new(up) if activation == "gelu" else hf.gelu_new(gate) * up
    assert_close(got, expected, jnp.float32)


# ---------------------------------------------------------------------------------------------
# The real Hugging Face modules (only where torch and transformers are installed)


def _transformers_module(name):
    transformers = pytest.importorskip("transformers")
    sizes = dict(hidden_size=16, num_experts_per_tok=FAMILIES[name].config.top_k)
    if name == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as cls

        cfg = transformers.MixtralConfig(
            **sizes, intermediate_size=24, num_local_experts=8, router_jitter_noise=0.0
        )
    elif name == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as cls

        cfg = transformers.Qwen3MoeConfig(
            **sizes, moe_intermediate_size=24, num_experts=8, norm_topk_prob=True
        )
    elif name == "olmoe":
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as cls

        cfg = transformers.OlmoeConfig(
            **sizes, intermediate_size=24, num_experts=8, norm_topk_prob=False
        )
    elif name == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as cls

        cfg = transformers.Qwen2MoeConfig(
            **sizes,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=8,
            num_experts=8,
            norm_topk_prob=False,
        )
    elif name == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as cls

        cfg = transformers.DeepseekV3Config(
            **sizes,
            moe_intermediate_size=24,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
    elif name == "minimax_m2":
        from transformers.models.minimax_m2.modeling_minimax_m2 import (
            MiniMaxM2SparseMoeBlock as cls,
        )

        cfg = transformers.MiniMaxM2Config(
            **sizes, intermediate_size=24, num_local_experts=8, router_jitter_noise=0.0
        )
    elif name == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as cls

        cfg = transformers.GptOssConfig(
            **sizes, intermediate_size=24, num_local_experts=8, swiglu_limit=1.0
        )
    elif name == "switch":
        from transformers.models.switch_transformers.modeling_switch_transformers import (
            SwitchTransformersSparseMLP as cls,
        )

        cfg = transformers.SwitchTransformersConfig(
            d_model=16, d_ff=24, num_experts=8, expert_capacity=2, router_jitter_noise=0.0
        )
    else:
        raise KeyError(name)
    return cls(cfg).eval()


TRANSFORMERS_FAMILIES = [
    "deepseek_v3", "gpt_oss", "minimax_m2", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"
]  # fmt: skip


@pytest.mark.parametrize("name", [*TRANSFORMERS_FAMILIES, "switch"])
def test_matches_transformers_module(name):
    torch = pytest.importorskip("torch")
    module = _transformers_module(name)
    fam = FAMILIES[name]
    params = make_params(fam.config)
    state = {k: torch.tensor(v, dtype=torch.float32) for k, v in fam.to_published(params).items()}
    module.load_state_dict(state, strict=True)
    x = np.asarray(inputs())
    with torch.no_grad():
        out = module(torch.tensor(x))
    y_torch = (out[0] if isinstance(out, tuple) else out).numpy()
    y_pub, _ = published(name)
    assert_close(y_pub, y_torch, jnp.float32, err_msg="transcription vs transformers")
    y, _ = _apply(params, jnp.asarray(x), fam.config, "blocked")
    assert_close(y, y_torch, jnp.float32, err_msg="moejax vs transformers")
