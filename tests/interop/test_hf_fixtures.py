"""moejax on real Hugging Face blocks: fixtures written by transformers (make_hf_fixtures.py, whose
small outputs are committed under fixtures/) are imported and run, without torch.

For each family: the config.json transformers wrote gives the `MoEConfig`; the block's tensors in
every layout transformers has (`per_expert` as `save_pretrained` writes it, `fused` as the module
holds it) import to the same parameters and export back bit for bit; the layer's output and the
gradients of `sum(y * cotangent)` with respect to `x` and every parameter match transformers' (fp32:
forward within 1e-5, gradients within 1e-4, relative to the largest magnitude of each tensor) and
the router's top-k choice is the same.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hf_cases import CONFIGS, load_reference

import moejax
from moejax.interop import hf

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
FUSED_PREFIX = "model.layers.0.mlp."
SWITCH_PREFIX = "encoder.block.1.layer.1.mlp."
FWD_RTOL, GRAD_RTOL = 1e-5, 1e-4
# Routers whose top-k transformers takes with `sorted=False` (DeepseekV2TopkRouter,
# DeepseekV3TopkRouter, Glm4MoeTopkRouter (GLM-4.7-Flash's too), MiniMaxM2TopKRouter): their
# choices compare as sets.
UNSORTED_TOPK = {"deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "minimax_m2"}


def prefix(family, layout):
    if family == "switch":
        return SWITCH_PREFIX
    return hf.block_prefix(family, 0, layout) if layout == "per_expert" else FUSED_PREFIX


CASES = [
    (family, layout)
    for family in FAMILIES
    for layout in hf.LAYOUTS
    if (FIXTURES / family / f"{layout}.safetensors").exists()
]


def read(path):
    with hf.SafetensorsCheckpoint(path) as ckpt:
        return {name: ckpt[name] for name in ckpt}


@functools.cache
def load(family, layout):
    cfg, name = hf.moe_config_from_hf(hf.read_config(FIXTURES / family))
    assert name == family
    with hf.SafetensorsCheckpoint(FIXTURES / family / f"{layout}.safetensors") as ckpt:
        assert hf.detect_layout(ckpt, family, prefix(family, layout)) == layout
        params = hf.block_from_hf(ckpt, cfg, family, prefix(family, layout))
    return cfg.replace(block_size=8), params


def test_fixtures_cover_every_family_and_layout():
    assert sorted(name for name, fam in hf.FAMILIES.items() if not fam.dense) == FAMILIES
    for family in FAMILIES:
        assert [layout for f, layout in CASES if f == family] == list(
            hf.FAMILIES[family].layouts
        ), family
    manifest = json.loads((FIXTURES / "MANIFEST.json").read_text())
    assert manifest["transformers"].startswith("5.")


@pytest.mark.parametrize("family,layout", CASES)
def test_export_gives_back_the_transformers_file_bit_for_bit(family, layout):
    cfg, params = load(family, layout)
    written = read(FIXTURES / family / f"{layout}.safetensors")
    again = hf.block_to_hf(params, cfg, family, prefix(family, layout), layout)
    assert sorted(again) == sorted(written)
    for name, value in written.items():
        assert again[name].dtype == value.dtype
        np.testing.assert_array_equal(again[name].view(np.uint32), value.view(np.uint32), name)


@pytest.mark.parametrize("family", [f for f in FAMILIES if len(hf.FAMILIES[f].layouts) == 2])
def test_both_layouts_import_to_the_same_parameters(family):
    _, fused = load(family, "fused")
    _, per_expert = load(family, "per_expert")
    jax.tree.map(np.testing.assert_array_equal, fused, per_expert)


def assert_rel(actual, expected, rtol, what):
    """max |actual - expected| <= rtol * max |expected|."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, what
    err = np.abs(actual - expected).max(initial=0.0)
    scale = np.abs(expected).max(initial=0.0)
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} * {scale:.3g}"


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def forward_and_grads(params, x, cotangent, cfg, implementation):
    def loss(params, x):
        y, aux = moejax.moe_apply(params, x, cfg, implementation=implementation)
        return jnp.sum(y * cotangent), (y, aux)

    (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, aux, grads


# "reference" compiles in about half the time of "blocked" (what "auto" runs on CPU);
# tests/core/test_layer.py shows every implementation equals it, forward and gradients.
IMPLEMENTATIONS = ["reference", pytest.param("blocked", marks=pytest.mark.slow)]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers_forward_gradients_and_choice(family, implementation):
    layout = "fused" if "fused" in hf.FAMILIES[family].layouts else "per_expert"
    cfg, params = load(family, layout)
    io = read(FIXTURES / family / "io.safetensors")
    y, aux, (dparams, dx) = forward_and_grads(params, io["x"], io["cotangent"], cfg, implementation)

    assert_rel(y, io["y"], FWD_RTOL, "y")
    assert_rel(aux.router_logits, io["logits"], FWD_RTOL, "router logits")
    index, weight = np.asarray(aux.topk_indices), np.asarray(aux.topk_weights)
    expected_index, expected_weight = io["topk_index"], io["topk_weight"]
    bias = hf.FAMILIES[family].correction_bias  # DeepSeek-V3's, GLM-4.5's, MiniMax-M2's
    if family in UNSORTED_TOPK:  # compare as sets
        order, expected_order = np.argsort(index, -1), np.argsort(expected_index, -1)
        index, weight = np.take_along_axis(index, order, -1), np.take_along_axis(weight, order, -1)
        expected_index = np.take_along_axis(expected_index, expected_order, -1)
        expected_weight = np.take_along_axis(expected_weight, expected_order, -1)
    np.testing.assert_array_equal(index, expected_index)
    if family == "switch":  # moejax zeroes a dropped assignment's weight; Switch keeps it unused
        dropped = io["dropped"].astype(bool)
        np.testing.assert_array_equal(aux.dropped_mask, dropped)
        expected_weight = np.where(dropped, 0.0, expected_weight)
    assert_rel(weight, expected_weight, FWD_RTOL, "top-k weights")

    assert_rel(dx, io["dx"], GRAD_RTOL, "dx")
    grads = hf.block_to_hf(dparams, cfg, family, prefix(family, layout), layout)
    expected = {k.removeprefix("grad."): v for k, v in io.items() if k.startswith("grad.")}
    # The correction bias is a buffer (no gradient in torch; zero in moejax: it only chooses).
    no_grad = set(grads) - set(expected)
    assert no_grad == ({FUSED_PREFIX + bias} if bias else set())
    for name in no_grad:
        np.testing.assert_array_equal(grads[name], 0.0)
    assert set(expected) <= set(grads)
    for name, value in expected.items():
        assert_rel(grads[name], value, GRAD_RTOL, f"d {name}")


def test_fixture_data_exercise_every_family_feature():
    """Guards against hollow comparisons: on the fixtures' own tensors and inputs, DeepSeek-V3's
    (and GLM-4.5's) correction bias and group limit each change some token's experts, as
    MiniMax-M2's correction bias does, GPT-OSS's
    two clamps are active, and Switch drops some tokens and keeps others."""
    ref = load_reference()
    for family in ("deepseek_v3", "glm4_moe", "glm4_moe_lite"):  # GLM's router is DeepSeek's
        io = read(FIXTURES / family / "io.safetensors")
        state = read(FIXTURES / family / "fused.safetensors")
        sd = {k.removeprefix(FUSED_PREFIX): v.astype(np.float64) for k, v in state.items()}
        x = io["x"].reshape(-1, io["x"].shape[-1]).astype(np.float64)
        cfg = CONFIGS[family]
        kw = dict(top_k=cfg["num_experts_per_tok"], n_group=cfg["n_group"], norm_topk_prob=True)
        kw.update(topk_group=cfg["topk_group"], scaling=cfg["routed_scaling_factor"])

        def experts(sd, x=x, kw=kw, **changes):
            return np.sort(ref.deepseek_v3_router(sd, x, **{**kw, **changes})[2], -1)

        np.testing.assert_array_equal(experts(sd), np.sort(io["topk_index"], -1), family)
        bias = sd["gate.e_score_correction_bias"]
        assert (experts({**sd, "gate.e_score_correction_bias": 0 * bias}) != experts(sd)).any()
        assert (experts(sd, topk_group=cfg["n_group"]) != experts(sd)).any(), family

    io = read(FIXTURES / "minimax_m2" / "io.safetensors")
    state = read(FIXTURES / "minimax_m2" / "fused.safetensors")
    sd = {k.removeprefix(FUSED_PREFIX): v.astype(np.float64) for k, v in state.items()}
    x = io["x"].reshape(-1, io["x"].shape[-1]).astype(np.float64)
    k = CONFIGS["minimax_m2"]["num_experts_per_tok"]
    choice = [
        np.sort(ref.minimax_m2_router(s, x, top_k=k)[2], -1)
        for s in (sd, {**sd, "e_score_correction_bias": 0 * sd["e_score_correction_bias"]})
    ]
    np.testing.assert_array_equal(choice[0], np.sort(io["topk_index"], -1))
    assert (choice[0] != choice[1]).any()  # MiniMax-M2's correction bias changes some choice

    io = read(FIXTURES / "gpt_oss" / "io.safetensors")
    state = read(FIXTURES / "gpt_oss" / "fused.safetensors")
    x = io["x"].reshape(-1, io["x"].shape[-1])
    gate_up = np.einsum("td,edf->etf", x, state[FUSED_PREFIX + "experts.gate_up_proj"])
    gate_up += state[FUSED_PREFIX + "experts.gate_up_proj_bias"][:, None]
    limit = CONFIGS["gpt_oss"]["swiglu_limit"]
    assert (gate_up[..., ::2] > limit).any() and (np.abs(gate_up[..., 1::2]) > limit).any()

    dropped = read(FIXTURES / "switch" / "io.safetensors")["dropped"]
    assert dropped.any() and not dropped.all()
