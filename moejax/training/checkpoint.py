"""Checkpoints with orbax: async, checksummed, keep-N, exact resume, restore onto another mesh.

A checkpoint of step `t` is the orbax step directory `<dir>/<t>/` with three items:

- `state`: the `TrainState` as a dict (`step`, `updates`, `skipped`, `params` in logical
  expert order `[E, ...]`, `opt_state`, `rng`), saved with `StandardSave`;
- `meta`: JSON: `format`, the model config, the data-iterator state (`seed`, `epoch`,
  `position`), the expert placement of every MoE layer (`slot_to_expert [Lm][P]`, `num_devices`,
  `slots_per_device`), the placement controller's state (`PlacementRuntime.checkpoint_state`,
  None without a controller), the mesh it was written on, and the train config (compared on
  resume: `moejax.training.resume`);
- `checksums`: JSON: the checksum of every array by its name (`params.layers[1].moe.experts.w_up`),
  with its shape and dtype, and the CRC-32 of `meta` (canonical JSON), under one `algorithm`
  (`moejax.training.checksums.algorithm_for`): `"crc32"` of the host copy when this process
  holds the whole state (one process), `"fmixsum64"`, computed on the devices and the same
  whatever the sharding, when arrays span processes. Computed on the state when it is saved,
  by every process alike (one manifest, written by process 0); verified after every restore by
  its own algorithm, on every process, whatever mesh and process count restore it.

Atomicity: orbax writes `<t>.orbax-checkpoint-tmp*` and renames it to `<t>` only when every
process has finished writing all three items, so a save cut short (crash, kill -9, full disk)
leaves a tmp directory that is never listed as a step: the latest finished checkpoint stays the
latest.

Fallback (`Checkpointer.restore_latest`): checkpoints are tried newest first; one whose metadata
or arrays cannot be read or fail their checksums is reported in one line and skipped, and the
newest intact one is restored. Skipped checkpoints newer than it are never deleted: they are
renamed `<t>.corrupt` (so the resumed run can write step `t` again) for inspection. With no
intact checkpoint, `CheckpointError` names every step tried and why, and nothing is touched.
A checkpoint written before checksums existed (no `checksums` item) is restored unverified,
with a warning. An intact checkpoint for another model (`ResumeMismatch`) or whose arrays hold
NaN or Inf (`NonFiniteState`, naming the array and the count; unless `allow_nonfinite`) is an
error, not skipped: the files are fine, the request is not.
`Checkpointer.restore_params` reads and verifies the parameters alone (`convert_hf.py to-hf
--checkpoint`).

Rotation (keep the newest `keep`) runs before each save and on `close`, once the previous save
has finished; it deletes older checkpoints only after the newest one has been verified (read
back and checked against its checksums, into host memory, or restored and checked at the start
of the run), so a newer checkpoint that turns out bad never costs the older intact ones. Between
two saves `keep + 1` checkpoints may exist. Multi-process runs skip the read-back (it would hold
the whole state in every host's memory); their resume verifies every array as one process does.

Restoring reads the arrays straight into the shardings of the current mesh, whatever mesh wrote
them. Placements: parameters are stored in logical order, so a placement only describes where
experts sit on a mesh; on a mesh with another `expert` axis size the saved tables do not apply
and the identity placement of the new mesh is used.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import jax
import numpy as np

from moejax.models import LMConfig
from moejax.records import flatten, record_from_json, record_to_json, unflatten
from moejax.training._config import TrainConfig
from moejax.training.checksums import ALGORITHMS as ALGORITHMS
from moejax.training.checksums import CHECKSUM_FORMAT as CHECKSUM_FORMAT
from moejax.training.checksums import algorithm_for as algorithm_for
from moejax.training.checksums import array_checksum as array_checksum
from moejax.training.checksums import check_arrays as check_arrays
from moejax.training.checksums import leaf_name as leaf_name
from moejax.training.checksums import meta_checksum as meta_checksum
from moejax.training.checksums import nonfinite_message as nonfinite_message
from moejax.training.checksums import state_checksums as state_checksums
from moejax.training.state import TrainState

FORMAT = "moejax-lm-train/1"
_ITEMS = ("state", "meta", "checksums")
# Entries of a checkpoint directory: finished steps, orbax's unfinished saves, and checkpoints
# set aside by the fallback.
# What orbax writes at the top of a step directory, beside its `_`-prefixed metadata files
# (other orbax versions may add some): a step holding anything else is not rotated, a user's
# file put there would go with it.
_STEP_ENTRIES = frozenset({*_ITEMS, "_CHECKPOINT_METADATA", "commit_success.txt", "_METADATA"})
_ENTRY = re.compile(r"^(\d+)(\.orbax-checkpoint-tmp.*|\.corrupt(-\d+)?)?$")
_META_KEYS = ("step", "model", "data", "placement")
# Model fields that change neither the state's shapes nor the function trained: a checkpoint
# may be resumed with other values (e.g. bf16 compute, another kernel block size).
_RESUMABLE_FIELDS = frozenset({"dtype", "moe.block_size"})
# Model fields added since, whose value in a checkpoint written before them was not "off": what
# that checkpoint trained with, from its other fields.
_BEFORE_THEY_EXISTED = {
    "mtp_input": lambda saved: "pre_norm" if saved.get("mtp_layers") else "final_norm",
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be resumed from (foreign, corrupt, other model)."""


