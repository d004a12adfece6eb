"""Write `hf_model_fixtures.npz`: logits, top-k choices and gradients of tiny random Mixtral,
Qwen3-MoE, OLMoE and Qwen2-MoE models computed by transformers on torch CPU in fp32, which
`test_hf_fidelity.py` compares moejax's against (CI then needs neither torch nor transformers);
and `hf_dense_fixtures.npz`: the same (no top-k) for tiny dense Llama, Qwen2 and Qwen3 models,
for `test_hf_dense.py` (the dense section below).

  # from the repository root, with moejax's venv; --hf-python: a python with torch+transformers
  PYTHONPATH=$PWD python tests/interop/make_hf_model_fixtures.py --hf-python /path/to/bin/python
  # one file only: add --part moe or --part dense

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


# ---------------------------------------------------------------------------------------------
# Dense decoders (Llama, Qwen2, Qwen3): the sources `moejax.models.upcycle` starts from. Written
# to their own file, `DENSE_OUT`: logits `[B, S, V]` and the gradients of `sum(logits * R)` for
# every parameter, per family (`--part dense` remakes only it; written with transformers 5.18.0,
# torch 2.14.1).

DENSE_OUT = os.path.join(HERE, "hf_dense_fixtures.npz")
_DENSE_BASE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# Each covers what the others do not: Llama's llama3 rope scaling and biases on q/k/v and o
# (`attention_bias`), Qwen2's q/k/v-only biases and tied embeddings, Qwen3's per-head q/k norms,
# head_dim != hidden / heads and yarn scaling. The ramps' bounds (original length 16) fall
# inside the head's frequencies, so both ends and the ramp are exercised.
DENSE_CONFIGS = {
    "llama": _DENSE_BASE
    | {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },
        "attention_bias": True,
        "mlp_bias": False,
        "rms_norm_eps": 1e-5,
    },
    "qwen2": _DENSE_BASE
    | {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
    },
    "qwen3": _DENSE_BASE
    | {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "head_dim": 16,
        "rope_theta": 1000000.0,
        "rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        },
        "attention_bias": False,
        "use_sliding_window": False,
    },
}  # fmt: skip
DENSE_SEED = {"llama": 21, "qwen2": 22, "qwen3": 23}


def _write_dense_dirs(root: str) -> dict:
    sys.path.insert(0, HERE)
    import _hf_decoder_reference as ref

    hashes = {}
    for family, config in DENSE_CONFIGS.items():
        sd = ref.random_state_dict(config, seed=DENSE_SEED[family])
        ref.write_checkpoint(os.path.join(root, family), config, sd, shards=1)
        tokens, r = inputs(config, DENSE_SEED[family])
        np.save(os.path.join(root, family, "tokens.npy"), tokens)
        np.save(os.path.join(root, family, "r.npy"), r)
        hashes[family] = weights_sha256(sd)
    return hashes


def _torch_dense_half(root: str, out: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    arrays = {}
    for family in DENSE_CONFIGS:
        path = os.path.join(root, family)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
        assert type(model).__name__ == DENSE_CONFIGS[family]["architectures"][0]
        tokens = torch.tensor(np.load(os.path.join(path, "tokens.npy")))
        r = torch.tensor(np.load(os.path.join(path, "r.npy")))
        logits = model(input_ids=tokens).logits
        (logits * r).sum().backward()
        arrays[f"{family}/logits"] = logits.detach().numpy()
        for name, p in model.named_parameters():
            arrays[f"{family}/grad/{name}"] = p.grad.numpy()
    versions = f"transformers {transformers.__version__}, torch {torch.__version__}"
    arrays["versions"] = np.array(versions)
    np.savez_compressed(out, **arrays)


# ---------------------------------------------------------------------------------------------

PARTS = {  # part -> (writes the checkpoint directories, the torch half's flag, output file)
    "moe": (_write_dirs, "--torch", OUT),
    "dense": (_write_dense_dirs, "--torch-dense", DENSE_OUT),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-python", help="a python with torch and transformers")
    p.add_argument("--part", choices=sorted(PARTS), action="append", help="only these files")
    p.add_argument("--torch", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--torch-dense", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torch:
        return _torch_half(*args.torch)
    if args.torch_dense:
        return _torch_dense_half(*args.torch_dense)
    for part in args.part or PARTS:
        write_dirs, flag, out = PARTS[part]
        with tempfile.TemporaryDirectory() as root:
            hashes = write_dirs(root)
            raw = os.path.join(root, "torch.npz")
            subprocess.run([args.hf_python, __file__, flag, root, raw], check=True)
            arrays = dict(np.load(raw))
        arrays["weights_sha256"] = np.array(json.dumps(hashes))
        np.savez_compressed(out, **arrays)
        print(f"wrote {out} ({os.path.getsize(out)} bytes): {arrays['versions']}")


if __name__ == "__main__":
    main()
