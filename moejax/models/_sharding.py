"""Where the LM's parameters live on a mesh: one rule table from logical axes to mesh axes.

Every parameter dimension carries a logical axis, a shape letter (docs/design.md): `V` vocab,
`D` model width, `H` query heads, `Hkv` key/value heads, `Dh` head dim, `F` dense or expert
width, `Fs` shared-expert width, `E` experts (`None`: never split). A layout is a mesh: the rules
below map each letter to mesh axes, and an axis the mesh lacks is skipped.

| letter | stored (`lm_partition_specs`) | used (`lm_compute_specs`, after the FSDP gather) |
|---|---|---|
| `E` | `expert` | `expert` |
| `D` | `fsdp`, then `expert` where the array has no `E` (ZeRO-3) | - |
| `H`, `Hkv`, `F`, `Fs` | `model` (tensor parallel) | `model` |
| `V`, `Dh` | - | - |

So parameters and optimizer moments are split over `fsdp`, dense ones also over `expert` (which
otherwise holds them whole: on one 8-GPU node with `expert=8` that is all of the attention),
experts over `expert`, widths and heads over `model`; the forward constrains each layer's
weights to the compute layout just before the layer uses them, which makes XLA all-gather them
there (inside the layer scan, one layer at a time) and reduce-scatter their gradients in the
backward. The MoE router
stays replicated over `expert` (every device routes its own tokens).

Rules for dimensions that must divide: `E` over `expert`, `F`, `Fs`, `H`, `Hkv` over `model`
(`check_lm_mesh` raises one line per mistake); an axis is used once per array (an expert weight's
`D` takes `fsdp` only) and, for `D`, skipped where it does not divide (a tiny model on a big mesh
keeps its width whole).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec

from moejax._params import param_specs
from moejax.models._config import LMConfig
from moejax.parallel import mesh as mesh_lib

STORAGE_RULES = {
    "E": (mesh_lib.EXPERT,),
    "D": (mesh_lib.FSDP, mesh_lib.EXPERT),
    "H": (mesh_lib.MODEL,),
    "Hkv": (mesh_lib.MODEL,),
    "F": (mesh_lib.MODEL,),
    "Fs": (mesh_lib.MODEL,),
}
COMPUTE_RULES = {k: v for k, v in STORAGE_RULES.items() if k != "D"}
_STRICT = ("E", "H", "Hkv", "F", "Fs")  # must divide: the math is split along them


def _moe_axes(cfg: LMConfig) -> dict:
    """Logical axes of one MoE layer's tree (the router's `E` is never split)."""
    out = {
        group: {name: spec.axes for name, spec in params.items()}
        for group, params in param_specs(cfg.moe).items()
    }
    out["router"] = {
        name: tuple(None if a == "E" else a for a in axes) for name, axes in out["router"].items()
    }
    return out


def lm_logical_axes(cfg: LMConfig) -> dict:
    """The logical axes of every parameter, a tree shaped like `init_lm_params`'s."""
    attn = {
        "wq": ("D", "H", "Dh"),
        "wk": ("D", "Hkv", "Dh"),
        "wv": ("D", "Hkv", "Dh"),
        "wo": ("H", "Dh", "D"),
    }
    if cfg.attention_bias:
        attn = attn | {"bq": ("H", "Dh"), "bk": ("Hkv", "Dh"), "bv": ("Hkv", "Dh")}
    if cfg.attention_out_bias:
        attn = attn | {"bo": (None,)}
    if cfg.attention_sinks:
        attn = attn | {"sinks": ("H",)}
    if cfg.qk_norm == "head":
        attn = attn | {"q_norm": {"scale": ("Dh",)}, "k_norm": {"scale": ("Dh",)}}
    elif cfg.qk_norm == "full":
        attn = attn | {"q_norm": {"scale": ("H", "Dh")}, "k_norm": {"scale": ("Hkv", "Dh")}}
    if cfg.mla is not None:
        from moejax.models._mla import mla_logical_axes

        attn = mla_logical_axes(cfg)
    mlp = {"w_gate": ("D", "F"), "w_up": ("D", "F"), "w_down": ("F", "D")}
    norm = {"scale": (None,)}

    def block(is_moe):
        layer = {"attn_norm": norm, "attn": attn, "ffn_norm": norm}
        layer["moe" if is_moe else "mlp"] = _moe_axes(cfg) if is_moe else mlp
        return layer

    layers = [block(cfg.is_moe(i)) for i in range(cfg.num_layers)]
    tree = {"embed": {"embedding": ("V", "D")}, "layers": layers, "final_norm": norm}
    if cfg.mtp_layers:
        mtp = {"enorm": norm, "hnorm": norm, "eh_proj": {"kernel": (None, "D")}, "norm": norm}
        tree["mtp"] = [mtp | {"block": block(cfg.mtp_is_moe)} for _ in range(cfg.mtp_layers)]
    if not cfg.tie_embeddings:
        tree["unembed"] = {"kernel": ("D", "V")}
    return tree


