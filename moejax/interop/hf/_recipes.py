"""The tensor-name table between a whole decoder's `moejax.models` parameter tree and its
Hugging Face checkpoint (MoE decoders, and dense ones: Llama, Qwen2, Qwen3).

A *recipe* ties a few Hugging Face tensors to a few leaves of the parameter tree (e.g. the `E`
per-expert `gate_proj` matrices of a layer to `experts/w_gate [E, D, F]`) with the reshape and
transpose both ways, so one table serves loading and saving (`moejax.interop.hf._model`).

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
from collections.abc import Callable

import numpy as np

from moejax.interop.hf._families import (
    FAMILIES,
    LAYOUTS,
    Layout,
    block_prefix,
    check_layout,
)
from moejax.models import LMConfig

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
