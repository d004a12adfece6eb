"""Dense Hugging Face decoders (Llama, Qwen2, Qwen3) as upcycling sources, against transformers on
torch CPU in fp32 (`hf_dense_fixtures.npz`, written by `make_hf_model_fixtures.py --only-dense`
with transformers 5.18.0, torch 2.14.1): a tiny random model of each, loaded from a bf16
checkpoint directory, gives transformers' logits within 1e-5 and gradients of `sum(logits * R)`
within 1e-4 (relative to each array's largest magnitude); upcycled (identical experts, softmax
over normalised top-k, no noise) it still gives transformers' dense logits within 1e-5; it saves
back bit for bit; bad input names its field."""

from __future__ import annotations

import json

import _hf_decoder_reference as ref
import jax
import jax.numpy as jnp
import make_hf_model_fixtures as fixtures
import numpy as np
import pytest

import moejax
from moejax import models
from moejax.interop import hf

FAMILIES = sorted(fixtures.DENSE_CONFIGS)
FWD_RTOL, GRAD_RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def expected():
    with np.load(fixtures.DENSE_OUT) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, expected):
    """Each family's fixture checkpoint directory (the weights the fixtures were made from)."""
    hashes = json.loads(str(expected["weights_sha256"]))
    out = {}
    for family in FAMILIES:
        config = fixtures.DENSE_CONFIGS[family]
        sd = ref.random_state_dict(config, seed=fixtures.DENSE_SEED[family])
        assert fixtures.weights_sha256(sd) == hashes[family], "weights differ from the fixtures'"
        path = str(tmp_path_factory.mktemp(family))
        ref.write_checkpoint(path, config, sd, shards=1)
        out[family] = (path, sd)
    return out


def _rel(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


def _hf_grads(grads: dict, cfg, family: str) -> dict:
    out = {}
    for recipe in hf.model_recipes(cfg, family):
        leaves = []
        for path in recipe.leaves:
            leaf = grads
            for key in path:
                leaf = leaf[key]
            leaves.append(np.asarray(leaf))
        out.update(zip(recipe.tensors, recipe.to_tensors(leaves), strict=True))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_grads_match_transformers(expected, checkpoints, family):
    config = fixtures.DENSE_CONFIGS[family]
    cfg, params, _ = hf.load_hf_model(checkpoints[family][0])
    assert hf.family_of(config) == family and hf.FAMILIES[family].dense
    assert cfg.mlp_kinds == ("dense",) * cfg.num_layers and cfg.mlp_d_ff == 48
    tokens, r = fixtures.inputs(config, fixtures.DENSE_SEED[family])

    def loss(p):
        logits, _ = models.lm_forward(p, jnp.asarray(tokens), cfg)
        return jnp.sum(logits * r), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert _rel(logits, expected[f"{family}/logits"]) <= FWD_RTOL
    hf_grads = _hf_grads(grads, cfg, family)
    names = {k.split("/", 2)[2] for k in expected if k.startswith(f"{family}/grad/")}
    assert names == set(hf_grads), "parameter names differ from transformers'"
    for name in sorted(names):
        assert _rel(hf_grads[name], expected[f"{family}/grad/{name}"]) <= GRAD_RTOL, name


# (num_experts, top_k, granularity): whole copies, and granular shards of 24 = 48 / 2
UPCYCLE = {"llama": (4, 2, 1), "qwen2": (8, 2, 2), "qwen3": (8, 4, 2)}


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=[] if f == "qwen3" else pytest.mark.slow) for f in FAMILIES],
)  # qwen3 (granular, q/k norms) in the default run; each is ~7 s of compiling
def test_upcycled_model_gives_transformers_dense_logits(expected, checkpoints, family):
    dense_cfg, params, _ = hf.load_hf_model(checkpoints[family][0])
    e, k, g = UPCYCLE[family]
    moe = moejax.MoEConfig(
        d_model=dense_cfg.d_model, d_ff=dense_cfg.mlp_d_ff // g, num_experts=e, top_k=k,
        router="softmax", norm_topk_prob=True, block_size=8,
    )  # fmt: skip
    moe_params, cfg = models.upcycle(params, dense_cfg, moe, granularity=g, seed=3)
    assert cfg.mlp_kinds == ("moe",) * cfg.num_layers  # an all-dense source: every layer MoE
    assert "mlp" not in moe_params["layers"][0]
    tokens, _ = fixtures.inputs(fixtures.DENSE_CONFIGS[family], fixtures.DENSE_SEED[family])
    logits, aux = jax.jit(lambda p: models.lm_forward(p, jnp.asarray(tokens), cfg))(moe_params)
    assert _rel(logits, expected[f"{family}/logits"]) <= FWD_RTOL
    # the tokens go to several copies (the fresh router routes), not one expert doing all
    assert int((np.asarray(aux.expert_counts) > 0).sum(-1).min()) >= 2 * g


