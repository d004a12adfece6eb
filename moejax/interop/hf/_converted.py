"""A converted model directory: a Hugging Face model as an orbax checkpoint that training starts
from (`experiments/train_lm.py --init-from DIR`) and that converts back.

```
DIR/model.json       {"format", "family", "config": LMConfig as JSON}
DIR/hf_config.json   the original config.json (written back on the way to Hugging Face)
DIR/params/          the parameter tree (orbax StandardCheckpointer), experts in logical order
```

Written into a temporary sibling directory and renamed at the end, so a failed conversion
leaves nothing at `DIR`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import jax

from moejax._config import MoEConfig
from moejax.models import LMConfig, RopeScaling

FORMAT = "moejax-hf-converted/1"
MODEL_JSON, HF_CONFIG_JSON, PARAMS_DIR = "model.json", "hf_config.json", "params"


class ConvertedDirError(ValueError):
    """A directory that is not a converted model (names the directory and what is missing)."""


def lm_config_to_json(cfg: LMConfig) -> dict:
    """`LMConfig` as a JSON-able dict (nested `moe`, `rope_scaling`)."""
    return dataclasses.asdict(cfg)


def lm_config_from_json(obj: dict) -> LMConfig:
    """The inverse of `lm_config_to_json`."""
    obj = dict(obj)
    obj["moe"] = MoEConfig(**obj["moe"])
    if obj.get("rope_scaling") is not None:
        obj["rope_scaling"] = RopeScaling(**obj["rope_scaling"])
    return LMConfig(**obj)


def write_converted(path: str, cfg: LMConfig, params: dict, hf_config: dict, family: str):
    """Write a converted model directory (module docstring) atomically."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(os.path.join(tmp, PARAMS_DIR), params)
        ckptr.wait_until_finished()
        model = {"format": FORMAT, "family": family, "config": lm_config_to_json(cfg)}
        for name, obj in ((MODEL_JSON, model), (HF_CONFIG_JSON, hf_config)):
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f, indent=2, sort_keys=True)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_converted(path: str) -> tuple[LMConfig, dict, str]:
    """`(LMConfig, hf_config, family)` of a converted model directory."""
    model_file = os.path.join(path, MODEL_JSON)
    try:
        with open(model_file) as f:
            model = json.load(f)
        with open(os.path.join(path, HF_CONFIG_JSON)) as f:
            hf_config = json.load(f)
    except FileNotFoundError as err:
        raise ConvertedDirError(
            f"{path}: not a converted model directory ({os.path.basename(err.filename)} "
            "missing; write one with experiments/convert_hf.py to-orbax)"
        ) from None
    if model.get("format") != FORMAT:
        raise ConvertedDirError(f"{model_file}: format {model.get('format')!r}, need {FORMAT!r}")
    return lm_config_from_json(model["config"]), hf_config, model["family"]


def _target(cfg: LMConfig, mesh):
    from moejax.models._params import abstract_params

    abstract = abstract_params(cfg)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract
        )
    from moejax.models import lm_partition_specs

    specs = lm_partition_specs(cfg, mesh)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, s)
        ),
        abstract,
        specs,
    )


def restore_params(path: str, cfg: LMConfig, mesh=None) -> dict:
    """The parameters of a converted directory, read straight onto `mesh`'s shardings
    (`moejax.models.lm_partition_specs`; one device without a mesh)."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(
        os.path.join(os.path.abspath(path), PARAMS_DIR), _target(cfg, mesh)
    )


def params_of_train_checkpoint(step_dir: str, cfg: LMConfig) -> dict:
    """The parameters (logical expert order) of a `moejax.training` checkpoint step directory
    (`<run>/checkpoints/<step>`), on one device."""
    import orbax.checkpoint as ocp

    state_dir = os.path.join(os.path.abspath(step_dir), "state")
    if not os.path.isdir(state_dir):
        raise ConvertedDirError(f"{step_dir}: not a training checkpoint step (no state/)")
    target = {"params": _target(cfg, None)}
    restore = ocp.args.PyTreeRestore(
        item=target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True,  # the params only, not the optimizer state
    )
    return ocp.PyTreeCheckpointer().restore(state_dir, args=restore)["params"]
