"""Safetensors checkpoints on disk: a lazy tensor-by-tensor reader and an atomic writer.

A Hugging Face checkpoint directory holds either one `model.safetensors` or shards
`model-0000i-of-0000n.safetensors` listed by `model.safetensors.index.json`
(`{"metadata": {"total_size": bytes}, "weight_map": {tensor: shard file}}`). Reading uses the
`safetensors` package's `safe_open` (memory-mapped, one tensor at a time, numpy arrays; bfloat16
through `ml_dtypes`). Writing puts every file into a temporary directory beside the target and
renames it into place at the end, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from moejax.interop.hf._errors import CheckpointError, MissingTensorError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# safetensors dtype names -> numpy dtype names (F8 and integer types are reported as they are).
# ml_dtypes types that safetensors writes (numpy kind "V").
_ML_DTYPES = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _safe_open(file: Path):
    from safetensors import safe_open  # imported here: only checkpoint I/O needs safetensors

    try:
        return safe_open(str(file), framework="np")
    except FileNotFoundError:
        raise CheckpointError("file missing", file=str(file)) from None
    except Exception as err:  # a truncated or non-safetensors file
        raise CheckpointError(f"not a readable safetensors file ({err})", file=str(file)) from err


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of checkpoint directory `path` (or the file itself)."""
    file = Path(path)
    if file.is_dir():
        file = file / CONFIG_FILE
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError("file missing", file=str(file)) from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"not valid JSON ({err})", file=str(file)) from err


