"""The package's one safetensors writer: checkpoint directories written atomically
(`CheckpointWriter`, `save_safetensors`), through the `safetensors` package.

Writing puts every file into a temporary directory beside the target and swaps it into place
at the end (`_outputs.OutputDir`), so a failure leaves nothing behind and an existing directory
is replaced only when it is an earlier moejax output and `overwrite` is set. Reading is
`_safetensors.SafetensorsCheckpoint`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from moejax.interop.hf._errors import CheckpointError
from moejax.interop.hf._outputs import OutputDir
from moejax.interop.hf._safetensors import INDEX_FILE, SINGLE_FILE

# ml_dtypes types that safetensors writes (numpy kind "V").
_ML_DTYPES = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class CheckpointWriter:
    """Write a safetensors checkpoint directory atomically, tensor by tensor.

    Tensors are buffered up to `max_shard_bytes`, then written as one shard; on a clean `close()`
    the shards are named `model-0000i-of-0000n.safetensors` with an index (or one
    `model.safetensors` when a single shard suffices), the extra files are written, and the
    temporary directory is swapped into place at `path` (`moejax.interop.hf._outputs`: a kill
    leaves the old output or the new one, and the directory carries a `.moejax-output.json`
    marker). On an exception inside the `with` block, or `abort()`, the temporary directory is
    removed: nothing half-written is left.

    Args:
      path: the checkpoint directory to create.
      max_shard_bytes: the largest shard (a tensor larger than it gets a shard of its own).
      overwrite: replace an earlier moejax output at `path`. Never anything else: a directory
        holding files moejax did not write is refused, with or without it.
      metadata: the safetensors header metadata (transformers requires `{"format": "pt"}`).
      inputs: paths `path` may not be, lie in, or hold (what the checkpoint is made from).

    Raises:
      CheckpointError: `path` may not be written (`_outputs.check_output`; nothing is written).

    >>> import tempfile, numpy as np
    >>> from moejax.interop.hf import SafetensorsCheckpoint
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
        inputs=(),
    ):
        self.path = Path(path)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = dict(metadata if metadata is not None else {"format": "pt"})
        self._out = OutputDir(path, kind="hf-checkpoint", overwrite=overwrite, inputs=inputs)
        self._tmp = Path(self._out.tmp)
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
        """Write the last shard, the index and the extra files; swap into place."""
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
        except BaseException:
            self.abort()
            raise
        self._out.commit()
        return self.path

    def abort(self) -> None:
        """Remove everything written so far."""
        self._out.abort()

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
