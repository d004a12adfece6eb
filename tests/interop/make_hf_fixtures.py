"""Write the Hugging Face fixtures of tests/interop/test_hf_fixtures.py (a script, not a test).

For each family of `_hf_cases.CONFIGS` it builds a tiny one-MoE-layer model with transformers
(torch, CPU, fp32, experts_implementation="eager"), draws the MoE block's parameters, runs the
block on a random `x [B, S, D]` and back-propagates `sum(y * cotangent)`, and writes, under
tests/interop/fixtures/<family>/:

- `config.json`: the model's config as transformers writes it;
- `per_expert.safetensors`: the block's tensors as `save_pretrained` writes them (the published
  checkpoint layout, with their whole-model names), where the family has that layout;
- `fused.safetensors`: the block module's `state_dict()` (transformers 5's fused layout), named
  under `model.layers.0.mlp.`, where the family has that layout;
- `io.safetensors`: `x`, `cotangent`, `y`, `dx`, the router's `logits [T, E]`, `topk_index [T, K]`
  and `topk_weight [T, K]` (Switch: also `dropped [T, 1]`), and `grad.<name>` for every tensor of
  the fused state dict (Switch, GPT-OSS: of the module's own state dict).

Run with an environment that has torch, transformers and safetensors (not moejax's):

    python tests/interop/make_hf_fixtures.py   # about 20 s; writes ~0.4 MB

Recorded with torch 2.14.1 and transformers 5.24.0 (fixtures/MANIFEST.json).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from _hf_cases import CONFIGS, D  # noqa: E402

OUT = Path(__file__).parent / "fixtures"
B, S = 2, 16
FUSED_PREFIX = "model.layers.0.mlp."
# Where save_pretrained puts the MoE block (the published checkpoint names).
SAVED_PREFIX = {
    "mixtral": "model.layers.0.block_sparse_moe.",
    "minimax_m2": "model.layers.0.block_sparse_moe.",
    "switch": "encoder.block.1.layer.1.mlp.",
}
# Whole-model fields that keep the model tiny (attention, vocabulary, one MoE layer).
TINY = dict(vocab_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
EXTRA = {
    "mixtral": dict(head_dim=8),
    "qwen2_moe": dict(decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(head_dim=8, decoder_sparse_step=1, mlp_only_layers=[]),
    "olmoe": {},
    "deepseek_v3": dict(
        first_k_dense_replace=0,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        intermediate_size=24,
    ),
    "deepseek_v2": dict(
        first_k_dense_replace=0,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        intermediate_size=24,
    ),
    "glm4_moe": dict(first_k_dense_replace=0, head_dim=8, intermediate_size=24),
    "glm4_moe_lite": dict(
        mlp_layer_types=["sparse"],  # its default makes the first layer dense
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        intermediate_size=24,
    ),
    "minimax_m2": dict(head_dim=8),
    "gpt_oss": dict(head_dim=8),
    "switch": dict(
        vocab_size=32,
        num_layers=2,
        num_decoder_layers=2,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
        num_heads=2,
        d_kv=8,
    ),
}


def build(family):
    fields = {k: v for k, v in CONFIGS[family].items() if k not in ("architectures", "dtype")}
    model_type = fields.pop("model_type")
    tiny = {} if family == "switch" else TINY
    config = transformers.AutoConfig.for_model(model_type, **fields, **tiny, **EXTRA[family])
    config.architectures = CONFIGS[family]["architectures"]
    config._experts_implementation = "eager"
    if family == "switch":
        model = transformers.SwitchTransformersForConditionalGeneration(config)
        block = model.encoder.block[1].layer[1].mlp
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
        block = model.model.layers[0].mlp
    return model.float().eval(), block


def randomize(family, block, gen):
    """Normal(0, 1/sqrt(fan_in)) projections, Normal(0, 0.3) biases (every bias path matters)."""
    with torch.no_grad():
        for name, p in block.named_parameters():
            if p.ndim == 1 or name.endswith("_bias"):
                std = 0.3
            elif family == "gpt_oss" and p.ndim == 3:  # [E, D, 2F], [E, F, D]: used as x @ W
                std = 1 / math.sqrt(p.shape[1])
            else:  # torch [out, in] (fused: [E, 2F, D], [E, D, F])
                std = 1 / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, buf in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)


def router_module(block):
    return getattr(block, "gate", None) or block.router


def run(family, block, gen):
    """Forward and backward of the block; returns the io tensors."""
    x = torch.randn(B, S, D, generator=gen, requires_grad=True)
    captured = {}
    hook = router_module(block).register_forward_hook(lambda m, i, o: captured.update(out=o))
    y = block(x)
    y = y[0] if isinstance(y, tuple) else y
    hook.remove()
    cotangent = torch.randn(y.shape, generator=gen)
    (y * cotangent).sum().backward()
    io = {"x": x, "cotangent": cotangent, "y": y, "dx": x.grad}
    if family == "switch":
        one_hot, top_prob, logits = captured["out"]
        e = logits.shape[-1]
        io["logits"] = logits.reshape(-1, e)
        io["topk_index"] = logits.reshape(-1, e).argmax(-1, keepdim=True)
        io["topk_weight"] = top_prob.reshape(-1, 1)
        io["dropped"] = (one_hot.reshape(-1, e).sum(-1, keepdim=True) == 0).to(torch.uint8)
    else:
        logits, weights, index = captured["out"]
        io.update(logits=logits, topk_index=index.to(torch.int64), topk_weight=weights)
    prefix = FUSED_PREFIX if family != "switch" else SAVED_PREFIX["switch"]
    for name, p in block.named_parameters():
        io[f"grad.{prefix}{name}"] = p.grad
    return {k: v.detach().contiguous().clone() for k, v in io.items()}


def saved_block(model, prefix):
    """The block's tensors as `save_pretrained` writes them."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with safe_open(f"{tmp}/model.safetensors", "pt") as f:
            return {k: f.get_tensor(k).clone() for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118


def check_features(family, io, state):
    """The data exercise the family's features (else the comparison could not fail on them)."""
    if family == "switch":
        dropped = io["dropped"].bool()
        assert dropped.any() and not dropped.all(), "switch: no token dropped / all dropped"
    if family == "gpt_oss":
        limit = CONFIGS[family]["swiglu_limit"]
        x = io["x"].reshape(-1, io["x"].shape[-1])
        gate_up = torch.einsum("td,edf->etf", x, state[FUSED_PREFIX + "experts.gate_up_proj"])
        gate_up = gate_up + state[FUSED_PREFIX + "experts.gate_up_proj_bias"][:, None]
        assert (gate_up[..., ::2] > limit).any() and (gate_up[..., 1::2].abs() > limit).any()


# The order the one generator draws for the families: a family added later comes last, so the
# earlier families' fixtures stay as they were.
ORDER = ("deepseek_v3", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "switch",
         "glm4_moe", "deepseek_v2", "minimax_m2", "glm4_moe_lite")  # fmt: skip


def main():
    assert sorted(ORDER) == sorted(CONFIGS), "add the new family at the end of ORDER"
    if OUT.exists():
        shutil.rmtree(OUT)
    gen = torch.Generator().manual_seed(0)
    for family in ORDER:
        torch.manual_seed(0)
        model, block = build(family)
        randomize(family, block, gen)
        out = OUT / family
        out.mkdir(parents=True)
        io = run(family, block, gen)
        state = {FUSED_PREFIX + k: v.detach().clone() for k, v in block.state_dict().items()}
        check_features(family, io, state)
        prefix = SAVED_PREFIX.get(family, FUSED_PREFIX)
        saved = saved_block(model, prefix)
        assert saved, f"{family}: nothing saved under {prefix}"
        fused_names = any(k.endswith("experts.gate_up_proj") for k in saved)
        if family == "switch" or not fused_names:  # save_pretrained wrote the per-expert layout
            save_file(saved, str(out / "per_expert.safetensors"), metadata={"format": "pt"})
        if family != "switch":
            save_file(state, str(out / "fused.safetensors"), metadata={"format": "pt"})
        save_file(io, str(out / "io.safetensors"), metadata={"format": "pt"})
        model.config.to_json_file(out / "config.json")
        print(family, sorted(p.name for p in out.iterdir()))
    manifest = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "script": "tests/interop/make_hf_fixtures.py",
        "B": B,
        "S": S,
    }
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"{total / 1e3:.0f} kB in {OUT}")


if __name__ == "__main__":
    main()
