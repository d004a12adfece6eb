"""Write `hf_model_fixtures.npz`: logits, top-k choices and gradients of tiny random Mixtral,
Qwen3-MoE, OLMoE and Qwen2-MoE models computed by transformers on torch CPU in fp32, which
`test_hf_fidelity.py` compares moejax's against (CI then needs neither torch nor transformers).

  # from the repository root, with moejax's venv; --hf-python: a python with torch+transformers
  PYTHONPATH=$PWD python tests/interop/make_hf_model_fixtures.py --hf-python /path/to/bin/python

Two halves: with moejax's python it writes each family's checkpoint directory (the weights of
`_hf_decoder_reference.random_state_dict(config, seed)`, bf16, as published checkpoints are)
and the tokens and loss weights; then it runs itself under `--hf-python` (`--torch DIR`), which
loads each directory with `AutoModelForCausalLM.from_pretrained(dtype=float32,
attn_implementation="eager")`, computes logits `[B, S, V]`, every MoE layer's top-k expert
indices `[T, K]` (`output_router_logits`), and the gradients of `sum(logits * R)` for every
parameter (transformers 5 names: experts fused as `mlp.experts.gate_up_proj`/`down_proj`).
The weights are not stored (the test rebuilds them from the seed); their sha256 is.

Written with transformers 5.24.0, torch 2.14.1 (CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "hf_model_fixtures.npz")
FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
SEED = {"mixtral": 11, "qwen3_moe": 12, "olmoe": 13, "qwen2_moe": 14}
BATCH, SEQ = 2, 10
# rope_scaling cases (head_dim 64, rope_theta 5e5, max_position_embeddings 16384): transformers'
# inverse frequencies and attention factor of each (`ROPE_INIT_FUNCTIONS`)
ROPE = {"head_dim": 64, "rope_theta": 500000.0, "max_position_embeddings": 16384}
ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn_no_original": {"rope_type": "yarn", "factor": 4.0},
    "yarn_ratio": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn_mscale": {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
    },
}  # fmt: skip


def weights_sha256(sd: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(sd):
        h.update(name.encode())
        h.update(np.ascontiguousarray(sd[name]).tobytes())
    return h.hexdigest()


def inputs(config: dict, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`tokens [B, S]` and the loss weights `R [B, S, V]` of one family."""
    rng = np.random.default_rng(seed + 100)
    tokens = rng.integers(0, config["vocab_size"], (BATCH, SEQ))
    pad = config.get("pad_token_id")
    if pad is not None:  # torch's Embedding(padding_idx) gives the pad row no gradient
        tokens[tokens == pad] = (pad + 1) % config["vocab_size"]
    r = rng.standard_normal((BATCH, SEQ, config["vocab_size"])).astype(np.float32)
    return tokens, r


def _write_dirs(root: str) -> dict:
    sys.path.insert(0, HERE)
    import _hf_decoder_reference as ref

    hashes = {}
    for family in FAMILIES:
        config = ref.CONFIGS[family]
        sd = ref.random_state_dict(config, seed=SEED[family])
        ref.write_checkpoint(os.path.join(root, family), config, sd, shards=2)
        tokens, r = inputs(config, SEED[family])
        np.save(os.path.join(root, family, "tokens.npy"), tokens)
        np.save(os.path.join(root, family, "r.npy"), r)
        hashes[family] = weights_sha256(sd)
    return hashes


def _torch_half(root: str, out: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    arrays = {}
    for family in FAMILIES:
        path = os.path.join(root, family)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
        tokens = torch.tensor(np.load(os.path.join(path, "tokens.npy")))
        r = torch.tensor(np.load(os.path.join(path, "r.npy")))
        result = model(input_ids=tokens, output_router_logits=True)
        (result.logits * r).sum().backward()
        arrays[f"{family}/logits"] = result.logits.detach().numpy()
        k = model.config.num_experts_per_tok
        for j, router_logits in enumerate(result.router_logits):
            probs = torch.softmax(router_logits.float(), dim=-1)
            arrays[f"{family}/topk/{j}"] = torch.topk(probs, k, dim=-1).indices.numpy()
        for name, p in model.named_parameters():
            arrays[f"{family}/grad/{name}"] = p.grad.numpy()
    from transformers import Qwen3MoeConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for case, scaling in ROPE_CASES.items():
        config = Qwen3MoeConfig(
            hidden_size=256,
            num_attention_heads=4,
            head_dim=ROPE["head_dim"],
            max_position_embeddings=ROPE["max_position_embeddings"],
            rope_scaling=dict(scaling, rope_theta=ROPE["rope_theta"]),
        )
        inv_freq, attention = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
        arrays[f"rope/{case}/inv_freq"] = inv_freq.numpy()
        arrays[f"rope/{case}/attention_factor"] = np.array(attention)
    versions = f"transformers {transformers.__version__}, torch {torch.__version__}"
    arrays["versions"] = np.array(versions)
    np.savez_compressed(out, **arrays)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-python", help="a python with torch and transformers")
    p.add_argument("--torch", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torch:
        return _torch_half(*args.torch)
    with tempfile.TemporaryDirectory() as root:
        hashes = _write_dirs(root)
        raw = os.path.join(root, "torch.npz")
        subprocess.run([args.hf_python, __file__, "--torch", root, raw], check=True)
        arrays = dict(np.load(raw))
    arrays["weights_sha256"] = np.array(json.dumps(hashes))
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes): {arrays['versions']}")


if __name__ == "__main__":
    main()
