"""One MoE block: Hugging Face tensors (names, shapes, layouts) <-> moejax layer parameters.

torch `Linear` weights are `[out, in]`; moejax kernels are `[in, out]`, so every projection is
transposed, experts are stacked on a leading `E` axis, and the fused layouts are split or joined
(see `_families`). Every mapping is a transpose, a stack, a concatenation or an interleave:
import then export gives back the same bits.

Shape letters: `E` experts, `D` d_model, `F` d_ff of one expert, `Fs` shared-expert width.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping

import numpy as np

from moejax import MoEConfig, param_specs
from moejax.interop.hf._errors import CheckpointError, MissingTensorError
from moejax.interop.hf._families import FLOAT_DTYPES, HFFamily, block_family, check_layout


def _check_features(cfg: MoEConfig, fam: HFFamily) -> None:
    """Raise unless `fam`'s block layout has a tensor for every leaf of `cfg`'s tree."""
    have = {
        "router_bias": cfg.router_bias,
        "score_correction_bias": cfg.score_correction_bias,
        "expert_bias": cfg.expert_bias,
        "gated": cfg.gated,
        "shared": cfg.num_shared_experts > 0,
        "shared_gate": cfg.shared_gate,
    }
    for feature, value in have.items():
        if value not in fam.features[feature]:
            field = {"gated": "activation", "shared": "num_shared_experts"}.get(feature, feature)
            raise ValueError(
                f"MoEConfig.{field}={getattr(cfg, field)!r}: a {fam.name} block "
                f"{'has' if value is False else 'has no'} {feature.replace('_', ' ')}"
            )


def _expert_names(fam: HFFamily, i: int) -> tuple[str | None, str, str]:
    gate, up, down = fam.projections
    name = fam.expert_pattern.format
    return (name(i=i, proj=gate) if gate else None, name(i=i, proj=up), name(i=i, proj=down))


def block_tensor_shapes(
    cfg: MoEConfig, family: str, prefix: str = "", layout: str = "fused"
) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors of one MoE block: `{prefix + name: shape}`.

    Args:
      cfg: the block's config (`moe_config_from_hf`).
      family: a name in `moejax.interop.hf.FAMILIES`.
      prefix: the block's module path with a trailing dot, e.g. `"model.layers.3.mlp."`.
      layout: `"fused"` or `"per_expert"` (see `moejax.interop.hf._families`).

    Raises:
      ValueError: an unknown family or layout, or a `cfg` the family's block cannot hold.
    """
    fam = block_family(family)
    check_layout(fam, layout)
    _check_features(cfg, fam)
    d, f, e, fs = cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.shared_width
    shapes: dict[str, tuple[int, ...]] = {f"{fam.router}.weight": (e, d)}
    if cfg.router_bias:
        shapes[f"{fam.router}.bias"] = (e,)
    if cfg.score_correction_bias:
        shapes[fam.correction_bias] = (e,)
    if layout == "per_expert":
        for i in range(e):
            gate, up, down = _expert_names(fam, i)
            if gate:
                shapes[gate] = (f, d)
            shapes[up] = (f, d)
            shapes[down] = (d, f)
    elif fam.fused == "chunked":
        shapes["experts.gate_up_proj"] = (e, 2 * f, d)
        shapes["experts.down_proj"] = (e, d, f)
    else:  # interleaved (GPT-OSS): used as x @ W, so [E, D, 2F] and [E, F, D]
        shapes["experts.gate_up_proj"] = (e, d, 2 * f)
        shapes["experts.gate_up_proj_bias"] = (e, 2 * f)
        shapes["experts.down_proj"] = (e, f, d)
        shapes["experts.down_proj_bias"] = (e, d)
    if fam.shared:
        shapes[f"{fam.shared}.gate_proj.weight"] = (fs, d)
        shapes[f"{fam.shared}.up_proj.weight"] = (fs, d)
        shapes[f"{fam.shared}.down_proj.weight"] = (d, fs)
    if fam.shared_gate:
        shapes[f"{fam.shared_gate}.weight"] = (1, d)
    return {prefix + name: shape for name, shape in shapes.items()}


