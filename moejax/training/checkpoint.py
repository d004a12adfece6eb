"""Checkpoints with orbax: async, keep-N, exact resume, restore onto another mesh.

A checkpoint of step `t` is the orbax step directory `<dir>/<t>/` with two items:

- `state`: the `TrainState` as a dict (`step`, `updates`, `skipped`, `params` in logical
  expert order `[E, ...]`, `opt_state`, `rng`), saved with `StandardSave`;
- `meta`: JSON: `format`, the model config, the data-iterator state (`seed`, `epoch`,
  `position`), the expert placement of every MoE layer (`slot_to_expert [Lm][P]`, `num_devices`,
  `slots_per_device`), the placement controller's state (`PlacementRuntime.checkpoint_state`,
  None without a controller), the mesh it was written on, and the train config (informational).

Atomicity: orbax writes `<t>.orbax-checkpoint-tmp*` and renames it to `<t>` only when every
process has finished writing, so a save cut short (crash, kill -9, full disk) leaves a tmp
directory that is never listed as a step: the latest finished checkpoint stays the latest.

Restoring reads the arrays straight into the shardings of the current mesh, whatever mesh wrote
them. Placements: parameters are stored in logical order, so a placement only describes where
experts sit on a mesh; on a mesh with another `expert` axis size the saved tables do not apply
and the identity placement of the new mesh is used.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from moejax.models import LMConfig
from moejax.training._config import TrainConfig
from moejax.training.state import TrainState

FORMAT = "moejax-lm-train/1"
_TMP_MARK = ".orbax-checkpoint-tmp"
# Model fields that change neither the state's shapes nor the function trained: a checkpoint
# may be resumed with other values (e.g. bf16 compute, another kernel block size).
_RESUMABLE_FIELDS = frozenset({"dtype", "moe.block_size"})


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be resumed from (foreign, corrupt, other model)."""


def _flat_config(cfg) -> dict:
    out = {}
    for key, value in dataclasses.asdict(cfg).items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _state_dict(state: TrainState) -> dict:
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


class Checkpointer:
    """Saves and restores `TrainState` + metadata under `directory` (module docstring).

    Opening checks the directory first, before anything is written: it must be absent, empty,
    or hold only orbax step directories (`<int>`, `<int>.orbax-checkpoint-tmp*`).

    Args:
      directory: the checkpoint directory (created on the first save).
      model_cfg: the model being trained (checked against each restored checkpoint).
      train_cfg: the training config (stored for reference).
      keep: keep this many most recent checkpoints.
      async_save: write in a background thread (the step loop only waits for the device-to-host
        copy).

    Raises:
      CheckpointError: the directory holds something else.
    """

    def __init__(
        self,
        directory: str,
        model_cfg: LMConfig,
        train_cfg: TrainConfig,
        *,
        keep: int = 3,
        async_save: bool = True,
    ):
        self.directory = os.path.abspath(directory)
        self.model_cfg = model_cfg
        self.train_cfg = train_cfg
        _check_directory(self.directory)
        import orbax.checkpoint as ocp

        self._ocp = ocp
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step (None if there is none)."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all finished checkpoints, ascending."""
        return sorted(self._manager.all_steps())

    def save(
        self,
        state: TrainState,
        *,
        data_state: dict,
        placements,
        controller: dict | None = None,
        mesh=None,
        wait: bool = False,
    ) -> int:
        """Save `state` as checkpoint `int(state.step)`; returns the step.

        Returns once the arrays are copied off the devices (the state may then be donated to the
        next step); the files are written in the background unless `wait`.
        """
        step = int(jax.device_get(state.step))
        meta = {
            "format": FORMAT,
            "step": step,
            "model": _flat_config(self.model_cfg),
            "train": _flat_config(self.train_cfg),
            "data": data_state,
            "placement": _placement_meta(placements),
            "controller": controller,
            "mesh": None if mesh is None else dict(mesh.shape),
        }
        ocp = self._ocp
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_state_dict(state)), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        if wait:
            self.wait()
        return step

    def restore(self, step: int, target: TrainState) -> tuple[TrainState, dict]:
        """Restore checkpoint `step` into the shapes and shardings of `target`.

        Args:
          step: a finished step (`latest_step()`).
          target: a `TrainState` of `jax.ShapeDtypeStruct`s with shardings (`restore_target`).

        Returns:
          `(state, meta)`; `meta["placement"]` holds numpy `slot_to_expert` tables.

        Raises:
          CheckpointError: the checkpoint is unreadable, not a moejax training checkpoint, or
            for another model.
        """
        ocp = self._ocp
        path = os.path.join(self.directory, str(step))
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
        except Exception as err:  # orbax raises many types; report one line
            raise CheckpointError(
                f"checkpoint {path} has no readable metadata ({_first_line(err)})"
            ) from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a moejax training checkpoint (format mismatch)")
        self._check_model(meta.get("model", {}), path)
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(_state_dict(target))),
            )["state"]
        except Exception as err:
            raise CheckpointError(f"checkpoint {path} is corrupt ({_first_line(err)})") from None
        meta["placement"] = _placement_from_meta(meta["placement"])
        return TrainState(**restored), meta

    def _check_model(self, saved: dict, path: str) -> None:
        here = _flat_config(self.model_cfg)
        for key in sorted(set(here) | set(saved)):
            if key in _RESUMABLE_FIELDS:
                continue
            if key not in saved and here.get(key) in (None, False):
                continue  # a model option added after the checkpoint was written, left off
            a, b = saved.get(key, "<missing>"), here.get(key, "<missing>")
            if a != b and not (isinstance(a, list) and tuple(a) == b):
                raise CheckpointError(
                    f"checkpoint {path} was written for a different model: "
                    f"{key}={a!r} there, {b!r} here"
                )

    def wait(self) -> None:
        """Block until pending saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


def restore_target(abstract: TrainState, shardings: TrainState | None) -> TrainState:
    """`abstract` (`abstract_state`) with `shardings` attached to every leaf."""
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract
        )
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def _check_directory(directory: str) -> None:
    if not os.path.exists(directory):
        return
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint path {directory} is not a directory")
    for name in sorted(os.listdir(directory)):
        step_part = name.split(_TMP_MARK)[0] if _TMP_MARK in name else name
        if not (step_part.isdigit() and os.path.isdir(os.path.join(directory, name))):
            raise CheckpointError(
                f"{directory} is not a moejax checkpoint directory: unexpected entry {name!r}"
            )


def _placement_meta(placements) -> dict:
    if not placements:
        return {"num_devices": 1, "slots_per_device": 0, "slot_to_expert": []}
    first = placements[0]
    return {
        "num_devices": first.num_devices,
        "slots_per_device": first.slots_per_device,
        "slot_to_expert": [p.slot_to_expert.tolist() for p in placements],
    }


def _placement_from_meta(meta: dict) -> dict:
    tables = [np.asarray(t, np.int64) for t in meta.get("slot_to_expert", [])]
    return {**meta, "slot_to_expert": tables}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__
