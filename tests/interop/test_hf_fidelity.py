"""Whole-model fidelity against transformers on torch CPU, fp32 (fixtures written by
`make_hf_model_fixtures.py` with transformers 5.24.0 / torch 2.14.1): for a tiny random Mixtral,
Qwen3-MoE, OLMoE and Qwen2-MoE loaded from a bf16 checkpoint directory, logits within 1e-5 and
gradients of `sum(logits * R)` within 1e-4 (relative to each array's largest magnitude), every
MoE layer's top-k expert choices identical. The same for DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash
(MTP off and on), GPT-OSS, DeepSeek-V2-Lite and MiniMax-M2 (`hf_model_fixtures_2026.npz`,
transformers 5.24.0), their sharded forward on the 2x4 mesh, and greedy generation against
transformers' `generate`."""

from __future__ import annotations

import json
import os

import _hf_decoder_reference as ref
import jax
import jax.numpy as jnp
import make_hf_model_fixtures as fixtures
import numpy as np
import pytest

import moejax
from moejax import models
from moejax.interop.hf import family_of, load_hf_model, model_recipes
from moejax.testing import assert_close


@pytest.fixture(scope="module")
def expected():
    with np.load(fixtures.OUT) as f:
        return {k: f[k] for k in f.files}


def _rel(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


def _hf_grads(grads: dict, cfg, family: str) -> dict:
    """The moejax gradient tree in transformers 5's in-memory names (fused experts)."""
    out = {}
    for recipe in model_recipes(cfg, family, "fused"):
        leaves = [np.asarray(_leaf(grads, p)) for p in recipe.leaves]
        out.update(zip(recipe.tensors, recipe.to_tensors(leaves), strict=True))
    return out


def _leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@pytest.mark.parametrize("family", fixtures.FAMILIES)
def test_logits_grads_and_topk_match_transformers(expected, family, tmp_path):
    config = ref.CONFIGS[family]
    sd = ref.random_state_dict(config, seed=fixtures.SEED[family])
    hashes = json.loads(str(expected["weights_sha256"]))
    assert fixtures.weights_sha256(sd) == hashes[family], "weights differ from the fixtures'"
    ref.write_checkpoint(str(tmp_path), config, sd, shards=2)
    cfg, params, _ = load_hf_model(str(tmp_path))
    tokens, r = fixtures.inputs(config, fixtures.SEED[family])
    tokens = jnp.asarray(tokens)

    def run(p):
        def loss(p):
            logits, _ = models.lm_forward(p, tokens, cfg)
            return jnp.sum(logits * r), logits

        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(p)
        h = models.moe_layer_inputs(p, tokens, cfg)
        index = [
            moejax.route(p["layers"][i]["moe"]["router"], x.reshape(-1, cfg.d_model), cfg.moe)
            for i, x in zip(cfg.moe_layers, h, strict=True)
        ]
        return logits, grads, [routing.expert_index for routing in index]

    logits, grads, indices = jax.jit(run)(params)  # one compile
    assert _rel(logits, expected[f"{family}/logits"]) <= 1e-5
    hf_grads = _hf_grads(grads, cfg, family)
    names = {k.split("/", 2)[2] for k in expected if k.startswith(f"{family}/grad/")}
    assert names == set(hf_grads), "parameter names differ from transformers'"
    for name in sorted(names):
        assert _rel(hf_grads[name], expected[f"{family}/grad/{name}"]) <= 1e-4, name
    for j, index in enumerate(indices):  # every MoE layer's top-k choices
        np.testing.assert_array_equal(np.asarray(index), expected[f"{family}/topk/{j}"])
    assert family_of(config) == family


@pytest.mark.parametrize("case", sorted(fixtures.ROPE_CASES))
def test_rope_scaling_matches_transformers(expected, case):
    """`rope_scaling` of a config.json -> `RopeScaling` -> frequencies, as transformers'."""
    from moejax.interop.hf._lm_config import _rope

    config = {k: v for k, v in fixtures.ROPE.items() if k != "head_dim"}
    theta, scaling = _rope(config | {"rope_scaling": fixtures.ROPE_CASES[case]})
    inv_freq, factor = models.rope_frequencies(fixtures.ROPE["head_dim"], theta, scaling)
    want = expected[f"rope/{case}/inv_freq"]
    np.testing.assert_allclose(inv_freq, want, rtol=2e-7, atol=0)
    assert factor == pytest.approx(float(expected[f"rope/{case}/attention_factor"]), rel=1e-12)


def test_fixtures_are_small():
    assert os.path.getsize(fixtures.OUT) < 1_000_000


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 (MLA, a dense first layer, grouped sigmoid routing, shared experts, MTP) and
# GPT-OSS (sinks, sliding windows of 3 over 10 positions, biases, yarn), and greedy generation.


@pytest.fixture(scope="module")
def expected_2026():
    with np.load(fixtures.OUT_2026) as f:
        return {k: f[k] for k in f.files}


def _checkpoint_2026(expected, family, path, mtp=True):
    """The fixtures' checkpoint of `family` at `path`; DeepSeek-V3 without its MTP layer (and
    `num_nextn_predict_layers: 0`) unless `mtp`."""
    config = ref.CONFIGS_2026[family]
    sd = ref.random_state_dict(config, seed=fixtures.SEED[family])
    hashes = json.loads(str(expected["weights_sha256"]))
    assert fixtures.weights_sha256(sd) == hashes[family], "weights differ from the fixtures'"
    if not mtp and config.get("num_nextn_predict_layers"):
        mtp_layer = f"model.layers.{config['num_hidden_layers']}."
        sd = {n: t for n, t in sd.items() if not n.startswith(mtp_layer)}
        config = config | {"num_nextn_predict_layers": 0}
    ref.write_checkpoint(str(path), config, sd, shards=2)
    return config


CASES_2026 = [
    pytest.param("deepseek_v3", False, id="dsv3", marks=pytest.mark.slow),  # dsv3_mtp covers it
    pytest.param("deepseek_v3", True, id="dsv3_mtp"),
    pytest.param("gpt_oss", False, id="gpt_oss"),
    pytest.param("glm4_moe", False, id="glm4_moe", marks=pytest.mark.slow),  # as dsv3
    pytest.param("glm4_moe", True, id="glm4_moe_mtp"),
    pytest.param("deepseek_v2", False, id="dsv2"),
    pytest.param("minimax_m2", False, id="minimax_m2"),
    pytest.param("glm4_moe_lite", False, id="glm47_flash", marks=pytest.mark.slow),  # as dsv3
    pytest.param("glm4_moe_lite", True, id="glm47_flash_mtp"),
]


@pytest.mark.parametrize(("family", "mtp"), CASES_2026)
def test_2026_logits_grads_and_topk_match_transformers(expected_2026, family, mtp, tmp_path):
    config = _checkpoint_2026(expected_2026, family, tmp_path, mtp)
    served, params, _ = load_hf_model(str(tmp_path))
    assert served.mtp_layers == int(mtp) and family_of(config) == family
    assert served.mtp_input == "final_norm"  # what a converted model trains and serves
    # the gradients' fixture fed transformers' MTP layer the state before the final norm
    cfg = served.replace(mtp_input="pre_norm")
    tokens, r, r_mtp = fixtures.inputs_2026(config, fixtures.SEED[family])
    tokens = jnp.asarray(tokens)
    s = fixtures.SEQ

    def run(p):
        def loss(p):
            if not mtp:
                logits, _ = models.lm_forward(p, tokens[:, :s], cfg)
                return jnp.sum(logits * r), (logits, logits)
            logits, _, mtp_logits = models.lm_forward(p, tokens[:, :s], cfg, mtp_tokens=tokens)
            return jnp.sum(logits * r) + jnp.sum(mtp_logits[0] * r_mtp), (logits, mtp_logits[0])

        (_, (logits, mtp_logits)), grads = jax.value_and_grad(loss, has_aux=True)(p)
        if mtp:  # and from the final-normed state, as the serving stacks draft
            _, _, normed = models.lm_forward(p, tokens[:, :s], served, mtp_tokens=tokens)
            mtp_logits = (mtp_logits, normed[0])
        h = models.moe_layer_inputs(p, tokens[:, :s], cfg)
        index = [
            moejax.route(p["layers"][i]["moe"]["router"], x.reshape(-1, cfg.d_model), cfg.moe)
            for i, x in zip(cfg.moe_layers, h, strict=True)
        ]
        return logits, mtp_logits, grads, [jnp.sort(x.expert_index, axis=-1) for x in index]

    logits, mtp_logits, grads, indices = jax.jit(run)(params)
    assert _rel(logits, expected_2026[f"{family}/logits"]) <= 1e-5
    if mtp:
        assert _rel(mtp_logits[0], expected_2026[f"{family}/mtp_logits"]) <= 1e-5
        want = expected_2026[f"{family}/mtp_logits_final_norm"]
        assert _rel(mtp_logits[1], want) <= 1e-5
    hf_grads = _hf_grads(grads, cfg, family)
    for name in [n for n in hf_grads if n.endswith("e_score_correction_bias")]:
        # a buffer in transformers; it only picks experts, so its gradient is zero here too
        assert not np.any(hf_grads.pop(name)), name
    key = "grad_mtp" if mtp else "grad"
    names = {k.split("/", 2)[2] for k in expected_2026 if k.startswith(f"{family}/{key}/")}
    assert names == set(hf_grads), "parameter names differ from transformers'"
    for name in sorted(names):
        assert _rel(hf_grads[name], expected_2026[f"{family}/{key}/{name}"]) <= 1e-4, name
    for j, index in enumerate(indices):
        np.testing.assert_array_equal(np.asarray(index), expected_2026[f"{family}/topk/{j}"])


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=() if f == "gpt_oss" else pytest.mark.slow) for f in fixtures.GENERATE],
)  # default run: GPT-OSS (GQA cache, sinks, ring windows); MLA's cache: tests/models/test_mla.py
def test_greedy_tokens_equal_transformers_generate(expected_2026, family, tmp_path):
    """`moejax.models.generate` (KV cache: MLA's latent, sliding layers' windows) at
    temperature 0 on the fixtures' checkpoints gives transformers' greedy `generate` tokens."""
    if family in ref.CONFIGS_2026:
        config = _checkpoint_2026(expected_2026, family, tmp_path)
    else:
        config = ref.CONFIGS[family]
        ref.write_checkpoint(
            str(tmp_path), config, ref.random_state_dict(config, fixtures.SEED[family])
        )
    cfg, params, _ = load_hf_model(str(tmp_path))
    prompt = fixtures.prompt(config, fixtures.SEED[family])
    ids = models.generate(params, cfg, prompt, fixtures.NEW_TOKENS)
    np.testing.assert_array_equal(np.asarray(ids), expected_2026[f"generate/{family}"])