def block_tensor_names(
    cfg: MoEConfig, family: str, prefix: str = "", layout: str = "fused"
) -> list[str]:
    """The Hugging Face names of one MoE block's tensors (see `block_tensor_shapes`).

    >>> from moejax import presets
    >>> block_tensor_names(presets.mixtral(d_model=8, d_ff=4, num_experts=2), "mixtral", "m.")
    ['m.gate.weight', 'm.experts.gate_up_proj', 'm.experts.down_proj']
    """
    return list(block_tensor_shapes(cfg, family, prefix, layout))


def detect_layout(names: Iterable[str] | Container[str], family: str, prefix: str = "") -> str:
    """Which layout a checkpoint stores `family`'s block at `prefix` in, from its tensor names.

    Args:
      names: the checkpoint's tensor names; a Mapping or set (e.g. a `SafetensorsCheckpoint`) is
        asked by membership, so a whole-model checkpoint is not scanned once per layer.
      family: a name in `moejax.interop.hf.FAMILIES`.
      prefix: the block's module path with a trailing dot.

    Raises:
      CheckpointError: when neither layout's experts are there (naming what was looked for).
    """
    fam = block_family(family)
    if len(fam.layouts) == 1:
        return fam.layouts[0]  # a missing tensor is reported by name when it is read
    fused = prefix + "experts.gate_up_proj"
    per_expert = prefix + _expert_names(fam, 0)[1]
    if not isinstance(names, Container):
        names = set(names)
    found = {name for name in (fused, per_expert) if name in names}
    if found == {fused}:
        return "fused"
    if found == {per_expert}:
        return "per_expert"
    what = "both" if found else "neither"
    raise CheckpointError(
        f"{what} of {fused!r} (fused layout) and {per_expert!r} (per-expert layout) found: "
        f"no {fam.name} MoE block at prefix {prefix!r}"
    )


def _file_of(tensors: Mapping, name: str) -> str | None:
    file_of = getattr(tensors, "file_of", None)
    return file_of(name) if file_of is not None and name in tensors else None


def _missing_hint(tensors: Mapping, name: str) -> str:
    if name + "_blocks" in tensors:
        return "; the checkpoint holds it MXFP4-quantized (`_blocks`, `_scales`): dequantize first"
    return ""


def _fetch(tensors: Mapping, name: str, shape: tuple[int, ...], family: str, cfg) -> np.ndarray:
    """`tensors[name]` as a numpy array, checked for shape and dtype."""
    if name not in tensors:
        where = getattr(tensors, "path", None)
        raise MissingTensorError(
            f"missing from {'the tensors given' if where is None else str(where)!r}, needed by "
            f"the {family} block{_missing_hint(tensors, name)}",
            tensor=name,
        )
    file = _file_of(tensors, name)
    dtype_of = getattr(tensors, "dtype_of", None)  # a checkpoint tells it before reading
    dtype = dtype_of(name) if dtype_of is not None else None
    array = np.asarray(tensors[name]) if dtype in (None, *FLOAT_DTYPES) else None
    dtype = dtype or array.dtype.name
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"dtype {dtype} cannot be a moejax parameter; it takes {FLOAT_DTYPES}",
            tensor=name,
            file=file,
        )
    if tuple(array.shape) != tuple(shape):
        raise CheckpointError(
            f"shape {tuple(array.shape)}, but a {family} block with d_model={cfg.d_model}, "
            f"d_ff={cfg.d_ff}, num_experts={cfg.num_experts}, shared width={cfg.shared_width} "
            f"has {tuple(shape)}",
            tensor=name,
            file=file,
        )
    return array


def _t(a: np.ndarray) -> np.ndarray:
    """Swap the last two axes (torch `[out, in]` <-> moejax `[in, out]`)."""
    return np.swapaxes(a, -1, -2)


