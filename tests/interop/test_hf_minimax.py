"""MiniMax-M2 (`minimax_m2`, also M2.1 and M2.5): the published config reads into the published
sizes; the fields that shape the model (`rotary_dim`, the router's) are read, and the ones
moejax cannot honour are refused, each naming its field. Logits, gradients, top-k, generation
and the sharded forward against transformers are in `test_hf_fidelity.py`; the block in
`test_hf_fixtures.py`; load-save-load in `test_hf_deepseek_gpt_oss.py`."""

from __future__ import annotations

import pytest

from moejax import models, presets
from moejax.interop.hf import CheckpointError, lm_config_from_hf, moe_config_from_hf

MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "attn_type_list": [1] * 62,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "layernorm_full_attention_beta": 1.0,
    "layernorm_linear_attention_beta": 1.0,
    "layernorm_mlp_beta": 1.0,
    "max_position_embeddings": 196608,
    "mlp_intermediate_size": 8192,
    "mtp_transformer_layers": 1,
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "num_mtp_modules": 3,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "use_mtp": True,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}  # fmt: skip  (MiniMaxAI/MiniMax-M2's config.json, without auto_map and quantization_config)


def test_published_config_gives_the_published_size():
    """MiniMax-M2: 230B parameters, 10B active; GQA (48 query, 8 key/value heads of 128) with
    q/k RMSNorm over all heads, RoPE over 64 of each head's 128 features, 256 experts, top-8
    sigmoid routing with the correction bias, renormalised, no groups and no shared expert."""
    cfg, family = lm_config_from_hf(MINIMAX_M2)
    counts = models.param_counts(cfg)
    assert family == "minimax_m2"
    assert (round(counts.total / 1e9, 2), round(counts.active / 1e9, 2)) == (228.69, 10.42)
    assert cfg.qk_norm == "full" and cfg.rope_dim == 64 and cfg.rope_theta == 5e6
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (48, 8, 128)
    assert cfg.mlp_kinds == ("moe",) * 62 and cfg.mtp_layers == 0
    d = dict(d_model=3072, d_ff=1536, num_experts=256, param_dtype="float32")
    assert cfg.moe == presets.minimax_m2(**d)


def test_the_published_fp8_checkpoint_config_reads_as_the_dequantized_model():
    """The Hub checkpoint is FP8 with 128 x 128 block scales; its `fmt` is torch's name."""
    fp8 = {
        "quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
    }  # fmt: skip
    cfg, _ = lm_config_from_hf(MINIMAX_M2 | {"quantization_config": fp8})
    assert cfg == lm_config_from_hf(MINIMAX_M2)[0]
    with pytest.raises(CheckpointError, match="fmt"):
        lm_config_from_hf(MINIMAX_M2 | {"quantization_config": fp8 | {"fmt": "e5m2"}})


def test_rotary_dim_and_partial_rotary_factor_agree():
    """transformers 5 writes `partial_rotary_factor` into `rope_parameters` beside the legacy
    `rotary_dim`; they must say the same."""
    both = MINIMAX_M2 | {"rope_parameters": {"rope_theta": 5e6, "partial_rotary_factor": 0.5}}
    assert lm_config_from_hf(both)[0] == lm_config_from_hf(MINIMAX_M2)[0]
    absent = {k: v for k, v in MINIMAX_M2.items() if k != "rotary_dim"}
    assert lm_config_from_hf(absent)[0].rope_dim == 128  # transformers: all of the head
    clash = MINIMAX_M2 | {"rope_parameters": {"partial_rotary_factor": 0.25}}
    with pytest.raises(CheckpointError, match="rotary_dim / head_dim"):
        lm_config_from_hf(clash)
    for bad in (0, 64.0, True):
        with pytest.raises(CheckpointError, match="rotary_dim"):
            lm_config_from_hf(MINIMAX_M2 | {"rotary_dim": bad})


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attn_type_list": [0, 1] * 31}, "attn_type_list"),  # MiniMax-01's lightning attention
        ({"layernorm_mlp_beta": 0.9}, "layernorm_mlp_beta"),
        ({"layernorm_full_attention_alpha": 3.5}, "layernorm_full_attention_alpha"),
        ({"shared_intermediate_size": 1024}, "shared_intermediate_size"),
        ({"use_routing_bias": False}, "use_routing_bias"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"router_jitter_noise": 0.01}, "router_jitter_noise"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_what_moejax_cannot_honour_is_refused_naming_the_field(change, field):
    with pytest.raises(CheckpointError, match=field):
        lm_config_from_hf(MINIMAX_M2 | change)


@pytest.mark.parametrize("kinds", [[1] * 63, [1] * 61, [], 1, [1.0] * 62], ids=str)
def test_an_attn_type_list_not_one_per_layer_is_refused(kinds):
    """An `attn_type_list` longer or shorter than num_hidden_layers (62) was accepted."""
    with pytest.raises(CheckpointError, match=r"attn_type_list=.*need one integer per layer, "
                       r"num_hidden_layers=62"):  # fmt: skip
        lm_config_from_hf(MINIMAX_M2 | {"attn_type_list": kinds})


def test_block_reader_ignores_what_it_is_told_to():
    """`ignore` drops training-time jitter as for Mixtral; the block has no other knobs."""
    cfg, family = moe_config_from_hf(MINIMAX_M2 | {"router_jitter_noise": 0.01},
                                     ignore={"router_jitter_noise"})  # fmt: skip
    assert family == "minimax_m2" and cfg.router == "sigmoid" and cfg.num_groups == 1
