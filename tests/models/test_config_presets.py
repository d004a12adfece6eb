"""LMConfig validation, presets (every one loaded), parameter trees and counts."""

import math

import jax
import pytest

import moejax
from moejax.models import LMConfig, param_counts, presets
from moejax.models._lm_params import abstract_params
from moejax.training import presets as train_presets

MOE = moejax.MoEConfig(d_model=32, d_ff=32, num_experts=4, top_k=2)
BASE = dict(
    vocab_size=256,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_seq_len=16,
    moe=MOE,
)

INVALID = [
    ({"vocab_size": 0}, "vocab_size"),
    ({"d_model": 64}, "d_model"),
    ({"num_layers": 1.5}, "num_layers"),
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"head_dim": 7}, "head_dim"),
    ({"moe_every": 3}, "moe_every"),
    ({"max_seq_len": 0}, "max_seq_len"),
    ({"dense_d_ff": 0}, "dense_d_ff"),
    ({"rope_theta": 1.0}, "rope_theta"),
    ({"norm_eps": 0.0}, "norm_eps"),
    ({"dtype": "float16"}, "dtype"),
    ({"param_dtype": "int8"}, "param_dtype"),
    ({"moe": "mixtral"}, "moe"),
    ({"embed_init_std": -1.0}, "embed_init_std"),
]


@pytest.mark.parametrize("change,field", INVALID)
def test_invalid_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=rf"LMConfig\.{field}="):
        LMConfig(**{**BASE, **change})


def test_moe_layers_follow_moe_every():
    cfg = LMConfig(**{**BASE, "num_layers": 5, "moe_every": 2})
    assert cfg.moe_layers == (1, 3)
    params = abstract_params(cfg)
    kinds = ["moe" if "moe" in layer else "mlp" for layer in params["layers"]]
    assert kinds == ["mlp", "moe", "mlp", "moe", "mlp"]
    assert params["layers"][0]["mlp"]["w_up"].shape == (32, MOE.d_ff * MOE.top_k)


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_loads_with_its_training_preset(name):
    cfg = presets.get(name)
    train_cfg = train_presets.get(name)
    assert isinstance(cfg, LMConfig) and cfg.num_moe_layers >= 1
    # The global batch must split over the default 2 x 4 mesh and the experts over expert=4; a
    # dense preset's one expert (train_lm's default mesh for it: data=8) over no expert axis.
    assert train_cfg.batch_size % 8 == 0
    assert cfg.moe.num_experts % 4 == 0 or (name.endswith("_dense") and cfg.moe.num_experts == 1)
    assert (train_cfg.seq_len or cfg.max_seq_len) <= cfg.max_seq_len
    abstract = abstract_params(cfg)  # shapes only: never allocates mixtral_8x7b
    assert abstract["embed"]["embedding"].shape == (cfg.vocab_size, cfg.d_model)
    assert len(abstract["layers"]) == cfg.num_layers


def test_unknown_preset_is_one_line_error():
    with pytest.raises(ValueError, match="unknown preset 'huge': choose one of micro, tiny"):
        presets.get("huge")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        train_presets.get("huge")


def test_mixtral_shapes_match_the_published_model():
    """46,702,792,704 parameters is the count of mistralai/Mixtral-8x7B-v0.1."""
    cfg = presets.get("mixtral_8x7b")
    counts = param_counts(cfg)
    assert counts.total == 46_702_792_704
    # Active = total minus 6 of 8 experts per layer minus the embedding lookup.
    experts = 32 * 8 * 3 * 4096 * 14336
    assert counts.active == counts.total - experts * 6 // 8 - 32000 * 4096
    layer = abstract_params(cfg)["layers"][7]
    assert layer["attn"]["wk"].shape == (4096, 8, 128)
    assert layer["moe"]["experts"]["w_gate"].shape == (8, 4096, 14336)


def test_param_counts_match_the_shapes_by_hand():
    cfg = presets.get("micro")  # V=256 D=32 L=2 H=4 Hkv=2 Dh=8 E=8 F=32 K=2 Fs=16, all MoE
    attn = 32 * 4 * 8 * 2 + 32 * 2 * 8 * 2  # wq + wo, wk + wv
    experts = 8 * 3 * 32 * 32
    router = 32 * 8 + 8  # kernel + score_correction_bias
    layer = attn + 2 * 32 + router + experts + 3 * 32 * 16  # + norms + shared expert
    total = 2 * 256 * 32 + 2 * layer + 32  # embedding + unembedding + final norm
    counts = param_counts(cfg)
    assert counts.total == total
    assert counts.active == total - 256 * 32 - 2 * experts * 6 // 8
    leaves = jax.tree.leaves(abstract_params(cfg))
    assert sum(math.prod(x.shape) for x in leaves) == total
    assert all(x.dtype == jax.numpy.float32 for x in leaves)
    tied = cfg.replace(tie_embeddings=True)
    assert "unembed" not in abstract_params(tied)
    assert param_counts(tied).active == counts.active  # the table does the unembedding matmul