class CorruptCheckpoint(CheckpointError):
    """One checkpoint is unreadable or fails its checksums (the fallback skips it)."""


class ResumeMismatch(CheckpointError):
    """A checkpoint written with other settings than a resume may change (`moejax.training.
    resume`): another model, batch or seed. Names the field and both values.

    Attributes:
      field: `"model.d_model"`, `"seed"`, ...; saved, current: its two values.
    """

    def __init__(self, message: str, *, field: str, saved, current):
        super().__init__(message)
        self.field, self.saved, self.current = field, saved, current


class NonFiniteState(CheckpointError):
    """An intact checkpoint whose arrays hold NaN or Inf (names the first array and the count);
    restored only with `allow_nonfinite=True`."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written: a full disk, a quota, a read-only file system or
    directory. Names the directory, the step and the newest intact checkpoint."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore_latest` restored.

    Attributes:
      state: the `TrainState`, in the shardings of the target.
      meta: the metadata (`meta["placement"]` holds numpy `slot_to_expert` tables).
      step: the step restored.
      skipped: one line per newer checkpoint skipped (unreadable or failing its checksums),
        each naming the checkpoint and the array or file at fault.
      verified: False for a checkpoint written without checksums.
    """

    state: TrainState
    meta: dict
    step: int
    skipped: tuple[str, ...] = ()
    verified: bool = True


def _flat_config(cfg) -> dict:
    """`cfg` as the metadata stores it: its JSON form (`moejax.record_to_json`) flattened to
    dotted keys (`"moe.d_ff"`, `"mla.kv_lora_rank"`)."""
    return flatten(record_to_json(cfg))


def read_model_config(step_dir: str) -> LMConfig:
    """The `LMConfig` a checkpoint step directory's metadata records (`<step>/meta/metadata`,
    the flat `moe.d_ff` keys `Checkpointer.save` writes), unverified: restoring the parameters
    (`Checkpointer.restore_params`) checks the metadata's checksum and this config.

    Raises:
      CheckpointError: no readable model metadata in `step_dir`.
    """
    import json

    try:
        with open(os.path.join(step_dir, "meta", "metadata")) as f:
            flat = json.load(f)["model"]
        return record_from_json(LMConfig, unflatten(flat))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{step_dir}: no readable model metadata ({err})") from None


def _state_dict(state: TrainState) -> dict:
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


