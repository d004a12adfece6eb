"""Whole MoE decoders (and dense ones: Llama, Qwen2, Qwen3) from and to Hugging Face checkpoint
directories, streamed tensor by tensor.

A directory holds `config.json` and `model.safetensors` or shards with
`model.safetensors.index.json`. `load_hf_model` reads it one *recipe* at a time: a recipe ties
a few Hugging Face tensors to a few leaves of the `moejax.models` parameter tree (e.g. the `E`
per-expert `gate_proj` matrices of a layer to `experts/w_gate [E, D, F]`) with the reshape and
transpose both ways, so one table serves loading and saving. Each recipe's leaves go straight
onto their target `NamedSharding` (`moejax.models.lm_partition_specs`: experts over `expert`,
`D` over `fsdp`, ...), and under dynamic placement experts are laid out as physical slots
(`w[slot_to_expert]`). On a mesh, expert leaves are built device block by device block
(`jax.make_array_from_callback`) from the rows of the experts each block holds: a process reads
only the experts its devices hold (under `jax.distributed`, its share), each once. The host
holds the tensors of one recipe at a time (at most one layer's experts of one projection),
never the whole model. Saving gathers one leaf at a time to the host (one process).

Hugging Face tensor names (torch `Linear` weights are `[out, in]`), layer prefix
`model.layers.{i}.`:

```
embed/embedding [V, D]                model.embed_tokens.weight [V, D]
layers[i]/attn_norm/scale             input_layernorm.weight
layers[i]/attn/wq [D, H, Dh]          self_attn.q_proj.weight [H*Dh, D]   (wk, wv: k_proj, v_proj)
layers[i]/attn/wo [H, Dh, D]          self_attn.o_proj.weight [D, H*Dh]
layers[i]/attn/bq [H, Dh]             self_attn.q_proj.bias [H*Dh]        (bk, bv; bo: o_proj.bias)
layers[i]/attn/q_norm/scale           self_attn.q_norm.weight             (k_norm)
layers[i]/attn/sinks [H]              self_attn.sinks [H]                 (GPT-OSS)
layers[i]/attn/wq_a [D, Rq]           self_attn.q_a_proj.weight [Rq, D]   (MLA, DeepSeek-V3)
layers[i]/attn/q_a_norm/scale         self_attn.q_a_layernorm.weight
layers[i]/attn/wq_b [Rq, H, Dqk]      self_attn.q_b_proj.weight [H*Dqk, Rq]   (or wq: q_proj)
layers[i]/attn/wkv_a [D, Rkv+Dr]      self_attn.kv_a_proj_with_mqa.weight [Rkv+Dr, D]
layers[i]/attn/kv_a_norm/scale        self_attn.kv_a_layernorm.weight
layers[i]/attn/wkv_b [Rkv, H, Dn+Dv]  self_attn.kv_b_proj.weight [H*(Dn+Dv), Rkv]
layers[i]/ffn_norm/scale              post_attention_layernorm.weight
layers[i]/mlp/w_gate [D, F]           mlp.gate_proj.weight [F, D]         (w_up, w_down)
layers[i]/moe/router/kernel [D, E]    {moe}.gate.weight [E, D]
layers[i]/moe/experts/w_gate [E,D,F]  {moe}.experts.{e}.{gate}.weight [F, D], e < E  (w_up: up)
                                      fused: mlp.experts.gate_up_proj [E, 2F, D] (gate, then up)
layers[i]/moe/experts/w_down [E,F,D]  {moe}.experts.{e}.{down}.weight [D, F]
                                      fused: mlp.experts.down_proj [E, D, F]
layers[i]/moe/shared/w_gate [D, Fs]   mlp.shared_expert.gate_proj.weight  (Qwen2-MoE; up, down)
layers[i]/moe/shared/gate [D, 1]      mlp.shared_expert_gate.weight [1, D]
layers[i]/moe/router/bias [E]         mlp.router.bias (GPT-OSS; experts fused interleaved + biases)
layers[i]/moe/router/score_correction_bias   mlp.gate.e_score_correction_bias [E] (float32)
final_norm/scale                      model.norm.weight
unembed/kernel [D, V]                 lm_head.weight [V, D]               (absent when tied)
mtp[k]/enorm, hnorm/scale             model.layers.{L+k}.enorm.weight, hnorm.weight
mtp[k]/eh_proj/kernel [2D, D]         model.layers.{L+k}.eh_proj.weight [D, 2D]
mtp[k]/block/...                      model.layers.{L+k}.* as a layer's
mtp[k]/norm/scale                     model.layers.{L+k}.shared_head.norm.weight
(embed, unembed again)                model.layers.{L+k}.embed_tokens, shared_head.head .weight
```

`{moe}` and the expert projection names are the family's (`FAMILIES`: `block_prefix`,
`HFFamily.projections`), as in the block mapping (`block_to_hf`). The per-expert layout
is the one of the published checkpoints; the fused one is transformers 5's in-memory layout.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable

import jax
import numpy as np

from moejax.interop.hf._config import CONFIG_FILE, lm_config_from_hf, read_config, stored_dtype
from moejax.interop.hf._errors import CheckpointError
from moejax.interop.hf._families import (
    FAMILIES,
    FLOAT_DTYPES,
    LAYOUTS,
    Layout,
    block_prefix,
    check_layout,
)
from moejax.interop.hf._fp8 import (
    FP8_DTYPES,
    SCALE_SUFFIX,
    dequantize_fp8,
    fp8_block_size,
    without_quantization,
)
from moejax.interop.hf._safetensors import DTYPES, SafetensorsCheckpoint
from moejax.interop.hf._writer import CheckpointWriter
from moejax.models import LMConfig, abstract_params

Path = tuple  # a leaf's keys in the parameter tree, e.g. ("layers", 3, "attn", "wq")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Some leaves of the parameter tree <-> some Hugging Face tensors.

    `to_leaves(tensors) -> leaves` and `to_tensors(leaves) -> tensors` are inverse
    reshapes/transposes/stacks (numpy, exact). Expert recipes (leaves `[E, ...]`) also have
    `expert_row(read, e) -> [row e of each leaf]`, reading only expert `e`'s bytes through
    `read(name, shape, row=None)` (`SafetensorsCheckpoint.read`), so a process reads only the
    experts its devices hold.
    """

    leaves: tuple[Path, ...]
    tensors: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # of the tensors, as stored
    to_leaves: Callable
    to_tensors: Callable
    expert_row: Callable | None = None