class SafetensorsCheckpoint(Mapping[str, np.ndarray]):
    """The tensors of a safetensors checkpoint, read lazily one at a time.

    A read-only `Mapping` from Hugging Face tensor name to numpy array: `ckpt[name]` reads that
    tensor only. Every shard the index lists must exist (checked on opening). Use as a context
    manager, or call `close()`, to release the open files.

    Args:
      path: a checkpoint directory (`model.safetensors.index.json` or `model.safetensors`), or
        one `.safetensors` file.

    Raises:
      CheckpointError: no checkpoint at `path`, an unreadable index, a missing shard (naming the
        shard, the index and a tensor it should hold).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._handles: dict[Path, Any] = {}
        if self.path.is_file():
            self._weight_map = self._keys_of(self.path)
        elif (self.path / INDEX_FILE).is_file():
            self._weight_map = self._read_index(self.path / INDEX_FILE)
        elif (self.path / SINGLE_FILE).is_file():
            self._weight_map = self._keys_of(self.path / SINGLE_FILE)
        else:
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} here", file=str(self.path))

    def _keys_of(self, file: Path) -> dict[str, Path]:
        handle = self._handles[file] = _safe_open(file)
        return dict.fromkeys(handle.keys(), file)

    def _read_index(self, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"not a safetensors index ({err!r})", file=str(index)) from err
        files: dict[str, Path] = {}
        out = {}
        for name, shard in weight_map.items():
            if shard not in files:
                files[shard] = index.parent / shard
                if not files[shard].is_file():
                    raise CheckpointError(
                        f"shard {shard!r} listed in {INDEX_FILE} for this tensor is missing",
                        tensor=name,
                        file=str(files[shard]),
                    )
            out[name] = files[shard]
        return out

    # Mapping ------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> np.ndarray:
        handle = self._handle(name)
        try:
            return handle.get_tensor(name)
        except Exception as err:  # listed by the index, absent or unreadable in the shard
            raise CheckpointError(
                f"cannot be read ({err})", tensor=name, file=self.file_of(name)
            ) from err

    def __iter__(self) -> Iterator[str]:
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    # Lookups that read no tensor data -----------------------------------------------------
    def file_of(self, name: str) -> str:
        """The file that holds tensor `name`."""
        self._check(name)
        return str(self._weight_map[name])

    def dtype_of(self, name: str) -> str:
        """Tensor `name`'s dtype: a numpy name for floats, else the safetensors one (`"I8"`)."""
        code = self._handle(name).get_slice(name).get_dtype()
        return _DTYPE_NAMES.get(code, code)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """Tensor `name`'s shape."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def _check(self, name: str) -> None:
        if name not in self._weight_map:
            raise MissingTensorError(
                f"not in the checkpoint {str(self.path)!r} ({len(self)} tensors)", tensor=name
            )

    def _handle(self, name: str):
        self._check(name)
        file = self._weight_map[name]
        if file not in self._handles:
            self._handles[file] = _safe_open(file)
        return self._handles[file]

    def close(self) -> None:
        """Release the open files."""
        self._handles.clear()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class CheckpointWriter:
    """Write a safetensors checkpoint directory atomically, tensor by tensor.

    Tensors are buffered up to `max_shard_bytes`, then written as one shard; on a clean `close()`
    the shards are named `model-0000i-of-0000n.safetensors` with an index (or one
    `model.safetensors` when a single shard suffices), the extra files are written, and the
    temporary directory is renamed to `path`. On an exception inside the `with` block, or
    `abort()`, the temporary directory is removed: nothing half-written is left.

    Args:
      path: the checkpoint directory to create.
      max_shard_bytes: the largest shard (a tensor larger than it gets a shard of its own).
      overwrite: replace an existing `path` (the old one is removed only after the rename).
      metadata: the safetensors header metadata (transformers requires `{"format": "pt"}`).

    >>> import tempfile, numpy as np
    >>> root = tempfile.mkdtemp()
    >>> with CheckpointWriter(f"{root}/ckpt") as w:
    ...     w.add("a.weight", np.ones((2, 3), np.float32))
    >>> sorted(SafetensorsCheckpoint(f"{root}/ckpt"))
    ['a.weight']
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        max_shard_bytes: int = 5 * 2**30,
        overwrite: bool = False,
        metadata: Mapping[str, str] | None = None,
    ):
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise CheckpointError("already exists (pass overwrite=True)", file=str(self.path))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.overwrite = overwrite
        self.metadata = dict(metadata if metadata is not None else {"format": "pt"})
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent))
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self._total = 0
        self._files: dict[str, bytes] = {}

    def add(self, name: str, array: np.ndarray) -> None:
        """Queue tensor `name`; a full shard is written out."""
        if name in self._names:
            raise CheckpointError("written twice", tensor=name, file=str(self.path))
        array = np.ascontiguousarray(array)
        if array.dtype.kind not in "fiub" and array.dtype.name not in _ML_DTYPES:
            raise CheckpointError(f"dtype {array.dtype} has no safetensors type", tensor=name)
        if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
            self._flush()
        self._names.add(name)
        self._pending[name] = array
        self._pending_bytes += array.nbytes
        self._total += array.nbytes

    def add_file(self, name: str, content: str | bytes | Mapping) -> None:
        """Also write file `name` (a Mapping is written as indented JSON)."""
        if isinstance(content, Mapping):
            content = json.dumps(content, indent=2, sort_keys=True) + "\n"
        self._files[name] = content.encode() if isinstance(content, str) else bytes(content)

    def _flush(self) -> None:
        from safetensors.numpy import save_file

        file = self._tmp / f"shard-{len(self._shards):05d}.safetensors"
        try:
            save_file(self._pending, str(file), metadata=self.metadata)
        except Exception as err:
            first = next(iter(self._pending))
            raise CheckpointError(f"writing a shard failed ({err})", tensor=first) from err
        self._shards.append((file, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> Path:
        """Write the last shard, the index and the extra files; rename into place."""
        try:
            if self._pending or not self._shards:
                self._flush()
            n = len(self._shards)
            if n == 1:
                self._shards[0][0].rename(self._tmp / SINGLE_FILE)
            else:
                weight_map = {}
                for i, (file, names) in enumerate(self._shards):
                    file.rename(self._tmp / _shard_name(i, n))
                    weight_map.update(dict.fromkeys(names, _shard_name(i, n)))
                index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
                (self._tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
            for name, content in self._files.items():
                (self._tmp / name).write_bytes(content)
            self._commit()
        except BaseException:
            self.abort()
            raise
        return self.path

    def _commit(self) -> None:
        old = None
        if self.path.exists():
            if not self.overwrite:
                raise CheckpointError("appeared while writing", file=str(self.path))
            old = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.old-", dir=self.path.parent))
            os.rename(self.path, old / "ckpt")
        os.rename(self._tmp, self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Remove everything written so far."""
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    *,
    files: Mapping[str, str | bytes | Mapping] | None = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
) -> Path:
    """Write `tensors` (and extra `files`, e.g. `{"config.json": {...}}`) as a checkpoint
    directory, atomically (see `CheckpointWriter`). Returns `path`."""
    with CheckpointWriter(path, max_shard_bytes=max_shard_bytes, overwrite=overwrite) as writer:
        for name, array in tensors.items():
            writer.add(name, array)
        for name, content in (files or {}).items():
            writer.add_file(name, content)
    return Path(path)
