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

The recipes and the Hugging Face tensor names they map are `moejax.interop.hf._recipes`'s.
"""

from __future__ import annotations

import os
import re
import sys

import jax
import numpy as np

from moejax.interop.hf._config import CONFIG_FILE, read_config, stored_dtype
from moejax.interop.hf._errors import CheckpointError
from moejax.interop.hf._families import FAMILIES, FLOAT_DTYPES, Layout, block_prefix
from moejax.interop.hf._fp8 import (
    FP8_DTYPES,
    SCALE_SUFFIX,
    dequantize_fp8,
    fp8_block_size,
    without_quantization,
)
from moejax.interop.hf._lm_config import lm_config_from_hf
from moejax.interop.hf._recipes import Path, Recipe, default_layout, model_recipes, mtp_copies
from moejax.interop.hf._safetensors import DTYPES, SafetensorsCheckpoint
from moejax.interop.hf._writer import CheckpointWriter
from moejax.models import LMConfig, abstract_params


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
        what = "no such directory" if not os.path.lexists(path) else "not a directory"
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
