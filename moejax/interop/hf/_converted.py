"""A converted model directory: a Hugging Face model as an orbax checkpoint that training starts
from (`experiments/train_lm.py --init-from DIR`) and that converts back: `convert_to_orbax`,
`convert_to_hf` (what `experiments/convert_hf.py` runs), built on `save_converted`,
`read_converted`, `load_converted_params` and `params_of_train_checkpoint` (a training
checkpoint's parameters, for the way back).

```
DIR/model.json          {"format", "family", "config": LMConfig as JSON (`moejax.record_to_json`)}
DIR/hf_config.json      the original config.json (written back on the way to Hugging Face)
DIR/params/             the parameter tree (orbax StandardCheckpointer), experts in logical order
DIR/checksums.json      the checksum of every parameter (`moejax.training.checksums`),
                        verified on whatever mesh the parameters are loaded onto
DIR/.moejax-output.json the marker of a moejax output (`_outputs`)
```

Written into a temporary sibling directory and swapped into place at the end
(`_outputs.OutputDir`): a failed or killed conversion leaves the old `DIR` or the new one, and an
existing `DIR` is replaced only when it is an earlier moejax output and `overwrite` is set.
Restoring verifies the checksums (a directory written before them is restored unverified, with
a warning) and refuses NaN/Inf parameters unless `allow_nonfinite`.
"""

from __future__ import annotations

import json
import os
import sys

import jax

from moejax.interop.hf._config import COUNT_CAPS
from moejax.interop.hf._errors import CheckpointError, ConvertedDirError, NonFiniteError
from moejax.interop.hf._model import load_hf_model, save_hf_model
from moejax.interop.hf._moe_config import family_of
from moejax.interop.hf._outputs import OutputDir, check_output
from moejax.models import LMConfig, abstract_params, lm_partition_specs
from moejax.records import record_from_json, record_to_json

FORMAT = "moejax-hf-converted/1"
MODEL_JSON, HF_CONFIG_JSON, PARAMS_DIR = "model.json", "hf_config.json", "params"
CHECKSUMS_JSON = "checksums.json"


def save_converted(
    path: str,
    cfg: LMConfig,
    params: dict,
    hf_config: dict,
    family: str,
    *,
    overwrite: bool = False,
    inputs=(),
) -> None:
    """Write a converted model directory (module docstring) atomically.

    Args:
      path: the directory: absent, empty, or (with `overwrite`) an earlier moejax output.
      cfg, params, hf_config, family: the model.
      overwrite: replace an earlier moejax output at `path`.
      inputs: paths `path` may not be, lie in, or hold (the Hugging Face directory).

    Raises:
      CheckpointError: `path` may not be written (nothing is written).
    """
    import orbax.checkpoint as ocp

    from moejax._disk import disk_error, quiet_orbax_disk_errors
    from moejax.training.checksums import CHECKSUM_FORMAT, algorithm_for, state_checksums

    quiet_orbax_disk_errors()
    with OutputDir(path, kind="converted", overwrite=overwrite, inputs=inputs) as out:
        try:
            ckptr = ocp.StandardCheckpointer()
            ckptr.save(os.path.join(out.tmp, PARAMS_DIR), params)
            ckptr.wait_until_finished()
            model = {"format": FORMAT, "family": family, "config": record_to_json(cfg)}
            sums = {
                "format": CHECKSUM_FORMAT,
                "algorithm": algorithm_for(params),
                "arrays": state_checksums(params),
            }
            for name, obj in (
                (MODEL_JSON, model),
                (HF_CONFIG_JSON, hf_config),
                (CHECKSUMS_JSON, sums),
            ):
                with open(os.path.join(out.tmp, name), "w") as f:
                    json.dump(obj, f, indent=2, sort_keys=True)
        except Exception as err:  # orbax raises many types for a full disk
            reason = disk_error(err)
            if reason is None:
                raise
            earlier = (
                "the earlier output is unchanged"
                if os.path.lexists(path)
                else ("nothing was written")
            )
            fix = "free space" if "space" in reason or "quota" in reason else "make it writable"
            raise CheckpointError(
                f"{reason} writing the converted model; {earlier} ({fix} and rerun)", file=path
            ) from None