def block_from_hf(
    tensors: Mapping[str, np.ndarray],
    cfg: MoEConfig,
    family: str,
    prefix: str = "",
    *,
    dtype: str | None = None,
    strict: bool = True,
) -> dict:
    """moejax layer parameters from a Hugging Face MoE block's tensors.

    Args:
      tensors: Hugging Face names -> arrays: a dict, or a lazy mapping such as
        `SafetensorsCheckpoint` (only the block's tensors are read; errors then name the file).
      cfg: the block's config (`moe_config_from_hf`).
      family: a name in `moejax.interop.hf.FAMILIES`.
      prefix: the block's module path with a trailing dot (`"model.layers.3.mlp."`).
      dtype: cast every parameter to this float dtype; None keeps each tensor's own dtype (then
        `block_to_hf` gives back the same bits).
      strict: also reject tensors under `prefix` that the block does not have (a checkpoint
        with more experts than `cfg`, biases `cfg` has not); needs a non-empty prefix.

    Returns:
      The nested parameter dict of `moejax.init_moe_params(cfg, ...)` (numpy arrays).

    Raises:
      MissingTensorError: a tensor the block needs is absent (names it).
      CheckpointError: a tensor of the wrong shape or of a non-float dtype, an unexpected tensor
        (names it, and the file when `tensors` knows it).
    """
    fam = block_family(family)
    layout = detect_layout(tensors, family, prefix)
    shapes = block_tensor_shapes(cfg, family, prefix, layout)
    if strict and prefix:
        extra = sorted(n for n in tensors if n.startswith(prefix) and n not in shapes)
        if extra:
            raise CheckpointError(
                f"not part of a {family} block with {cfg.num_experts} experts and features "
                f"{_features_text(cfg)} ({len(extra)} such tensors; pass strict=False to skip)",
                tensor=extra[0],
                file=_file_of(tensors, extra[0]),
            )

    def get(local: str) -> np.ndarray:
        return _fetch(tensors, prefix + local, shapes[prefix + local], family, cfg)

    router = {"kernel": _t(get(f"{fam.router}.weight"))}
    if cfg.router_bias:
        router["bias"] = get(f"{fam.router}.bias")
    if cfg.score_correction_bias:
        router["score_correction_bias"] = get(fam.correction_bias)
    experts: dict[str, np.ndarray] = {}
    if layout == "per_expert":
        names = [_expert_names(fam, i) for i in range(cfg.num_experts)]
        if cfg.gated:
            experts["w_gate"] = np.stack([_t(get(g)) for g, _, _ in names])
        experts["w_up"] = np.stack([_t(get(u)) for _, u, _ in names])
        experts["w_down"] = np.stack([_t(get(d)) for _, _, d in names])
    elif fam.fused == "chunked":
        gate, up = np.split(get("experts.gate_up_proj"), 2, axis=1)
        experts.update(w_gate=_t(gate), w_up=_t(up), w_down=_t(get("experts.down_proj")))
    else:
        gate_up, gate_up_bias = get("experts.gate_up_proj"), get("experts.gate_up_proj_bias")
        experts.update(w_gate=gate_up[..., ::2], w_up=gate_up[..., 1::2])
        experts.update(b_gate=gate_up_bias[..., ::2], b_up=gate_up_bias[..., 1::2])
        experts.update(w_down=get("experts.down_proj"), b_down=get("experts.down_proj_bias"))
    params = {"router": router, "experts": experts}
    if fam.shared:
        shared = {
            "w_gate": _t(get(f"{fam.shared}.gate_proj.weight")),
            "w_up": _t(get(f"{fam.shared}.up_proj.weight")),
            "w_down": _t(get(f"{fam.shared}.down_proj.weight")),
        }
        if fam.shared_gate:
            shared["gate"] = _t(get(f"{fam.shared_gate}.weight"))
        params["shared"] = shared
    cast = (lambda a: a.astype(dtype)) if dtype is not None else (lambda a: a)
    return {
        g: {n: np.ascontiguousarray(cast(a)) for n, a in leaves.items()}
        for g, leaves in params.items()
    }