@pytest.mark.parametrize("family", FAMILIES)
def test_saves_back_bit_for_bit(checkpoints, family, tmp_path):
    path, sd = checkpoints[family]
    cfg, params, hf_config = hf.load_hf_model(path)
    hf.save_hf_model(str(tmp_path / "out"), params, cfg, hf_config)  # bf16: the config's dtype
    with hf.SafetensorsCheckpoint(str(tmp_path / "out")) as back:
        assert sorted(back) == sorted(sd) == sorted(hf.tensor_names(cfg, family))
        for name, want in sd.items():
            assert back[name].dtype == want.dtype and np.array_equal(back[name], want), name
    assert ("lm_head.weight" in sd) == (not cfg.tie_embeddings)


def test_loads_onto_a_mesh_with_an_expert_axis(checkpoints):
    """No expert to split: the placeholder MoE config does not have to divide over `expert`;
    dense weights are split over `fsdp` and `expert` (ZeRO-3)."""
    from moejax import parallel

    path, _ = checkpoints["qwen3"]
    mesh = parallel.make_mesh((2, 4), ("fsdp", "expert"))
    cfg, params, _ = hf.load_hf_model(path, mesh=mesh)
    _, local, _ = hf.load_hf_model(path)
    specs = models.lm_partition_specs(cfg, mesh)
    assert cfg.moe.num_experts == 1 and specs["layers"][0]["mlp"]["w_gate"][0] == (
        "fsdp",
        "expert",
    )
    for leaf, spec, want in zip(
        jax.tree.leaves(params), jax.tree.leaves(specs), jax.tree.leaves(local), strict=True
    ):
        assert leaf.sharding.spec == spec
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want))


def test_family_table_and_architectures():
    dense = sorted(name for name, fam in hf.FAMILIES.items() if fam.dense)
    assert dense == ["llama", "qwen2", "qwen3"]
    for name in dense:
        assert hf.FAMILIES[name].layouts == () and hf.FAMILIES[name].decoder is not None
    by_arch = {
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Qwen2MoeForCausalLM": "qwen2_moe",  # not read as Qwen2
        "Qwen3MoeForCausalLM": "qwen3_moe",
    }
    for arch, family in by_arch.items():
        assert hf.family_of({"architectures": [arch]}) == family
    with pytest.raises(hf.CheckpointError, match="Llama4ForConditionalGeneration"):
        hf.family_of({"architectures": ["Llama4ForConditionalGeneration"]})


def test_dense_config_defaults_and_fields_moejax_cannot_honour():
    llama = fixtures.DENSE_CONFIGS["llama"]
    # head_dim when absent: Qwen3Config's default 128, hidden // heads for Llama and Qwen2
    no_head_dim = {k: v for k, v in fixtures.DENSE_CONFIGS["qwen3"].items() if k != "head_dim"}
    assert hf.lm_config_from_hf(no_head_dim)[0].head_dim == 128
    assert hf.lm_config_from_hf(fixtures.DENSE_CONFIGS["qwen2"])[0].head_dim == 32 // 4
    with pytest.raises(hf.CheckpointError, match=r"mlp_bias=True: MLP biases are not supported"):
        hf.lm_config_from_hf(llama | {"mlp_bias": True})
    with pytest.raises(hf.CheckpointError, match="use_sliding_window"):
        hf.lm_config_from_hf(fixtures.DENSE_CONFIGS["qwen2"] | {"use_sliding_window": True})
    with pytest.raises(hf.CheckpointError, match="quantization_config"):
        hf.lm_config_from_hf(llama | {"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(hf.CheckpointError, match="model_type='llama': a dense model"):
        hf.moe_config_from_hf(llama)
    with pytest.raises(ValueError, match="family='qwen3': a dense decoder family"):
        hf.block_prefix("qwen3", 0)
    with pytest.raises(ValueError, match="family='qwen2': a dense decoder family"):
        hf.block_to_hf({}, moejax.MoEConfig(d_model=8, d_ff=8, num_experts=2, top_k=1), "qwen2")
