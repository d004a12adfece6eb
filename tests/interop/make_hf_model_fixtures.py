"""Write `hf_model_fixtures.npz`: logits, top-k choices and gradients of tiny random Mixtral,
Qwen3-MoE, OLMoE and Qwen2-MoE models computed by transformers on torch CPU in fp32, which
`test_hf_fidelity.py` compares moejax's against (CI then needs neither torch nor transformers);
and `hf_model_fixtures_2026.npz`: the same for DeepSeek-V3 (MLA, a dense first layer, grouped
sigmoid routing, shared experts, and its multi-token-prediction layer through transformers'
`MtpModel`), GPT-OSS (sinks, sliding windows shorter than the sequence) and GLM-4.5 (q/k/v
biases, per-head q/k norms, RoPE over half of each head, DeepSeek-V3's routing and its MTP layer)
and DeepSeek-V2-Lite (MLA with a full-rank query, scaled softmax routing), MiniMax-M2 (q/k
norms over all heads with grouped-query attention, `rotary_dim`, sigmoid routing with the
correction bias) and GLM-4.7-Flash (DeepSeek-V3's MLA, routing and MTP layer, whose MTP
transformers reads only when told its fields), plus the tokens of transformers' greedy
`generate` for Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS, GLM-4.5, DeepSeek-V2, MiniMax-M2 and
GLM-4.7-Flash; and
`hf_dense_fixtures.npz`: logits and gradients of tiny dense Llama, Qwen2 and Qwen3 models, for
`test_hf_dense.py` (the dense section below).

  # from the repository root, with moejax's venv; --hf-python: a python with torch+transformers
  PYTHONPATH=$PWD python tests/interop/make_hf_model_fixtures.py --hf-python /path/to/bin/python
  # only the 2026 file (leaves hf_model_fixtures.npz as it is), or only the dense file
  PYTHONPATH=$PWD python tests/interop/make_hf_model_fixtures.py --hf-python ... --only-2026
  PYTHONPATH=$PWD python tests/interop/make_hf_model_fixtures.py --hf-python ... --only-dense

Two halves: with moejax's python it writes each family's checkpoint directory (the weights of
`_hf_decoder_reference.random_state_dict(config, seed)`, bf16, as published checkpoints are)
and the tokens and loss weights; then it runs itself under `--hf-python` (`--torch DIR`), which
loads each directory with `AutoModelForCausalLM.from_pretrained(dtype=float32,
attn_implementation="eager")`, computes logits `[B, S, V]`, every MoE layer's top-k expert
indices `[T, K]` (`output_router_logits`), and the gradients of `sum(logits * R)` for every
parameter (transformers 5 names: experts fused as `mlp.experts.gate_up_proj`/`down_proj`).
The weights are not stored (the test rebuilds them from the seed); their sha256 is.

The 2026 file: DeepSeek-V3's and GLM-4.5's tokens are `[B, S + 1]`, the main model reads the
first `S` and its MTP layer the embeddings of tokens `1..S` with the main model's last hidden
state (before the final norm), its logits `mtp_logits [B, S, V]`; gradients are of
`sum(logits * R)` alone (`grad/`: the model with MTP off) and of `sum(logits * R) +
sum(mtp_logits * R_mtp)` (`grad_mtp/`, every parameter, MTP layer named as stored:
`model.layers.{L}.`); `mtp_logits_final_norm` are the MTP layer's logits from the final-normed
state instead (`model.model.norm(h)`), what serving stacks pass a draft layer. Greedy `generate`
tokens of OLMoE and Qwen2-MoE were added later (every other array bit-identical).

Written with transformers 5.24.0, torch 2.14.1 (CPU), both files (the 2026 file's DeepSeek-V3
and GPT-OSS arrays are bit-identical to those transformers 5.18.0 wrote).
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
OUT_2026 = os.path.join(HERE, "hf_model_fixtures_2026.npz")
FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
FAMILIES_2026 = ("deepseek_v3", "gpt_oss", "glm4_moe", "deepseek_v2", "minimax_m2",
                 "glm4_moe_lite")  # fmt: skip
GENERATE = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe", "deepseek_v2",
            "minimax_m2", "glm4_moe_lite", "olmoe", "qwen2_moe")  # fmt: skip
SEED = {"mixtral": 11, "qwen3_moe": 12, "olmoe": 13, "qwen2_moe": 14, "deepseek_v3": 15,
        "gpt_oss": 16, "glm4_moe": 17, "deepseek_v2": 18, "minimax_m2": 19,
        "glm4_moe_lite": 20}  # fmt: skip
BATCH, SEQ = 2, 10
PROMPT, NEW_TOKENS = 5, 8  # greedy generation: [B, PROMPT] prompts, NEW_TOKENS tokens
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


def inputs_2026(config: dict, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`tokens [B, S + 1]` (the main model reads `[:, :S]`), `R [B, S, V]` and `R_mtp [B, S,
    V]` of a 2026 family."""
    rng = np.random.default_rng(seed + 100)
    tokens = rng.integers(0, config["vocab_size"], (BATCH, SEQ + 1))
    r = rng.standard_normal((2, BATCH, SEQ, config["vocab_size"])).astype(np.float32)
    return tokens, r[0], r[1]