def _one(leaf: Path, name: str, shape, to_leaf=lambda t: t, to_tensor=lambda x: x) -> Recipe:
    return Recipe(
        (leaf,), (name,), (tuple(shape),),
        lambda ts: [to_leaf(ts[0])], lambda xs: [to_tensor(xs[0])],
    )  # fmt: skip


def _linear(leaf: Path, name: str, out_in: tuple[int, int], leaf_shape) -> Recipe:
    """A torch Linear weight `[out, in]` <-> a leaf whose flattened form is `[in, out]`."""
    return _one(
        leaf,
        name,
        out_in,
        lambda t: t.T.reshape(leaf_shape),
        lambda x: x.reshape(out_in[1], out_in[0]).T,
    )


def _reshaped(leaf: Path, name: str, shape, leaf_shape) -> Recipe:
    return _one(leaf, name, shape, lambda t: t.reshape(leaf_shape), lambda x: x.reshape(shape))


def _attention_recipes(cfg: LMConfig, leaf: Path, pre: str) -> list[Recipe]:
    """One layer's attention: `leaf` its path in the tree (`("layers", i, "attn")`), `pre` its
    Hugging Face prefix (`model.layers.{i}.self_attn.`)."""
    if cfg.mla is not None:
        return _mla_recipes(cfg, leaf, pre)
    d, h, hkv, dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    heads = {"q": h, "k": hkv, "v": hkv}
    out = [
        _linear((*leaf, f"w{n}"), f"{pre}{n}_proj.weight", (heads[n] * dh, d), (d, heads[n], dh))
        for n in "qkv"
    ]
    out.append(_linear((*leaf, "wo"), f"{pre}o_proj.weight", (d, h * dh), (h, dh, d)))
    if cfg.attention_bias:
        out += [
            _reshaped((*leaf, f"b{n}"), f"{pre}{n}_proj.bias", (heads[n] * dh,), (heads[n], dh))
            for n in "qkv"
        ]
    if cfg.attention_out_bias:
        out.append(_one((*leaf, "bo"), f"{pre}o_proj.bias", (d,)))
    if cfg.attention_sinks:
        out.append(_one((*leaf, "sinks"), f"{pre}sinks", (h,)))
    if cfg.qk_norm is not None:
        for n in "qk":
            shape = (dh,) if cfg.qk_norm == "head" else (heads[n] * dh,)
            leaf_shape = (dh,) if cfg.qk_norm == "head" else (heads[n], dh)
            out.append(_reshaped((*leaf, f"{n}_norm", "scale"), f"{pre}{n}_norm.weight", shape,
                                 leaf_shape))  # fmt: skip
    return out