def _features_text(cfg: MoEConfig) -> str:
    on = [
        f
        for f in ("router_bias", "score_correction_bias", "expert_bias", "shared_gate")
        if getattr(cfg, f)
    ]
    return "(" + ", ".join(on + [f"num_shared_experts={cfg.num_shared_experts}"]) + ")"


def _check_params(params: Mapping, cfg: MoEConfig) -> None:
    """Raise unless `params` has exactly the leaves and shapes of `cfg`'s tree."""
    specs = param_specs(cfg)
    for group, leaves in specs.items():
        for name, spec in leaves.items():
            try:
                leaf = params[group][name]
            except KeyError:
                raise KeyError(
                    f"params[{group!r}][{name!r}] missing; this MoEConfig has it"
                ) from None
            if tuple(np.shape(leaf)) != spec.shape:
                raise ValueError(
                    f"params[{group!r}][{name!r}] has shape {tuple(np.shape(leaf))}, expected "
                    f"{spec.shape} for this MoEConfig"
                )
    extra = [f"{g}/{n}" for g in params for n in params[g] if n not in specs.get(g, {})]
    if extra:
        raise ValueError(f"params has {extra}, which this MoEConfig does not")


def block_to_hf(
    params: Mapping, cfg: MoEConfig, family: str, prefix: str = "", layout: str = "fused"
) -> dict[str, np.ndarray]:
    """A Hugging Face MoE block's tensors from moejax layer parameters.

    Args:
      params: the tree of `moejax.init_moe_params(cfg, ...)` (jax or numpy arrays).
      cfg: its config.
      family: a name in `moejax.interop.hf.FAMILIES`.
      prefix: the block's module path with a trailing dot.
      layout: `"fused"` (transformers 5 modules) or `"per_expert"` (published checkpoints).

    Returns:
      `{prefix + name: array}`, C-contiguous numpy arrays in the parameters' dtypes, named and
      shaped as `block_tensor_shapes` says.
    """
    fam = block_family(family)
    shapes = block_tensor_shapes(cfg, family, prefix, layout)
    _check_params(params, cfg)
    p = {g: {n: np.asarray(a) for n, a in leaves.items()} for g, leaves in params.items()}
    router, experts = p["router"], p["experts"]
    out = {f"{fam.router}.weight": _t(router["kernel"])}
    if cfg.router_bias:
        out[f"{fam.router}.bias"] = router["bias"]
    if cfg.score_correction_bias:
        out[fam.correction_bias] = router["score_correction_bias"]
    if layout == "per_expert":
        for i in range(cfg.num_experts):
            gate, up, down = _expert_names(fam, i)
            if gate:
                out[gate] = _t(experts["w_gate"][i])
            out[up] = _t(experts["w_up"][i])
            out[down] = _t(experts["w_down"][i])
    elif fam.fused == "chunked":
        out["experts.gate_up_proj"] = np.concatenate(
            [_t(experts["w_gate"]), _t(experts["w_up"])], axis=1
        )
        out["experts.down_proj"] = _t(experts["w_down"])
    else:
        out["experts.gate_up_proj"] = _interleave(experts["w_gate"], experts["w_up"])
        out["experts.gate_up_proj_bias"] = _interleave(experts["b_gate"], experts["b_up"])
        out["experts.down_proj"] = experts["w_down"]
        out["experts.down_proj_bias"] = experts["b_down"]
    if fam.shared:
        shared = p["shared"]
        out[f"{fam.shared}.gate_proj.weight"] = _t(shared["w_gate"])
        out[f"{fam.shared}.up_proj.weight"] = _t(shared["w_up"])
        out[f"{fam.shared}.down_proj.weight"] = _t(shared["w_down"])
        if fam.shared_gate:
            out[f"{fam.shared_gate}.weight"] = _t(shared["gate"])
    out = {prefix + name: np.ascontiguousarray(a) for name, a in out.items()}
    assert {n: a.shape for n, a in out.items()} == shapes, "layout tables disagree"
    return out


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """`[..., F]` twice -> `[..., 2F]` with gate at even and up at odd positions (GPT-OSS)."""
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])