def prompt(config: dict, seed: int) -> np.ndarray:
    """The `[B, PROMPT]` prompt greedy generation starts from."""
    return np.random.default_rng(seed + 200).integers(0, config["vocab_size"], (BATCH, PROMPT))


def _write_dirs(root: str) -> dict:
    sys.path.insert(0, HERE)
    import _hf_decoder_reference as ref

    hashes = {}
    for family in (*FAMILIES, *FAMILIES_2026):
        config = {**ref.CONFIGS, **ref.CONFIGS_2026}[family]
        sd = ref.random_state_dict(config, seed=SEED[family])
        ref.write_checkpoint(os.path.join(root, family), config, sd, shards=2)
        tokens, r, *r_mtp = (inputs if family in FAMILIES else inputs_2026)(config, SEED[family])
        np.save(os.path.join(root, family, "tokens.npy"), tokens)
        np.save(os.path.join(root, family, "r.npy"), r)
        np.save(os.path.join(root, family, "r_mtp.npy"), (r_mtp or [r])[0])
        np.save(os.path.join(root, family, "prompt.npy"), prompt(config, SEED[family]))
        hashes[family] = weights_sha256(sd)
    return hashes


def _topk_hooks(model, seen: list):
    """Record the expert indices every router of `model` returns (DeepSeek-V3's and GPT-OSS's
    router modules return `(logits, weights or scores, indices)`)."""
    for module in model.modules():
        if type(module).__name__.lower().endswith("topkrouter"):
            module.register_forward_hook(lambda m, args, out: seen.append(out[-1].detach()))


def _mtp_logits(model, mtp, tokens, h):
    """transformers' MTP layer (`MtpModel.layers[0]`, its post-norm and the shared head) over
    the embeddings of `tokens [B, S]` (positions 1..S) and the main model's last hidden state
    `h [B, S, D]` (before the final norm), causal over all `S` positions."""
    import torch

    s = tokens.shape[1]
    emb = mtp.embed_tokens(tokens)
    pos = torch.arange(s)[None]
    mask = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None]
    hk = mtp.layers[0](emb, h, position_embeddings=mtp.rotary_emb(emb, position_ids=pos),
                       attention_mask=mask, position_ids=pos, past_key_values=None)  # fmt: skip
    return mtp._project_to_logits(hk)