def spec(axes: tuple, shape: tuple[int, ...], mesh, rules: dict) -> PartitionSpec:
    """The PartitionSpec of one array: each dim's mesh axes from `rules`, skipping axes the mesh
    lacks, axes already used by an earlier dim, and (for non-strict letters) axes that would not
    divide the dim."""
    used: set[str] = set()
    out = []
    for letter, size in zip(axes, shape, strict=True):
        chosen = []
        for name in rules.get(letter, ()):
            if name not in mesh.axis_names or name in used:
                continue
            split = math.prod(mesh_lib.axis_size(mesh, a) for a in (*chosen, name))
            if letter not in _STRICT and size % split:
                continue
            chosen.append(name)
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*out)


def _specs(cfg: LMConfig, mesh, rules: dict) -> dict:
    from moejax.models._lm_params import abstract_params

    is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
    axes = lm_logical_axes(cfg)
    shapes = abstract_params(cfg)
    return jax.tree.map(lambda a, s: spec(a, s.shape, mesh, rules), axes, shapes, is_leaf=is_axes)


def lm_partition_specs(cfg: LMConfig, mesh) -> dict:
    """`PartitionSpec`s of the stored parameters (and optimizer moments) on `mesh` (table above).

    Raises:
      ValueError: one line per dimension that does not divide over its axis (`check_lm_mesh`).
    """
    check_lm_mesh(cfg, mesh)
    return _specs(cfg, mesh, STORAGE_RULES)


def lm_compute_specs(cfg: LMConfig, mesh) -> dict:
    """`PartitionSpec`s of the parameters as the layers use them (`D` gathered)."""
    return _specs(cfg, mesh, COMPUTE_RULES)


def lm_mesh_problems(cfg: LMConfig, mesh) -> list[str]:
    """One line per model dimension that does not divide over its mesh axis (empty: fits)."""
    n, m = mesh_lib.axis_size(mesh, mesh_lib.EXPERT), mesh_lib.axis_size(mesh, mesh_lib.MODEL)
    checks = [
        ("MoEConfig.num_experts", cfg.moe.num_experts, "expert", n),
        ("MoEConfig.d_ff", cfg.moe.d_ff, "model", m),
        ("the shared-expert width", cfg.moe.shared_width, "model", m),
    ]
    if not cfg.num_moe_layers:  # all dense (a Hugging Face Llama as loaded): `moe` is unused
        checks = []
    checks += [
        ("LMConfig.num_heads", cfg.num_heads, "model", m),
        ("LMConfig.num_kv_heads", cfg.num_kv_heads, "model", m),
    ]
    if cfg.num_moe_layers < cfg.num_layers:
        checks.append(("the dense MLP width", cfg.mlp_d_ff, "model", m))
    return [
        f"{name}={value}: does not divide over the mesh's {axis} axis of {size} devices"
        for name, value, axis, size in checks
        if value % size
    ]


def check_lm_mesh(cfg: LMConfig, mesh) -> None:
    """ValueError listing, one per line, every model dimension that does not divide over its
    mesh axis (`lm_mesh_problems`)."""
    if problems := lm_mesh_problems(cfg, mesh):
        raise ValueError("\n".join(problems))


def constrain(tree, specs, mesh):
    """`tree` constrained to `specs` on `mesh` (`with_sharding_constraint`); identity without a
    mesh."""
    if mesh is None:
        return tree
    from jax.sharding import NamedSharding

    return jax.tree.map(
        lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), tree, specs
    )