class Checkpointer:
    """Saves and restores `TrainState` + metadata + checksums under `directory` (module docstring).

    Opening checks the directory first, before anything is written: it must be absent, empty,
    or hold only step directories (`<int>`, `<int>.orbax-checkpoint-tmp*`, `<int>.corrupt*`),
    none of them a symlink (rotation deletes step directories).

    Args:
      directory: the checkpoint directory (created on the first save).
      model_cfg: the model being trained (checked against each restored checkpoint).
      train_cfg: the training config (stored for reference).
      keep: keep this many most recent checkpoints.
      async_save: write in a background thread (the step loop only waits for the device-to-host
        copy).
      allow_nonfinite: restore a state holding NaN or Inf (default: a CheckpointError naming
        the array and the count; such a checkpoint is intact, so it is not skipped).

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
        allow_nonfinite: bool = False,
    ):
        self.directory = os.path.abspath(directory)
        self.allow_nonfinite = allow_nonfinite
        self.model_cfg = model_cfg
        self.train_cfg = train_cfg
        self.keep = keep
        check_directory(self.directory)
        import orbax.checkpoint as ocp

        from moejax._disk import quiet_orbax_disk_errors

        quiet_orbax_disk_errors()
        self._writing: int | None = None  # the step being written in the background
        self._kept_foreign: set[int] = set()  # steps not rotated for a user's file (said once)

        self._ocp = ocp
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, create=True, enable_async_checkpointing=async_save
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)
        self._verified: set[int] = set()  # steps read back and found intact
        self._readback = None  # a host-side target for reading back the newest checkpoint

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

        Every process calls it (the checksums are one collective program over the state).
        Returns once the arrays are checksummed and copied off the devices (the state may then
        be donated to the next step); the files are written in the background unless `wait`.
        Older checkpoints beyond `keep` are deleted first, once the newest is verified.
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
        tree = _state_dict(state)
        algorithm = algorithm_for(tree)  # the same on every process
        checksums = {
            "format": CHECKSUM_FORMAT,
            "algorithm": algorithm,
            "meta": meta_checksum(meta),
            "arrays": state_checksums(tree, algorithm),
        }
        self._finish()  # the previous save, before rotating
        self._rotate(self.keep)
        if self._readback is None:
            host = jax.sharding.SingleDeviceSharding(_host_device())
            self._readback = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host), tree
            )
        ocp = self._ocp
        self._writing = step
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(tree),
                    meta=ocp.args.JsonSave(meta),
                    checksums=ocp.args.JsonSave(checksums),
                ),
                force=True,
            )
        except Exception as err:
            self._write_failed(err)
            raise
        if wait:
            self.wait()
        return step

    def restore(self, step: int, target: TrainState) -> tuple[TrainState, dict]:
        """Restore checkpoint `step` into the shapes and shardings of `target`, verified.

        Args:
          step: a finished step (`latest_step()`).
          target: a `TrainState` of `jax.ShapeDtypeStruct`s with shardings (`restore_target`).

        Returns:
          `(state, meta)`; `meta["placement"]` holds numpy `slot_to_expert` tables.

        Raises:
          CorruptCheckpoint: unreadable, not a moejax training checkpoint, or failing its
            checksums (names the checkpoint and the array).
          CheckpointError: written for another model.
        """
        state, meta, _ = self._load(step, _state_dict(target))
        return TrainState(**state), meta

    def restore_latest(self, target: TrainState, *, log=None, check=None) -> Restored | None:
        """Restore the newest intact checkpoint (module docstring: fallback); None if none exist.

        Args:
          target: as for `restore`.
          log: called with one line per checkpoint skipped (once an intact one is found) or
            restored unverified (default: print to stderr on process 0).
          check: called as `check(meta, path)` with the metadata of each readable checkpoint
            before its arrays are read; what it raises propagates, before any newer corrupt
            checkpoint is moved aside (`moejax.training.resume.check`).

        Raises:
          CheckpointError: no checkpoint is intact (names each step tried and why; nothing is
            touched); `ResumeMismatch`: one is for another model (or what `check` raises);
            `NonFiniteState`: the state holds NaN/Inf (unless `allow_nonfinite`).
        """
        log = log or _log
        tried = []
        for step in reversed(self.all_steps()):
            path = os.path.join(self.directory, str(step))
            try:
                state, meta, verified = self._load(step, _state_dict(target), check)
            except CorruptCheckpoint as err:
                tried.append((step, str(err)))
                continue
            skipped = []
            for bad, why in tried:
                moved = self._set_aside(bad)
                skipped.append(f"skipped {why}; moved aside to {moved}")
                log(skipped[-1])
            if tried:
                self._manager.reload()
            if not verified:
                log(f"checkpoint {path} has no checksums (older format): not verified")
            else:
                self._verified.add(step)
            return Restored(TrainState(**state), meta, step, tuple(skipped), verified)
        if tried:
            steps = ", ".join(str(s) for s, _ in tried)
            raise CheckpointError(
                f"no intact checkpoint in {self.directory} (tried steps {steps}: "
                + "; ".join(why for _, why in tried)
                + f"); remove those step directories (or all of {self.directory}) to start afresh"
            )
        return None

    def _load(self, step: int, target: dict, check=None) -> tuple[dict, dict, bool]:
        """(state dict, meta, verified) of checkpoint `step`; raises CorruptCheckpoint, or
        CheckpointError for another model or NaN/Inf in the state (unless allowed)."""
        ocp = self._ocp
        path = os.path.join(self.directory, str(step))

        def corrupt(why):
            return CorruptCheckpoint(f"checkpoint {path}: {why}")

        meta, checksums = self._read_meta(step)
        if check is not None:
            check(meta, path)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            )["state"]
        except Exception as err:
            raise corrupt(f"array data cannot be read ({_first_line(err)})") from None
        self._check_arrays(restored, checksums, path)
        try:
            meta["placement"] = _placement_from_meta(meta["placement"])
        except Exception as err:
            raise corrupt(f"metadata placement unreadable ({_first_line(err)})") from None
        return restored, meta, checksums is not None

    def _check_arrays(self, tree, checksums: dict | None, path: str, partial=False) -> None:
        expected = None if checksums is None else checksums["arrays"]
        kw = {} if checksums is None else {"algorithm": checksums["algorithm"]}
        bad, nonfinite = check_arrays(tree, expected, partial=partial, **kw)
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise CorruptCheckpoint(f"checkpoint {path}: array {bad[0]} fails its checksum{more}")
        if nonfinite and not self.allow_nonfinite:
            raise NonFiniteState(nonfinite_message(f"checkpoint {path}", nonfinite))

    def restore_params(self, step: int, target: dict) -> tuple[dict, dict]:
        """The parameters of checkpoint `step` only (not the optimizer state), verified against
        their checksums: `(params, meta)`.

        Args:
          step: a finished step.
          target: the parameter tree of `jax.ShapeDtypeStruct`s with shardings.

        Raises:
          CorruptCheckpoint: unreadable, or an array failing its checksum. CheckpointError:
            another model. NonFiniteState: NaN/Inf in the parameters (unless
            `allow_nonfinite`).
        """
        ocp = self._ocp
        path = os.path.join(self.directory, str(step))
        meta, checksums = self._read_meta(step)
        item = {"params": target}
        restore = ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True,  # the params only, not the optimizer state
        )
        try:
            params = ocp.PyTreeCheckpointer().restore(os.path.join(path, "state"), args=restore)
        except Exception as err:
            raise CorruptCheckpoint(
                f"checkpoint {path}: array data cannot be read ({_first_line(err)})"
            ) from None
        self._check_arrays(params, checksums, path, partial=True)
        return params["params"], meta

    def _read_meta(self, step: int) -> tuple[dict, dict | None]:
        """(meta, checksums or None) of checkpoint `step`, checked against each other and the
        model; raises CorruptCheckpoint, or CheckpointError for another model."""
        ocp = self._ocp
        path = os.path.join(self.directory, str(step))

        def corrupt(why):
            return CorruptCheckpoint(f"checkpoint {path}: {why}")

        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
        except Exception as err:  # orbax raises many types; report one line
            raise corrupt(f"no readable metadata ({_first_line(err)})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise corrupt("not a moejax training checkpoint (format mismatch)")
        checksums = None
        if os.path.exists(os.path.join(path, "checksums")):
            try:
                checksums = self._manager.restore(
                    step, args=ocp.args.Composite(checksums=ocp.args.JsonRestore())
                )["checksums"]
                if checksums.get("format") != CHECKSUM_FORMAT:
                    raise ValueError(f"format {checksums.get('format')!r}")
                checksums.setdefault("algorithm", "crc32")  # (all that was written before it)
                if checksums["algorithm"] not in ALGORITHMS:
                    raise ValueError(f"unknown algorithm {checksums['algorithm']!r}")
            except Exception as err:
                raise corrupt(f"checksums unreadable ({_first_line(err)})") from None
            if meta_checksum(meta) != checksums["meta"]:
                raise corrupt("metadata fails its checksum")
        missing = [k for k in _META_KEYS if k not in meta]
        if missing or meta["step"] != step:
            why = f"lacks {missing}" if missing else f"says step {meta['step']}"
            raise corrupt(f"metadata {why}")
        self._check_model(meta.get("model", {}), path)
        return meta, checksums

    def _check_model(self, saved: dict, path: str) -> None:
        here = _flat_config(self.model_cfg)
        for key in sorted(set(here) | set(saved)):
            if key in _RESUMABLE_FIELDS:
                continue
            older = key not in saved and key in _BEFORE_THEY_EXISTED
            if key not in saved and not older and here.get(key) in (None, False):
                continue  # a model option added after the checkpoint was written, left off
            a = _BEFORE_THEY_EXISTED[key](saved) if older else saved.get(key, "<missing>")
            b = here.get(key, "<missing>")
            if a != b and not (isinstance(a, list) and tuple(a) == b):
                raise ResumeMismatch(
                    f"checkpoint {path} was written for a different model: "
                    f"{key}={a!r} there, {b!r} here",
                    field=f"model.{key}",
                    saved=a,
                    current=b,
                )

    def _set_aside(self, step: int) -> str:
        """Rename step directory `step` to `<step>.corrupt[-n]` (process 0); returns the name."""
        names = [f"{step}.corrupt"] + [f"{step}.corrupt-{i}" for i in range(1, 1000)]
        name = next(n for n in names if not os.path.exists(os.path.join(self.directory, n)))
        several = jax.process_count() > 1
        if several:  # every process has chosen the name before process 0 takes it
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"moejax checkpoint set aside {step} (name)")
        if jax.process_index() == 0:
            os.rename(os.path.join(self.directory, str(step)), os.path.join(self.directory, name))
        if several:
            multihost_utils.sync_global_devices(f"moejax checkpoint set aside {step}")
        return name

    def _rotate(self, keep: int) -> None:
        """Delete finished checkpoints beyond the newest `keep`, once the newest is verified."""
        steps = self.all_steps()
        if len(steps) <= keep:
            return
        newest = steps[-1]
        if newest not in self._verified and jax.process_count() == 1:
            # (Several processes: a read-back onto one host device per process would hold the
            # whole state in every host's memory; the newest finished step counts as verified
            # here, and a resume verifies it.)
            if self._readback is None:  # nothing saved by this run: no read-back target
                return
            try:
                self._load(newest, self._readback)
            except CheckpointError as err:
                _log(f"keeping older checkpoints: the newest fails verification: {err}")
                return
            self._verified.add(newest)
        for step in steps[:-keep]:
            foreign = sorted(
                set(os.listdir(os.path.join(self.directory, str(step)))) - _STEP_ENTRIES
            )
            if foreign:  # a user's file beside orbax's: the step is not ours alone to delete
                if step not in self._kept_foreign:
                    self._kept_foreign.add(step)
                    _log(
                        f"keeping checkpoint {self.directory}/{step} past --keep: it holds files "
                        f"moejax did not write ({', '.join(foreign[:4])}); move them away to let "
                        "it rotate"
                    )
                continue
            self._manager.delete(step)

    def wait(self) -> None:
        """Block until pending saves are on disk."""
        self._finish()

    def close(self) -> None:
        """Finish pending saves, rotate, and release the manager."""
        self._finish()
        self._rotate(self.keep)
        self._manager.close()

    def _finish(self) -> None:
        """Wait for the background save; a disk error is `CheckpointWriteError`."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            self._write_failed(err)
            raise
        self._writing = None

    def _write_failed(self, err: BaseException) -> None:
        """Raise `CheckpointWriteError` (one line: what to fix, the newest intact checkpoint)
        for a disk error, after deleting the step's half-written temporary directory (orbax
        never lists it; it only takes space). Other errors: return (the caller re-raises)."""
        from moejax._disk import disk_error

        reason = disk_error(err)
        if reason is None:
            return
        step, self._writing = self._writing, None
        if jax.process_index() == 0 and os.path.isdir(self.directory):
            import shutil

            for name in os.listdir(self.directory):
                if name.startswith(f"{step}.orbax-checkpoint-tmp"):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        finished = sorted(
            int(n)
            for n in (os.listdir(self.directory) if os.path.isdir(self.directory) else ())
            if n.isdigit() and int(n) != step and os.path.isdir(os.path.join(self.directory, n))
        )
        newest = (
            f"the newest intact checkpoint is step {finished[-1]}"
            if finished
            else "there is no intact checkpoint yet"
        )
        read_only = reason in ("permission denied", "read-only file system")
        fix = "make it writable" if read_only else "free space"
        what = f"checkpoint step {step}" if step is not None else "a checkpoint"
        raise CheckpointWriteError(
            f"{self.directory}: {reason} writing {what}; {newest} ({fix} and rerun with the "
            "same --out to resume)"
        ) from None


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