def _mla_recipes(cfg: LMConfig, leaf: Path, pre: str) -> list[Recipe]:
    """DeepSeek-V3's `DeepseekV3Attention` tensors (`moejax.models._mla` leaves); the rotary
    features stay interleaved as stored (the layer reorders them at run time)."""
    m, d, h = cfg.mla, cfg.d_model, cfg.num_heads
    qk, rkv = m.qk_head_dim, m.kv_lora_rank
    if m.q_lora_rank is None:
        out = [_linear((*leaf, "wq"), f"{pre}q_proj.weight", (h * qk, d), (d, h, qk))]
    else:
        rq = m.q_lora_rank
        out = [
            _linear((*leaf, "wq_a"), f"{pre}q_a_proj.weight", (rq, d), (d, rq)),
            _one((*leaf, "q_a_norm", "scale"), f"{pre}q_a_layernorm.weight", (rq,)),
            _linear((*leaf, "wq_b"), f"{pre}q_b_proj.weight", (h * qk, rq), (rq, h, qk)),
        ]
    kv_a = (rkv + m.qk_rope_head_dim, d)
    kv_b = (h * (m.qk_nope_head_dim + m.v_head_dim), rkv)
    return out + [
        _linear((*leaf, "wkv_a"), f"{pre}kv_a_proj_with_mqa.weight", kv_a, kv_a[::-1]),
        _one((*leaf, "kv_a_norm", "scale"), f"{pre}kv_a_layernorm.weight", (rkv,)),
        _linear((*leaf, "wkv_b"), f"{pre}kv_b_proj.weight", kv_b,
                (rkv, h, m.qk_nope_head_dim + m.v_head_dim)),
        _linear((*leaf, "wo"), f"{pre}o_proj.weight", (d, h * m.v_head_dim), (h, m.v_head_dim, d)),
    ]  # fmt: skip