def read_converted(path: str) -> tuple[LMConfig, dict, str]:
    """`(LMConfig, hf_config, family)` of a converted model directory."""
    model_file = os.path.join(path, MODEL_JSON)
    if not os.path.isdir(path):
        what = "not a directory" if os.path.exists(path) else "no such directory"
        raise ConvertedDirError(f"{path}: {what} (a converted model directory: experiments/"
                                "convert_hf.py to-orbax writes one)")  # fmt: skip
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
    except ValueError as err:
        raise ConvertedDirError(
            f"{path}: {MODEL_JSON} or {HF_CONFIG_JSON} is not JSON ({err})"
        ) from None
    except OSError as err:
        raise ConvertedDirError(f"{path}: cannot be read ({err})") from None
    if not isinstance(model, dict) or model.get("format") != FORMAT:
        got = model.get("format") if isinstance(model, dict) else type(model).__name__
        raise ConvertedDirError(f"{model_file}: format {got!r}, need {FORMAT!r}")
    try:
        cfg = record_from_json(LMConfig, model["config"])
    except (KeyError, TypeError, ValueError) as err:
        raise ConvertedDirError(f"{model_file}: not a model config ({err!r})") from None
    _check_caps(cfg, model_file)
    return cfg, hf_config, model.get("family")


def _check_caps(cfg: LMConfig, where: str) -> None:
    """The counts of a converted model's config within the caps of a Hugging Face one (nothing
    is sized from them before)."""
    counts = {
        "num_hidden_layers": cfg.num_layers,
        "num_experts": cfg.moe.num_experts,
        "num_attention_heads": cfg.num_heads,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
    }
    for key, value in counts.items():
        if value > COUNT_CAPS[key]:
            raise ConvertedDirError(f"{where}: {key}={value}: over moejax's cap {COUNT_CAPS[key]}")


def _target(cfg: LMConfig, mesh):
    abstract = abstract_params(cfg)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract
        )
    specs = lm_partition_specs(cfg, mesh)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, s)
        ),
        abstract,
        specs,
    )


def load_converted_params(path: str, cfg: LMConfig, mesh=None, *, allow_nonfinite: bool = False):
    """The parameters of a converted directory, read straight onto `mesh`'s shardings
    (`moejax.models.lm_partition_specs`; one device without a mesh), verified against the
    directory's checksums.

    Raises:
      ConvertedDirError: unreadable arrays, or one failing its checksum. NonFiniteError: NaN
        or Inf in the parameters (unless `allow_nonfinite`). Each names the directory and the
        array.
    """
    import orbax.checkpoint as ocp

    from moejax.training.checksums import ALGORITHMS, check_arrays, nonfinite_message

    path = os.path.abspath(path)
    sums_file = os.path.join(path, CHECKSUMS_JSON)
    algorithm = None
    try:
        with open(sums_file) as f:
            sums = json.load(f)
        expected, algorithm = sums["arrays"], sums.get("algorithm", "crc32")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}")
        if not isinstance(expected, dict):
            raise ValueError("'arrays' is not an object")
    except FileNotFoundError:
        expected = None
        print(f"moejax: {path} has no {CHECKSUMS_JSON} (converted before checksums existed): "
              "its parameters are not verified", file=sys.stderr)  # fmt: skip
    except (ValueError, KeyError, TypeError) as err:
        raise ConvertedDirError(f"{sums_file}: unreadable ({err!r})") from None
    try:
        params = ocp.StandardCheckpointer().restore(
            os.path.join(path, PARAMS_DIR), _target(cfg, mesh)
        )
    except Exception as err:  # orbax raises many types: one line naming the directory
        first = (str(err).strip().splitlines() or [""])[0].split(" See full TensorStore")[0]
        first = first[:200]
        raise ConvertedDirError(
            f"{path}: parameters cannot be read ({type(err).__name__}: {first})"
        ) from None
    kw = {} if algorithm is None else {"algorithm": algorithm}
    bad, nonfinite = check_arrays(params, expected, **kw)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ConvertedDirError(f"{path}: array {bad[0]} fails its checksum{more}")
    if nonfinite and not allow_nonfinite:
        raise NonFiniteError(nonfinite_message(path, nonfinite))
    return params