def _torch_2026(root: str, arrays: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    for family in FAMILIES_2026:
        path = os.path.join(root, family)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
        seen = []
        _topk_hooks(model, seen)
        tokens = torch.tensor(np.load(os.path.join(path, "tokens.npy")))
        r = torch.tensor(np.load(os.path.join(path, "r.npy")))
        hidden = []
        model.model.layers[-1].register_forward_hook(lambda m, a, out, h=hidden: h.append(out))
        logits = model(input_ids=tokens[:, :SEQ]).logits
        arrays[f"{family}/logits"] = logits.detach().numpy()
        for j, index in enumerate(seen):
            arrays[f"{family}/topk/{j}"] = np.sort(index.numpy(), axis=-1)
        params = dict(model.named_parameters())
        loss = (logits * r).sum()
        grads = torch.autograd.grad(loss, list(params.values()), retain_graph=True)
        arrays.update({f"{family}/grad/{n}": g.numpy() for n, g in zip(params, grads, strict=True)})
        if not model.config.to_dict().get("num_nextn_predict_layers"):
            continue
        n_layers = model.config.num_hidden_layers
        # transformers finds MTP weights by the main model's ignore patterns (`layers\.61`)
        model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n_layers}\..*"]
        if family == "glm4_moe_lite":  # its config has no MTP fields; its layer is DeepSeek's
            n_mtp = model.config.num_nextn_predict_layers
            model.config.num_mtp_layers = n_mtp
            model.config.mtp_mlp_layer_types = ["sparse"] * n_mtp
        mtp = MtpModel.from_pretrained(model)
        mtp.set_attn_implementation("eager")
        mtp.eval()
        mtp_logits = _mtp_logits(model, mtp, tokens[:, 1:], hidden[0])
        arrays[f"{family}/mtp_logits"] = mtp_logits.detach().numpy()
        # as the serving stacks draft: from the final-normed state the head reads
        normed = _mtp_logits(model, mtp, tokens[:, 1:], model.model.norm(hidden[0]))
        arrays[f"{family}/mtp_logits_final_norm"] = normed.detach().numpy()
        shared = {id(p) for p in params.values()}
        own = {
            f"model.layers.{n_layers}."
            + n.split(".", 2)[2]
            .replace("mtp_block.", "")
            .replace("post_norm.", "shared_head.norm."): p
            for n, p in mtp.named_parameters()
            if id(p) not in shared
        }
        r_mtp = torch.tensor(np.load(os.path.join(path, "r_mtp.npy")))
        total = loss + (mtp_logits * r_mtp).sum()
        both = {**params, **own}
        grads = torch.autograd.grad(total, list(both.values()))
        named = zip(both, grads, strict=True)
        arrays.update({f"{family}/grad_mtp/{n}": g.numpy() for n, g in named})
    for family in GENERATE:
        path = os.path.join(root, family)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
        model.generation_config.eos_token_id = None  # all NEW_TOKENS, no early stop
        ids = torch.tensor(np.load(os.path.join(path, "prompt.npy")))
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        arrays[f"generate/{family}"] = out.numpy()


def _torch_half(root: str, out: str, only_2026: bool = False) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    versions = f"transformers {transformers.__version__}, torch {torch.__version__}"
    if only_2026:
        arrays = {"versions": np.array(versions)}
        _torch_2026(root, arrays)
        np.savez_compressed(out, **arrays)
        return
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
# every parameter, per family (`--only-dense` remakes only it; written with transformers 5.18.0,
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


def _write_dense(hf_python: str) -> None:
    """`DENSE_OUT`, both halves."""
    with tempfile.TemporaryDirectory() as root:
        hashes = _write_dense_dirs(root)
        raw = os.path.join(root, "torch.npz")
        subprocess.run([hf_python, __file__, "--torch-dense", root, raw], check=True)
        arrays = dict(np.load(raw))
    arrays["weights_sha256"] = np.array(json.dumps(hashes))
    np.savez_compressed(DENSE_OUT, **arrays)
    print(f"wrote {DENSE_OUT} ({os.path.getsize(DENSE_OUT)} bytes): {arrays['versions']}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-python", help="a python with torch and transformers")
    p.add_argument("--only-2026", action="store_true", help=f"write only {OUT_2026}")
    p.add_argument("--only-dense", action="store_true", help=f"write only {DENSE_OUT}")
    p.add_argument("--torch", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--torch-dense", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torch:
        return _torch_half(*args.torch, only_2026=args.only_2026)
    if args.torch_dense:
        return _torch_dense_half(*args.torch_dense)
    if not args.only_2026:
        _write_dense(args.hf_python)
    if args.only_dense:
        return None
    parts = [(True, OUT_2026, FAMILIES_2026)]
    if not args.only_2026:
        parts.insert(0, (False, OUT, FAMILIES))
    with tempfile.TemporaryDirectory() as root:
        hashes = _write_dirs(root)
        for only_2026, out, families in parts:
            raw = os.path.join(root, "torch.npz")
            flag = ["--only-2026"] if only_2026 else []
            subprocess.run([args.hf_python, __file__, "--torch", root, raw, *flag], check=True)
            arrays = dict(np.load(raw))
            arrays["weights_sha256"] = np.array(json.dumps({f: hashes[f] for f in families}))
            np.savez_compressed(out, **arrays)
            print(f"wrote {out} ({os.path.getsize(out)} bytes): {arrays['versions']}")


if __name__ == "__main__":
    main()
