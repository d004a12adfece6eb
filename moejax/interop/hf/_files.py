"""Hugging Face checkpoint directories, file by file: a lazy safetensors reader over a directory of
shards, and an atomic sharded writer.

The safetensors format: 8 bytes little-endian header length `n`, `n` bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the raw
little-endian data (offsets relative to the end of the header). A directory holds one
`model.safetensors`, or several shards listed by `model.safetensors.index.json`
(`{"metadata": {"total_size"}, "weight_map": {name: file}}`).

Reading is tensor by tensor: the headers are read once, each tensor's bytes only when asked
(one `seek` + `read`), so host memory holds one tensor at a time, never a whole shard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import tempfile

import ml_dtypes
import numpy as np

from moejax.interop.hf._errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # what a model parameter can be read from


class CheckpointFormatError(CheckpointError):
    """A Hugging Face checkpoint directory that cannot be read: a missing shard, a bad header, a
    missing tensor, a shape or dtype the model cannot take. The message names the file and the
    tensor (a `moejax.interop.hf.CheckpointError`, so a `ValueError`)."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype name, shape and byte range."""

    file: str  # path of the shard
    dtype: str  # safetensors dtype name ("BF16", "F32", ...)
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict]:
    """The tensors of one safetensors file (name -> `TensorInfo`) and its `__metadata__`."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointFormatError(f"{path}: not a safetensors file (under 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise CheckpointFormatError(f"{path}: header length {n} past the end of the file")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: shard file missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(f"{path}: unreadable safetensors header ({err})") from None
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        info = TensorInfo(path, entry["dtype"], tuple(entry["shape"]), 8 + n + begin, 8 + n + end)
        if info.end > size:
            raise CheckpointFormatError(f"{path}: tensor {name!r} runs past the end of the file")
        out[name] = info
    return out, meta


class SafetensorsDir:
    """The tensors of a checkpoint directory, read lazily one at a time.

    Args:
      path: a directory with `model.safetensors.index.json` (sharded) or `model.safetensors`.

    Raises:
      CheckpointFormatError: no weights, a shard named by the index missing (its file named), a
        bad header.
    """

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(path, SINGLE_NAME)):
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise CheckpointFormatError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            headers, _ = read_header(os.path.join(path, file))
            for name, info in headers.items():
                if weight_map is None or weight_map.get(name) == file:
                    self.tensors[name] = info
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in self.tensors:
                    raise CheckpointFormatError(
                        f"{os.path.join(path, file)}: tensor {name!r} listed in {INDEX_NAME} "
                        "is not in the file"
                    )

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        """The `TensorInfo` of `name` (CheckpointFormatError naming the directory if absent)."""
        if name not in self.tensors:
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} not found in the checkpoint")
        return self.tensors[name]

    def read(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Tensor `name` as a numpy array in its stored dtype (bf16 as `ml_dtypes.bfloat16`).

        Args:
          name: the tensor name.
          shape: the shape the model needs; a different stored shape, or a dtype that is not a
            float, raises CheckpointFormatError naming the file and the tensor.
        """
        info = self.info(name)
        where = f"{info.file}: tensor {name!r}"
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointFormatError(
                f"{where} has dtype {info.dtype}; model parameters are read from {FLOAT_DTYPES}"
            )
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointFormatError(f"{where} has shape {info.shape}; the model needs {shape}")
        dtype = DTYPES[info.dtype]
        count = int(np.prod(info.shape, dtype=np.int64))
        if info.end - info.begin != count * dtype.itemsize:
            raise CheckpointFormatError(f"{where}: byte range does not match {info.shape}")
        out = np.empty(info.shape, dtype)
        with open(info.file, "rb") as f:
            f.seek(info.begin)
            if f.readinto(out.reshape(-1).view(np.uint8)) != info.end - info.begin:
                raise CheckpointFormatError(f"{where}: file ends inside the tensor")
        return out


def _header_bytes(tensors: list[tuple[str, np.ndarray]], metadata: dict | None) -> bytes:
    header, offset = {}, 0
    for name, arr in tensors:
        if arr.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors name")
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as the reference writer


def write_safetensors(path: str, tensors: list[tuple[str, np.ndarray]], metadata=None) -> None:
    """Write `(name, array)` pairs to one safetensors file (little-endian, C order)."""
    header = _header_bytes(tensors, metadata)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for _, arr in tensors:
            f.write(np.ascontiguousarray(arr).tobytes())


class ShardedWriter:
    """Writes a checkpoint directory shard by shard into a temporary sibling directory, renamed
    onto `path` only by `commit()`: nothing half-written is ever at `path`.

    Tensors are buffered up to `max_shard_bytes` (one shard), then written; `commit` writes the
    last shard, the index, the extra JSON files (`config.json`, ...) and renames. Shards are
    named `model-00001-of-0000N.safetensors` (renamed once `N` is known), or
    `model.safetensors` when there is one.
    """

    def __init__(self, path: str, max_shard_bytes: int = 5 * 2**30):
        self.path = os.path.abspath(path)
        parent = os.path.dirname(self.path)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(self.path)}.tmp-", dir=parent)
        self.max_shard_bytes = max_shard_bytes
        self._pending: list[tuple[str, np.ndarray]] = []
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_size = 0

    def add(self, name: str, array: np.ndarray) -> None:
        """Queue one tensor (written once its shard is full)."""
        if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
            self._flush()
        self._pending.append((name, array))
        self._pending_bytes += array.nbytes
        self.total_size += array.nbytes

    def _flush(self) -> None:
        k = len(self._shards)
        write_safetensors(
            os.path.join(self.tmp, f"shard-{k}.safetensors"), self._pending, {"format": "pt"}
        )
        self._shards.append([n for n, _ in self._pending])
        self._pending, self._pending_bytes = [], 0

    def commit(self, extra_json: dict[str, dict]) -> None:
        """Finish: last shard, index, `extra_json` files ({filename: object}), rename onto
        `path` (an existing directory there is replaced)."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for k, names in enumerate(self._shards):
            final = SINGLE_NAME if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.rename(
                os.path.join(self.tmp, f"shard-{k}.safetensors"), os.path.join(self.tmp, final)
            )
            weight_map.update({name: final for name in names})
        if n > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
            _write_json(os.path.join(self.tmp, INDEX_NAME), index)
        for name, obj in extra_json.items():
            _write_json(os.path.join(self.tmp, name), obj)
        old = None
        if os.path.exists(self.path):  # moved aside, removed once the new one is in place
            old = f"{self.tmp}.old"
            os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        if old is not None:
            shutil.rmtree(old)

    def abort(self) -> None:
        """Remove the temporary directory (nothing was written at `path`)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