def params_of_train_checkpoint(step_dir: str, cfg: LMConfig, *, allow_nonfinite=False) -> dict:
    """The parameters (logical expert order) of a `moejax.training` checkpoint step directory
    (`<run>/checkpoints/<step>`), on one device, verified as a resumed run verifies them: the
    metadata against its checksum and the model `cfg`, every parameter against its checksum.

    Raises:
      moejax.training.CheckpointError (a ValueError): not a finished step, another model, a
        parameter failing its checksum, NaN/Inf (`NonFiniteState`, unless `allow_nonfinite`).
    """
    from moejax.training import TrainConfig
    from moejax.training.checkpoint import Checkpointer, CheckpointError

    step_dir = os.path.abspath(step_dir)
    name = os.path.basename(step_dir)
    if not os.path.isdir(step_dir):
        what = "not a directory" if os.path.exists(step_dir) else "no such directory"
        raise CheckpointError(
            f"{step_dir}: {what} (a training checkpoint step, <run>/checkpoints/<n>)"
        )
    if not name.isdigit() or not os.path.isdir(os.path.join(step_dir, "state")):
        raise CheckpointError(f"{step_dir}: not a training checkpoint step (<run>/checkpoints/<n>)")
    ckpt = Checkpointer(
        os.path.dirname(step_dir),
        cfg,
        TrainConfig(),
        keep=sys.maxsize,
        async_save=False,
        allow_nonfinite=allow_nonfinite,
    )  # fmt: skip (keep: closing it never rotates anything away)
    try:
        return ckpt.restore_params(int(name), _target(cfg, None))[0]
    finally:
        ckpt.close()


def convert_to_orbax(
    hf_dir: str,
    out: str,
    *,
    param_dtype: str = "float32",
    overwrite: bool = False,
    allow_nonfinite: bool = False,
    progress: bool = False,
) -> tuple[LMConfig, str]:
    """A Hugging Face checkpoint directory -> a converted model directory `out` (atomic).

    `out` is checked (`check_output`) before anything is read, then the model is streamed in
    (`load_hf_model`, validated) and written (`save_converted`).

    Args:
      hf_dir: `config.json` and safetensors weights (one file or shards).
      out: the converted directory: absent, empty, or (with `overwrite`) an earlier moejax output.
      param_dtype: dtype of the stored parameters ("float32" or "bfloat16").
      overwrite: replace an earlier moejax output at `out`.
      allow_nonfinite: convert weights holding NaN or Inf.
      progress: a tqdm progress bar over the tensors.

    Returns:
      `(LMConfig, family)` of the model written.

    Raises:
      CheckpointError: `out` may not be written, or `hf_dir` fails to load (`load_hf_model`);
        nothing is written then.
    """
    check_output(out, overwrite=overwrite, inputs=[hf_dir])  # before reading
    cfg, params, hf_config = load_hf_model(
        hf_dir, param_dtype=param_dtype, progress=progress, allow_nonfinite=allow_nonfinite
    )
    family = family_of(hf_config)
    save_converted(out, cfg, params, hf_config, family, overwrite=overwrite, inputs=[hf_dir])
    return cfg, family


def convert_to_hf(
    converted: str,
    out: str,
    *,
    checkpoint: str | None = None,
    layout: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    allow_nonfinite: bool = False,
    progress: bool = False,
) -> None:
    """A converted model directory (or a training checkpoint of it) -> a Hugging Face
    checkpoint directory `out` (atomic, `save_hf_model`).

    Args:
      converted: a directory written by `save_converted` / `convert_to_orbax`.
      out: the Hugging Face directory: absent, empty, or (with `overwrite`) an earlier moejax
        output.
      checkpoint: a `moejax.training` checkpoint step directory of the same model whose
        parameters are written instead of the converted ones (`params_of_train_checkpoint`).
      layout, dtype, max_shard_bytes: as `save_hf_model`.
      overwrite: replace an earlier moejax output at `out`.
      allow_nonfinite: write parameters holding NaN or Inf.
      progress: a tqdm progress bar over the tensors.

    Raises:
      CheckpointError: `out` may not be written, `converted` is not a converted model or fails
        its checksums; moejax.training.CheckpointError: `checkpoint` is not a verified step of
        this model. Nothing is written then.
    """
    inputs = [converted] + ([checkpoint] if checkpoint else [])
    check_output(out, overwrite=overwrite, inputs=inputs)  # before reading
    cfg, hf_config, _ = read_converted(converted)
    if checkpoint:
        params = params_of_train_checkpoint(checkpoint, cfg, allow_nonfinite=allow_nonfinite)
    else:
        params = load_converted_params(converted, cfg, allow_nonfinite=allow_nonfinite)
    save_hf_model(
        out,
        params,
        cfg,
        hf_config,
        layout=layout,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        progress=progress,
        overwrite=overwrite,
        inputs=inputs,
    )