def check_directory(directory: str) -> None:
    """Raise `CheckpointError` unless `directory` is absent, or holds only step directories
    (not symlinks) and files orbax leaves beside them."""
    if not os.path.lexists(directory):
        return
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint path {directory} is not a directory")
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if not (_ENTRY.match(name) and os.path.isdir(full)):
            raise CheckpointError(
                f"{directory} is not a moejax checkpoint directory: unexpected entry {name!r}"
            )
        if os.path.islink(full):
            raise CheckpointError(
                f"checkpoint step directory {full} is a symlink: rotation would delete what it "
                f"points to; replace it with a copy (cp -rL) or remove it"
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


def _host_device():
    """Where a checkpoint is read back for verification: host memory when the CPU backend is
    there (it is unless JAX_PLATFORMS leaves it out), never a second copy on the accelerator."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


def _log(line: str) -> None:
    if jax.process_index() == 0:
        print(f"moejax: {line}", file=sys.stderr, flush=True)


def _first_line(err: BaseException) -> str:
    """`Type: first line` of an error, without the Python reprs some tensorstore errors carry
    (`See full TensorStore details: <bound method pybind11_...>`)."""
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    for junk in ("See full TensorStore details", "<bound method", "<built-in"):
        first = first.split(junk)[0]
    first = first.strip().rstrip(".:;,")[:200]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__