def test_fixtures_2026_are_small():
    assert os.path.getsize(fixtures.OUT_2026) < 1_900_000


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=pytest.mark.slow)
        for f in ("deepseek_v3", "glm4_moe", "deepseek_v2", "minimax_m2", "glm4_moe_lite")
    ]
    + ["gpt_oss"],
)  # MLA on a mesh in the default run: tests/models/test_mla.py
def test_2026_sharded_forward_on_the_2x4_mesh_equals_one_device(expected_2026, family, tmp_path):
    """Loaded straight onto an (fsdp 2, expert 4) mesh, the forward (and the MTP logits of
    DeepSeek-V3 and GLM-4.5) equals the single-device one."""
    from moejax import parallel

    config = _checkpoint_2026(expected_2026, family, tmp_path)
    mesh = parallel.make_mesh((2, 4), ("fsdp", "expert"))
    cfg, sharded, _ = load_hf_model(str(tmp_path), mesh=mesh)
    _, local, _ = load_hf_model(str(tmp_path))
    tokens, _, _ = fixtures.inputs_2026(config, fixtures.SEED[family])
    tokens = jnp.asarray(np.tile(tokens, (4, 1)))  # 8 rows: one per device of the token axes
    mtp = {"mtp_tokens": tokens} if cfg.mtp_layers else {}

    def forward(p, mesh):
        out = models.lm_forward(p, tokens[:, : fixtures.SEQ], cfg, mesh=mesh, **mtp)
        return out[0], out[2] if mtp else out[0]

    want = jax.jit(lambda p: forward(p, None))(local)
    got = jax.jit(lambda p: forward(p, mesh))(sharded)
    assert got[0].sharding.mesh.shape == mesh.shape
    assert_close(got, want)
