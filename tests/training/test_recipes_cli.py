"""`train_lm.py --upcycle-from` a dense moejax run: the MoE run starts from its MLPs and trains;
the summary names the recipes in use."""

import json

import pytest
from _helpers import MODEL, TRAIN, corpus

from moejax.cli import train_inputs, train_lm
from moejax.models import dense_lm_config
from moejax.training import train


@pytest.mark.slow  # two training runs (~1-2 min of CPU)
def test_upcycle_from_a_dense_run_trains_and_says_so(capsys, tmp_path):
    dense_dir = tmp_path / "dense"
    dense_cfg = dense_lm_config(MODEL, d_ff=64)
    train(
        dense_cfg, TRAIN.replace(steps=4, warmup_steps=1), corpus(), run_dir=str(dense_dir),
        progress=False, outputs=False,
    )  # fmt: skip
    out = tmp_path / "moe"
    args = ["--preset", "micro", "--out", str(out), "--no-progress", "--max-bytes", "200000"]
    args += ["--upcycle-from", str(dense_dir), "--upcycle-granularity", "2", "--steps", "8"]
    code = train_lm.main(args)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    line = next(ln for ln in printed.out.splitlines() if ln.startswith("training recipe"))
    assert line.endswith(f"| upcycled from {dense_dir} (granularity 2, noise 0)"), line
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0], losses


def test_upcycle_from_a_directory_without_checkpoints_is_one_line(capsys, tmp_path):
    out = tmp_path / "moe"
    code = train_lm.main(
        ["--preset", "micro", "--out", str(out), "--no-progress", "--upcycle-from", str(tmp_path)]
    )
    err = capsys.readouterr().err.strip()
    assert (
        code == 2
        and err == f"error: --upcycle-from={tmp_path}: no moejax training checkpoint there"
    )


# A tiny dense Hugging Face model (Qwen3 spelling: per-head q/k norms) shaped like the micro preset.
HF_DENSE = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 256,
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
    "max_position_embeddings": 16, "tie_word_embeddings": True,
}  # fmt: skip


def _hf_dir(path, config=HF_DENSE):
    import jax

    from moejax.interop.hf import lm_config_from_hf, save_hf_model
    from moejax.models import init_lm_params

    cfg, _ = lm_config_from_hf(config)
    params = init_lm_params(cfg, jax.random.key(0))
    save_hf_model(str(path), params, cfg, config)
    return cfg, params


def test_upcycle_from_a_hugging_face_dense_directory(tmp_path):
    """The flag's loading half (no training): every layer MoE, each expert a shard of its
    layer's dense MLP, the rest the checkpoint's."""
    import types

    import numpy as np

    dense_cfg, dense = _hf_dir(tmp_path / "qwen3")
    args = types.SimpleNamespace(
        upcycle_from=str(tmp_path / "qwen3"), upcycle_granularity=2, upcycle_noise=0.0, seed=0,
        allow_nonfinite=False,
    )  # fmt: skip
    params, cfg = train_inputs.upcycled(args, MODEL)
    assert cfg.mlp_kinds == ("moe", "moe") and cfg.moe.d_ff == 32 and cfg.moe.num_experts == 8
    assert cfg.qk_norm == "head" and cfg.tie_embeddings and "unembed" not in params
    for i in range(2):
        mlp, experts = dense["layers"][i]["mlp"], params["layers"][i]["moe"]["experts"]
        np.testing.assert_array_equal(experts["w_up"][3], mlp["w_up"][:, 32:])  # copy 1, shard 1
        np.testing.assert_array_equal(experts["w_down"][2], 2 * mlp["w_down"][:32])
        np.testing.assert_array_equal(
            params["layers"][i]["attn"]["q_norm"]["scale"],
            dense["layers"][i]["attn"]["q_norm"]["scale"],
        )


def test_upcycle_from_a_hugging_face_moe_directory_is_one_line(capsys, tmp_path):
    moe = HF_DENSE | {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
    }  # fmt: skip
    _hf_dir(tmp_path / "moe", moe)
    args = ["--preset", "micro", "--out", str(tmp_path / "out"), "--no-progress"]
    code = train_lm.main([*args, "--upcycle-from", str(tmp_path / "moe")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        f"error: --upcycle-from={tmp_path / 'moe'}: model_type='qwen3_moe' has MoE layers; "
        "upcycling starts from a dense model (['llama', 'qwen2', 'qwen3'])"
    ), err


@pytest.mark.slow  # a training run (~1 min of CPU)
def test_upcycle_from_a_hugging_face_dense_directory_trains(capsys, tmp_path):
    _hf_dir(tmp_path / "qwen3")
    out = tmp_path / "moe"
    args = ["--preset", "micro", "--out", str(out), "--no-progress", "--max-bytes", "200000"]
    args += ["--upcycle-from", str(tmp_path / "qwen3"), "--upcycle-granularity", "2"]
    code = train_lm.main([*args, "--steps", "8"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
