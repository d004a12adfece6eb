"""Hugging Face checkpoint directories read tensor by tensor into plain host memory, and a
one-file safetensors writer (tests, fixtures).

The safetensors format: 8 bytes little-endian header length `n`, `n` bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the raw
little-endian data (offsets relative to the end of the header). A directory holds one
`model.safetensors`, or several shards listed by `model.safetensors.index.json`
(`{"metadata": {"total_size"}, "weight_map": {name: file}}`).

Reading is tensor by tensor: the headers are read once, each tensor's bytes only when asked
(one `seek` + `readinto` the returned array), so host memory holds one tensor at a time, never a
whole shard. Unlike a memory map (`moejax.interop.hf.SafetensorsCheckpoint`, whose touched pages
stay resident while the file is open), nothing read stays mapped: streaming a model onto devices
keeps the host's memory at one tensor beyond what the devices hold.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

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

    def read(
        self, name: str, shape: tuple[int, ...] | None = None, row: int | None = None
    ) -> np.ndarray:
        """Tensor `name` (or its row `row` along the first axis) as a numpy array in its stored
        dtype (bf16 as `ml_dtypes.bfloat16`); only those bytes are read.

        Args:
          name: the tensor name.
          shape: the shape the model needs; a different stored shape, or a dtype that is not a
            float, raises CheckpointFormatError naming the file and the tensor.
          row: None for the whole tensor, else one index of its first axis (e.g. one expert of
            a fused `[E, ...]` tensor).
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
        out_shape, begin = info.shape, info.begin
        if row is not None:
            if not 0 <= row < info.shape[0]:
                raise CheckpointFormatError(f"{where}: row {row} outside its {info.shape[0]}")
            out_shape = info.shape[1:]
            begin += row * int(np.prod(out_shape, dtype=np.int64)) * dtype.itemsize
        out = np.empty(out_shape, dtype)
        with open(info.file, "rb") as f:
            f.seek(begin)
            if f.readinto(out.reshape(-1).view(np.uint8)) != out.nbytes:
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