def _mlp_recipes(leaf: Path, pre: str, d: int, f: int, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    return [
        _linear((*leaf, "w_gate"), f"{pre}{gate}.weight", (f, d), (d, f)),
        _linear((*leaf, "w_up"), f"{pre}{up}.weight", (f, d), (d, f)),
        _linear((*leaf, "w_down"), f"{pre}{down}.weight", (d, f), (f, d)),
    ]


def _stacked(leaf: Path, names: list[str], out_in: tuple[int, int]) -> Recipe:
    """`E` per-expert Linear weights `[out, in]` <-> `[E, in, out]`."""
    e = len(names)
    return Recipe(
        (leaf,),
        tuple(names),
        (tuple(out_in),) * e,
        lambda ts: [np.stack([t.T for t in ts])],
        lambda xs: [x.T for x in xs[0]],
        lambda read, j: [read(names[j], out_in).T],
    )


def _moe_recipes(cfg: LMConfig, family: str, leaf: Path, pre: str, layout: Layout) -> list:
    """One MoE block: `leaf` its path (`("layers", i, "moe")`), `pre` its prefix
    (`block_prefix`)."""
    fam = FAMILIES[family]
    d, f, e = cfg.d_model, cfg.moe.d_ff, cfg.moe.num_experts
    out = [_linear((*leaf, "router", "kernel"), f"{pre}{fam.router}.weight", (e, d), (d, e))]
    if cfg.moe.router_bias:
        out.append(_one((*leaf, "router", "bias"), f"{pre}{fam.router}.bias", (e,)))
    if cfg.moe.score_correction_bias:
        bias = (*leaf, "router", "score_correction_bias")
        out.append(_one(bias, pre + fam.correction_bias, (e,)))
    experts = (*leaf, "experts")
    if layout == "per_expert":
        gate, up, down = fam.projections
        names = lambda p: [pre + fam.expert_pattern.format(i=j, proj=p) for j in range(e)]  # noqa: E731
        out += [
            _stacked((*experts, "w_gate"), names(gate), (f, d)),
            _stacked((*experts, "w_up"), names(up), (f, d)),
            _stacked((*experts, "w_down"), names(down), (d, f)),
        ]
    elif fam.fused == "interleaved":
        out += _interleaved_recipes(experts, f"{pre}experts.", d, f, e)
    else:
        gate_up, down = f"{pre}experts.gate_up_proj", f"{pre}experts.down_proj"
        out.append(
            Recipe(
                ((*experts, "w_gate"), (*experts, "w_up")),
                (gate_up,),
                ((e, 2 * f, d),),
                lambda ts: [t.swapaxes(1, 2) for t in np.split(ts[0], 2, axis=1)],
                lambda xs: [np.concatenate([x.swapaxes(1, 2) for x in xs], axis=1)],
                lambda read, j: [t.T for t in np.split(read(gate_up, (e, 2 * f, d), j), 2)],
            )
        )
        out.append(
            Recipe(
                ((*experts, "w_down"),),
                (down,),
                ((e, d, f),),
                lambda ts: [ts[0].swapaxes(1, 2)],
                lambda xs: [xs[0].swapaxes(1, 2)],
                lambda read, j: [read(down, (e, d, f), j).T],
            )
        )
    if fam.shared:
        out += _mlp_recipes((*leaf, "shared"), f"{pre}{fam.shared}.", d, cfg.moe.shared_width)
    if fam.shared_gate:
        gate_name = f"{pre}{fam.shared_gate}.weight"
        out.append(_linear((*leaf, "shared", "gate"), gate_name, (1, d), (d, 1)))
    return out


def _interleaved_recipes(experts: Path, pre: str, d: int, f: int, e: int) -> list[Recipe]:
    """GPT-OSS's experts: `gate_up_proj [E, D, 2F]` and its bias `[E, 2F]` (gate at even, up at
    odd columns), `down_proj [E, F, D]` and its bias `[E, D]`, used as `x @ W` (no transpose)."""

    def split(pair: tuple[str, str], name: str, shape) -> Recipe:
        leaves = ((*experts, pair[0]), (*experts, pair[1]))
        return Recipe(
            leaves, (name,), (shape,),
            lambda ts: [ts[0][..., ::2], ts[0][..., 1::2]],
            lambda xs: [np.stack(xs, axis=-1).reshape(*xs[0].shape[:-1], 2 * f)],
            lambda read, j: (lambda t: [t[..., ::2], t[..., 1::2]])(read(name, shape, j)),
        )  # fmt: skip

    def whole(leaf: str, name: str, shape) -> Recipe:
        return Recipe(
            ((*experts, leaf),), (name,), (shape,),
            lambda ts: [ts[0]], lambda xs: [xs[0]], lambda read, j: [read(name, shape, j)],
        )  # fmt: skip

    return [
        split(("w_gate", "w_up"), f"{pre}gate_up_proj", (e, d, 2 * f)),
        split(("b_gate", "b_up"), f"{pre}gate_up_proj_bias", (e, 2 * f)),
        whole("w_down", f"{pre}down_proj", (e, f, d)),
        whole("b_down", f"{pre}down_proj_bias", (e, d)),
    ]


def _block_recipes(cfg, family, layout, leaf: Path, i: int, is_moe: bool) -> list[Recipe]:
    """One transformer block, leaves under `leaf`, Hugging Face layer `model.layers.{i}.`."""
    d, pre = cfg.d_model, f"model.layers.{i}."
    out = [_one((*leaf, "attn_norm", "scale"), f"{pre}input_layernorm.weight", (d,))]
    out += _attention_recipes(cfg, (*leaf, "attn"), f"{pre}self_attn.")
    out.append(_one((*leaf, "ffn_norm", "scale"), f"{pre}post_attention_layernorm.weight", (d,)))
    if is_moe:
        out += _moe_recipes(cfg, family, (*leaf, "moe"), block_prefix(family, i, layout), layout)
    else:
        out += _mlp_recipes((*leaf, "mlp"), f"{pre}mlp.", d, cfg.mlp_d_ff)
    return out


def _mtp_recipes(cfg: LMConfig, family: str, layout: Layout, k: int) -> list[Recipe]:
    """Multi-token-prediction block `k` (0-based), stored as DeepSeek-V3's layer
    `model.layers.{num_layers + k}.`: `enorm`, `hnorm`, `eh_proj [D, 2D]`, the block,
    `shared_head.norm`; and copies of the shared embedding and head (`mtp_copies`)."""
    d, i = cfg.d_model, cfg.num_layers + k
    pre, leaf = f"model.layers.{i}.", ("mtp", k)
    return [
        _one((*leaf, "enorm", "scale"), f"{pre}enorm.weight", (d,)),
        _one((*leaf, "hnorm", "scale"), f"{pre}hnorm.weight", (d,)),
        _linear((*leaf, "eh_proj", "kernel"), f"{pre}eh_proj.weight", (d, 2 * d), (2 * d, d)),
        *_block_recipes(cfg, family, layout, (*leaf, "block"), i, cfg.mtp_is_moe),
        _one((*leaf, "norm", "scale"), f"{pre}shared_head.norm.weight", (d,)),
    ]


def mtp_copies(cfg: LMConfig) -> dict[str, str]:
    """`{copy: original}`: DeepSeek-V3 checkpoints store each MTP layer's embedding and head,
    which the main model shares, again (`model.layers.{L + k}.embed_tokens.weight`,
    `shared_head.head.weight`). moejax keeps one of each: loading checks that a copy present
    equals its original, saving writes the copies."""
    head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    out = {}
    for i in range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers):
        out[f"model.layers.{i}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"model.layers.{i}.shared_head.head.weight"] = head
    return out


def default_layout(family: str) -> Layout:
    """The layout published `family` checkpoints use: per-expert where the family has it."""
    return "per_expert" if "per_expert" in FAMILIES[family].layouts else "fused"


def model_recipes(cfg: LMConfig, family: str, layout: Layout | None = None) -> list[Recipe]:
    """Every recipe of the model, in checkpoint order (embedding, layer by layer, head, then
    DeepSeek-V3's multi-token-prediction layers).

    Args:
      cfg: the model config; family: a key of `FAMILIES` with a decoder.
      layout: `"per_expert"` or `"fused"` (None: `default_layout(family)`).

    Raises:
      ValueError: an unknown layout or one the family lacks, or a family whose whole decoders
        moejax does not read.
    """
    layout = layout or default_layout(family)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: must be one of {LAYOUTS}")
    if FAMILIES[family].decoder is None:
        raise ValueError(f"family={family!r}: moejax reads its MoE blocks, not whole models")
    if not FAMILIES[family].dense:  # a dense model has no expert tensors: any layout names it
        check_layout(FAMILIES[family], layout)
    v, d = cfg.vocab_size, cfg.d_model
    out = [_one(("embed", "embedding"), "model.embed_tokens.weight", (v, d))]
    for i in range(cfg.num_layers):
        out += _block_recipes(cfg, family, layout, ("layers", i), i, cfg.is_moe(i))
    out.append(_one(("final_norm", "scale"), "model.norm.weight", (d,)))
    if not cfg.tie_embeddings:
        out.append(_linear(("unembed", "kernel"), "lm_head.weight", (v, d), (d, v)))
    for k in range(cfg.mtp_layers):
        out += _mtp_recipes(cfg, family, layout, k)
    return out


def tensor_names(cfg: LMConfig, family: str, layout: Layout | None = None) -> list[str]:
    """The Hugging Face tensor names of the model, in checkpoint order (with the MTP layers'
    copies of the embedding and head, `mtp_copies`, after each MTP layer's own)."""
    names = [n for r in model_recipes(cfg, family, layout) for n in r.tensors]
    return names + list(mtp_copies(cfg))


def _detect_layout(source: SafetensorsCheckpoint, cfg: LMConfig, family: str) -> Layout:
    if not cfg.moe_layers or len(FAMILIES[family].layouts) == 1:
        return default_layout(family)
    fused = block_prefix(family, cfg.moe_layers[0], "fused") + "experts.gate_up_proj"
    return "fused" if fused in source else "per_expert"


# Tensors Hugging Face keeps in float32 whatever the model's dtype (DeepSeek-V3's router bias
# buffer, `_keep_in_fp32_modules_strict`): saved as float32 when the parameter is.
FP32_TENSORS = ("e_score_correction_bias",)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _check_counts(source: SafetensorsCheckpoint, cfg: LMConfig, family: str) -> Layout:
    """The config's layer and expert counts must be the ones the files hold, before any name
    list or array is sized from them (a 500-byte config.json could otherwise ask for 10^8
    experts); returns the checkpoint's layout."""
    layers = {int(m.group(1)) for n in source.tensors if (m := _LAYER.match(n))}
    held = max(layers) + 1 if layers else 0
    if cfg.num_layers + cfg.mtp_layers != held:
        mtp = f" and {cfg.mtp_layers} MTP layers after them" if cfg.mtp_layers else ""
        hint = ""
        if cfg.mtp_layers and held == cfg.num_layers:
            hint = "; set num_nextn_predict_layers to 0 to load the model without MTP"
        raise CheckpointError(
            f"{CONFIG_FILE} num_hidden_layers={cfg.num_layers}{mtp}, but the checkpoint's "
            f"tensors name {held} layers (model.layers.<i>. up to {held - 1}){hint}",
            file=str(source.path),
        )
    layout = _detect_layout(source, cfg, family)
    if not cfg.moe_layers:
        return layout
    i = cfg.moe_layers[0]
    pre = block_prefix(family, i, layout) + "experts."
    if layout == "fused":
        shape = source.shape_of(pre + "gate_up_proj")
        held = shape[0] if shape else 0
    else:
        found = {n[len(pre) :].split(".", 1)[0] for n in source.tensors if n.startswith(pre)}
        held = max((int(e) + 1 for e in found if e.isdigit()), default=0)
    if cfg.moe.num_experts != held:
        raise CheckpointError(
            f"{CONFIG_FILE} says {cfg.moe.num_experts} experts, but the checkpoint holds "
            f"{held} in layer {i}",
            file=str(source.path),
        )
    return layout


def _float_reader(source: SafetensorsCheckpoint, block: tuple[int, int] | None = None):
    """`read(name, shape, row=None)` of model parameters: float tensors only; with `block`
    (an FP8 checkpoint's `weight_block_size`), FP8 weights with a `weight_scale_inv` are
    dequantized (`dequantize_fp8`) to float32."""

    def read(name: str, shape, row=None):
        if block is not None and source.dtype_of(name) in FP8_DTYPES:
            scale = name + "_scale_inv"
            if scale not in source:
                raise CheckpointError(
                    f"is FP8 but {scale!r} is not in the checkpoint", tensor=name,
                    file=source.file_of(name),
                )  # fmt: skip
            if row is not None:
                raise CheckpointError("FP8 tensors are read whole", tensor=name)
            return dequantize_fp8(source.read(name, shape), source.read(scale), block, name)
        if source.dtype_of(name) not in FLOAT_DTYPES:
            raise CheckpointError(
                f"has dtype {source.info(name).dtype}; model parameters are read from "
                f"{FLOAT_DTYPES}",
                tensor=name,
                file=source.file_of(name),
            )
        return source.read(name, shape, row)

    return read


def _check_copies(source: SafetensorsCheckpoint, cfg: LMConfig, read) -> None:
    """Each MTP copy of the embedding or head present in `source` equals its original."""
    for copy, original in mtp_copies(cfg).items():
        if copy not in source:
            continue
        shape = source.shape_of(original)
        a, b = read(copy, shape), read(original, shape)
        if a.dtype == b.dtype:  # bitwise, without a float32 copy of a [V, D] table
            a, b = a.view(np.uint8), b.view(np.uint8)
        if not np.array_equal(a, b):
            raise CheckpointError(
                f"differs from {original!r}; moejax shares one embedding and head between the "
                "model and its MTP layers (would need MTP layers with their own)",
                tensor=copy,
                file=source.file_of(copy),
            )


def _empty_tree(cfg: LMConfig) -> dict:
    tree = {"embed": {}, "layers": [{} for _ in range(cfg.num_layers)], "final_norm": {}}
    if not cfg.tie_embeddings:
        tree["unembed"] = {}
    if cfg.mtp_layers:
        tree["mtp"] = [{} for _ in range(cfg.mtp_layers)]
    return tree


def _set(tree, path: Path, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node[key] if isinstance(node, list) else node.setdefault(key, {})
    node[path[-1]] = value


def _get(tree, path: Path):
    for key in path:
        tree = tree[key]
    return tree


def _moe_index(cfg: LMConfig) -> dict[int, int]:
    return {layer: j for j, layer in enumerate(cfg.moe_layers)}


class _Placer:
    """Puts leaves (logical experts) onto their target sharding, experts as physical slots."""

    def __init__(self, cfg: LMConfig, mesh, placements, dtype):
        self.mesh, self.placements, self.dtype = mesh, placements, dtype
        self.specs = None
        if mesh is not None:
            from moejax.models import lm_partition_specs

            self.specs = lm_partition_specs(cfg, mesh)
        self.moe_index = _moe_index(cfg)

    def _table(self, path: Path):
        if self.placements is None or len(path) < 4 or path[3] != "experts":
            return None
        return np.asarray(self.placements[self.moe_index[path[1]]].slot_to_expert)

    def _sharding(self, path: Path):
        return jax.sharding.NamedSharding(self.mesh, _get(self.specs, path))

    def place(self, path: Path, array: np.ndarray) -> jax.Array:
        """A whole leaf read on the host; each device takes its slice of it."""
        array = np.ascontiguousarray(array.astype(self.dtype))
        table = self._table(path)
        if table is not None:
            array = np.take(array, table, axis=0)  # [P, ...] physical slots
        if self.mesh is None:
            return jax.device_put(array)
        return jax.make_array_from_callback(
            array.shape, self._sharding(path), lambda index: array[index]
        )

    def place_experts(self, recipe: Recipe, read, shapes: list[tuple[int, ...]]) -> list:
        """An expert recipe's leaves (logical shapes `shapes`, `[E, ...]`) built shard by shard:
        each device's slots are assembled from the rows of the experts they hold, and each
        expert is read once, only if one of this process's devices holds it."""
        rows: dict[int, list[np.ndarray]] = {}

        def expert(e: int) -> list[np.ndarray]:
            if e not in rows:  # as stored (bf16: half of fp32); cast per device block
                rows[e] = recipe.expert_row(read, e)
            return rows[e]

        out = []
        for j, (path, shape) in enumerate(zip(recipe.leaves, shapes, strict=True)):
            table = self._table(path)
            slots = np.arange(shape[0]) if table is None else table  # slot -> logical expert
            full = (len(slots), *shape[1:])

            def block(index, j=j, slots=slots):
                rest = tuple(index[1:])
                picked = [expert(int(e))[j][rest] for e in slots[index[0]]]
                return np.stack(picked).astype(self.dtype)

            out.append(jax.make_array_from_callback(full, self._sharding(path), block))
        return out


def load_hf_model(
    path: str,
    *,
    mesh=None,
    placements=None,
    param_dtype: str = "float32",
    progress: bool = False,
    allow_nonfinite: bool = False,
) -> tuple[LMConfig, dict, dict]:
    """Read a Hugging Face MoE decoder directory (or a dense Llama, Qwen2, Qwen3 one: every layer
    `"dense"`) into a `moejax.models` parameter tree.

    Tensors are read one recipe at a time and each leaf is put straight onto its target
    sharding (module docstring); the host never holds more than one recipe's tensors.

    Args:
      path: a directory with `config.json` and safetensors weights (one file or shards).
      mesh: None (the default device), or a `moejax.parallel` mesh: every leaf lands on its
        `moejax.models.lm_partition_specs` sharding.
      placements: None (experts in logical order), or one `moejax.placement.Placement` per MoE
        layer: that layer's `experts/*` are stored as physical slots `w[slot_to_expert]`.
      param_dtype: dtype of the returned parameters ("float32" or "bfloat16").
      progress: show a tqdm progress bar over the tensors.
      allow_nonfinite: load tensors holding NaN or Inf (default: `NonFiniteError` naming the
        tensor and the count).

    Returns:
      `(LMConfig, params, hf_config)`; `hf_config` is the `config.json` dict, which
      `save_hf_model` writes back.

    Raises:
      CheckpointError (a ValueError): missing files, a file that fails validation
        (`SafetensorsCheckpoint`), a missing or extra tensor, a wrong shape, a dtype that is
        not a float, NaN or Inf, an unsupported config or one whose layer or expert count is
        not what the files hold; the message names the file and the tensor (or the field).
    """
    if not os.path.isdir(path):
        what = "missing" if not os.path.lexists(path) else "not a directory"
        raise CheckpointError(f"{what}; need a Hugging Face checkpoint directory", file=str(path))
    hf_config = read_config(path)
    block = fp8_block_size(hf_config)
    if block is not None:
        hf_config = without_quantization(hf_config)
    cfg, family = lm_config_from_hf(hf_config, param_dtype=param_dtype)
    source = SafetensorsCheckpoint(path, allow_nonfinite=allow_nonfinite)
    layout = _check_counts(source, cfg, family)  # before anything is sized from the config
    if placements is not None and len(placements) != cfg.num_moe_layers:
        raise ValueError(
            f"len(placements)={len(placements)}: need one per MoE layer ({cfg.num_moe_layers})"
        )
    recipes = model_recipes(cfg, family, layout)
    expected = {n for r in recipes for n in r.tensors} | set(mtp_copies(cfg))
    if block is not None:  # every weight may have its scales
        expected |= {n + SCALE_SUFFIX for n in expected}
    unexpected = sorted(n for n in source.tensors if n not in expected)
    if cfg.tie_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # some tied checkpoints store the copy too
    if unexpected:
        raise CheckpointError(
            f"(and {len(unexpected) - 1} more) not part of a {family} model with this "
            f"{CONFIG_FILE}",
            tensor=unexpected[0],
            file=source.file_of(unexpected[0]),
        )
    read = _float_reader(source, block)
    _check_copies(source, cfg, read)
    if block is not None:
        print(
            f"moejax: {path}: FP8 weights (e4m3, {block[0]}x{block[1]} block scales) "
            f"dequantized to {param_dtype} on load; save_hf_model writes them unquantized",
            file=sys.stderr,
            flush=True,
        )
    dtype = np.dtype(param_dtype if param_dtype != "bfloat16" else DTYPES["BF16"])
    placer = _Placer(cfg, mesh, placements, dtype)
    abstract = abstract_params(cfg) if mesh is not None else None
    tree = _empty_tree(cfg)
    for recipe in _progress(recipes, progress, "load"):
        if mesh is not None and recipe.expert_row is not None:
            shapes = [_get(abstract, p).shape for p in recipe.leaves]
            arrays = placer.place_experts(recipe, read, shapes)
            for leaf, array in zip(recipe.leaves, arrays, strict=True):
                _set(tree, leaf, array)
            continue
        tensors = [read(n, s) for n, s in zip(recipe.tensors, recipe.shapes, strict=True)]
        for leaf, array in zip(recipe.leaves, recipe.to_leaves(tensors), strict=True):
            _set(tree, leaf, placer.place(leaf, array))
        del tensors
    return cfg, tree, hf_config


def _progress(items, enabled: bool, what: str):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"{what} tensors", unit="recipe")


def _host_leaf(params, path: Path, moe_index, placements) -> np.ndarray:
    """One leaf on the host, experts back in logical order (first replica of each expert)."""
    array = _get(params, path)
    if placements is not None and len(path) > 3 and path[3] == "experts":
        table = np.asarray(placements[moe_index[path[1]]].slot_to_expert)
        first = np.array([np.flatnonzero(table == e)[0] for e in range(int(table.max()) + 1)])
        array = array[first]  # gathers only this leaf (a device gather when sharded)
    return np.asarray(jax.device_get(array))


def save_hf_model(
    path: str,
    params: dict,
    cfg: LMConfig,
    hf_config: dict,
    *,
    layout: Layout | None = None,
    dtype: str | None = None,
    placements=None,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool = False,
    overwrite: bool = False,
    inputs=(),
) -> None:
    """Write `params` as a Hugging Face checkpoint directory `path` (atomically).

    Everything is written into a temporary sibling directory that is swapped into place at
    the end (`CheckpointWriter`): an error or a kill leaves the old output or the new one,
    never half of either. Leaves are fetched from the devices one recipe at a time.

    Args:
      path: the directory to write: absent, empty, or (with `overwrite`) an earlier moejax
        output; a directory holding anything else is refused (CheckpointError).
      params: the `moejax.models` tree of `cfg`.
      cfg: the model config; must be the one of `hf_config` (`lm_config_from_hf`).
      hf_config: the `config.json` to write (e.g. from `load_hf_model`).
      layout: experts as published (`"per_expert"`) or transformers 5's `"fused"` tensors
        (None: `default_layout(family)`, per-expert where the family has it).
      dtype: stored dtype, "float32", "bfloat16" or "float16" (default: the config's
        `torch_dtype`, else float32).
      placements: as `load_hf_model`, when `params` holds physical expert slots.
      max_shard_bytes: the largest shard (a tensor larger than it gets a shard of its own).
      progress: a tqdm progress bar.
      overwrite: replace an earlier moejax output at `path`.
      inputs: paths `path` may not be, lie in, or hold (where `params` came from).
    """
    expect, family = lm_config_from_hf(hf_config, param_dtype=cfg.param_dtype)
    if expect.replace(dtype=cfg.dtype) != cfg:
        raise ValueError(f"cfg does not match hf_config: {cfg} vs {expect}")
    name = dtype or stored_dtype(hf_config) or "float32"
    out_dtypes = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    if name not in out_dtypes:
        raise ValueError(f"dtype={name!r}: must be one of {tuple(out_dtypes)}")
    out_dtype = DTYPES[out_dtypes[name]]
    moe_index = _moe_index(cfg)
    writer = CheckpointWriter(
        path, max_shard_bytes=max_shard_bytes, overwrite=overwrite, inputs=inputs
    )
    with writer:  # removes the temporary directory on an error: nothing half-written
        recipes = model_recipes(cfg, family, layout)
        copies = mtp_copies(cfg)
        originals = {r.tensors[0]: r for r in recipes if r.tensors[0] in copies.values()}
        for recipe, names in [(r, r.tensors) for r in _progress(recipes, progress, "save")] + [
            (originals[original], (copy,)) for copy, original in copies.items()
        ]:
            leaves = [_host_leaf(params, p, moe_index, placements) for p in recipe.leaves]
            for tensor_name, t in zip(names, recipe.to_tensors(leaves), strict=True):
                keep = tensor_name.endswith(FP32_TENSORS) and t.dtype == np.float32
                writer.add(tensor_name, np.ascontiguousarray(t if keep else t.astype(out_dtype)))
        writer.add_file(CONFIG_FILE, hf_config)
