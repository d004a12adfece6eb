"""Whole-model fidelity against transformers on torch CPU, fp32 (fixtures written by
`make_hf_model_fixtures.py` with transformers 5.24.0 / torch 2.14.1): for a tiny random Mixtral,
Qwen3-MoE, OLMoE and Qwen2-MoE loaded from a bf16 checkpoint directory, logits within 1e-5 and
gradients of `sum(logits * R)` within 1e-4 (relative to each array's largest magnitude), every
MoE layer's top-k expert choices identical."""

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
    from moejax.interop.hf._config import _rope

    config = {k: v for k, v in fixtures.ROPE.items() if k != "head_dim"}
    theta, scaling = _rope(config | {"rope_scaling": fixtures.ROPE_CASES[case]})
    inv_freq, factor = models.rope_frequencies(fixtures.ROPE["head_dim"], theta, scaling)
    want = expected[f"rope/{case}/inv_freq"]
    np.testing.assert_allclose(inv_freq, want, rtol=2e-7, atol=0)
    assert factor == pytest.approx(float(expected[f"rope/{case}/attention_factor"]), rel=1e-12)


def test_fixtures_are_small():
    assert os.path.getsize(fixtures.OUT) < 1_000_000
