"""The package's one safetensors reader: validated headers, tensors streamed one at a time.

A Hugging Face checkpoint directory holds either one `model.safetensors` or shards
`model-0000i-of-0000n.safetensors` listed by `model.safetensors.index.json`
(`{"metadata": {"total_size": bytes}, "weight_map": {tensor: shard file}}`). A safetensors
file is 8 bytes little-endian header length `n`, `n` bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then
the raw little-endian data (offsets relative to the end of the header).

Validation, on opening (every header is read then; no tensor data): the header JSON is an
object of the right types (no duplicate names); each tensor's dtype is known and its
`[begin, end)` lies inside the data and holds exactly `prod(shape) x itemsize` bytes; the
tensors' ranges neither overlap nor leave gaps, and end where the file ends (as the
`safetensors` package requires); the index is an object whose `weight_map` names plain file
names (no `/`, `..` or absolute paths), each a regular file whose real path (symlinks resolved)
stays inside the checkpoint directory (or, for a Hugging Face hub cache snapshot
`.../snapshots/<rev>/`, inside that repository's `blobs/`), and every tensor it lists is in
its shard. Any violation is a `CheckpointError` naming the file (and the tensor): a hostile
or damaged file can neither make the reader read bytes that belong to another tensor or the
header, nor open a file outside the checkpoint.

Reading is tensor by tensor: each tensor's bytes only when asked (one `seek` + `readinto` the
returned array), so host memory holds one tensor at a time, never a whole shard, and nothing
read stays mapped: streaming a model onto devices keeps the host's memory at one tensor beyond
what the devices hold. A float tensor holding NaN or Inf is refused (its name and the count)
unless the reader was opened with `allow_nonfinite=True`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from moejax.interop.hf._errors import CheckpointError, MissingTensorError, NonFiniteError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The `safetensors` package's own limit on a header (a larger one is not a checkpoint).
MAX_HEADER_BYTES = 100_000_000
MAX_JSON_BYTES = 100_000_000  # an index or config.json larger than this is refused unread

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_FLOATS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
# numpy names of the float dtypes (what `dtype_of` reports; others keep the safetensors name).
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype name, shape and byte range."""

    file: str  # path of the shard
    dtype: str  # safetensors dtype name ("BF16", "F32", ...)
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def _open_regular(path: str, what: str):
    """`path` opened for binary reading, or CheckpointError unless it is a regular file (a
    directory, a FIFO, a device are refused without blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{what} missing", file=path) from None
    except OSError as err:
        raise CheckpointError(f"{what} cannot be opened ({err.strerror})", file=path) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise CheckpointError(f"{what} is {kind}, need a file", file=path)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _unique_object(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"name {key!r} appears twice")
        out[key] = value
    return out


def _parse_json(raw: bytes, file: str, what: str) -> Any:
    try:
        return json.loads(raw, object_pairs_hook=_unique_object, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError: ValueError
        detail = "nested too deeply" if isinstance(err, RecursionError) else err
        raise CheckpointError(f"{what} is not valid JSON ({detail})", file=file) from None


def read_json(path: str, what: str) -> Any:
    """The JSON file `path` (a regular file of at most `MAX_JSON_BYTES`, no duplicate names, no
    NaN), or CheckpointError naming it as `what`."""
    with _open_regular(path, what) as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise CheckpointError(f"{what} is over {MAX_JSON_BYTES} bytes", file=path)
    return _parse_json(raw, path, what)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict]:
    """The tensors of one safetensors file (name -> `TensorInfo`) and its `__metadata__`,
    validated (module docstring); CheckpointError naming the file and the tensor otherwise."""
    with _open_regular(path, "safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError("not a safetensors file (under 8 bytes)", file=path)
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, MAX_HEADER_BYTES):
            where = "past the end of the file" if n > size - 8 else f"over {MAX_HEADER_BYTES}"
            raise CheckpointError(f"not a safetensors file (header length {n} {where})", file=path)
        header = _parse_json(f.read(n), path, "safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(
            f"safetensors header is a JSON {type(header).__name__}, need an object", file=path
        )
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError("__metadata__ must be an object of strings", file=path)
    data_start, data_len = 8 + n, size - 8 - n
    out, ranges = {}, []
    for name, entry in header.items():
        info = _tensor_info(path, name, entry, data_start, data_len)
        out[name] = info
        ranges.append((info.begin, info.end, name))
    _check_coverage(path, sorted(ranges), data_start, size)
    return out, meta


def _tensor_info(path: str, name: str, entry, data_start: int, data_len: int) -> TensorInfo:
    def bad(why: str):
        return CheckpointError(why, tensor=name, file=path)

    if not isinstance(entry, dict):
        raise bad(f"header entry is a JSON {type(entry).__name__}, need an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise bad(f"header entry lacks {missing}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise bad(f"dtype {dtype!r} unknown; known: {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r}: need a list of ints >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise bad(f"data_offsets {offsets!r}: need [begin, end], two ints")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise bad(f"data_offsets {offsets} outside the {data_len} data bytes of the file")
    want = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != want:
        raise bad(f"data_offsets {offsets} span {end - begin} bytes; {dtype} {shape} needs {want}")
    return TensorInfo(path, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_coverage(path: str, ranges: list, data_start: int, size: int) -> None:
    """Sorted `[begin, end)` ranges must tile the data exactly: no overlap, no gap, no tail."""
    at = data_start
    for begin, end, name in ranges:
        if begin != at:
            what = "overlaps the previous tensor" if begin < at else f"leaves {begin - at} bytes"
            raise CheckpointError(
                f"data_offsets [{begin - data_start}, {end - data_start}] {what} "
                "(tensors must tile the data exactly)",
                tensor=name,
                file=path,
            )
        at = end
    if at != size:
        raise CheckpointError(
            f"{size - at} bytes after the last tensor (tensors must tile the data exactly)",
            file=path,
        )


def _allowed_roots(directory: Path) -> tuple[str, ...]:
    """Real paths a checkpoint directory's shards may resolve into: the directory, and for a
    Hugging Face hub cache snapshot (`<repo>/snapshots/<rev>`, whose files are symlinks to
    `<repo>/blobs/<hash>`) that repository's `blobs/`."""
    real = os.path.realpath(directory)
    roots = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(real)), "blobs"))
    return tuple(roots)


def _shard_path(directory: Path, shard, index: str) -> Path:
    """The file of shard name `shard` (from the index): a plain name that stays inside."""
    bad_name = (
        not isinstance(shard, str)
        or shard in ("", ".", "..")
        or any(c in shard for c in "/\\\x00")
        or os.path.isabs(shard)
    )
    if bad_name:
        raise CheckpointError(
            f"weight_map names shard {shard!r}: need a plain file name inside the checkpoint "
            "directory (no '/', '..' or absolute paths)",
            file=index,
        )
    file = directory / shard
    real = os.path.realpath(file)
    if not any(real.startswith(root + os.sep) for root in _allowed_roots(directory)):
        raise CheckpointError(
            f"shard {shard!r} is a symlink to {real}, outside the checkpoint directory",
            file=index,
        )
    return file


class SafetensorsCheckpoint(Mapping[str, np.ndarray]):
    """The tensors of a safetensors checkpoint, validated on opening, read lazily one at a time.

    A read-only `Mapping` from Hugging Face tensor name to numpy array: `ckpt[name]` reads that
    tensor only (its stored dtype; bf16 as `ml_dtypes.bfloat16`). Every header is read and
    validated on opening (module docstring). No file stays open between reads; the context
    manager and `close()` are kept for symmetry with writers.

    Args:
      path: a checkpoint directory (`model.safetensors.index.json` or `model.safetensors`), or
        one `.safetensors` file.
      allow_nonfinite: read float tensors holding NaN or Inf (default: `NonFiniteError`).

    Raises:
      CheckpointError: no checkpoint at `path`; an index, header or shard that fails
        validation, naming the file (and the tensor, and for a missing shard a tensor it should
        hold).
    """

    def __init__(self, path: str | os.PathLike, *, allow_nonfinite: bool = False):
        self.path = Path(path)
        self.allow_nonfinite = allow_nonfinite
        self.tensors: dict[str, TensorInfo] = {}
        if self.path.is_file():
            self.tensors = read_header(str(self.path))[0]
        elif (self.path / INDEX_FILE).is_file():
            self._read_index(self.path / INDEX_FILE)
        elif os.path.lexists(self.path / SINGLE_FILE):
            file = _shard_path(self.path, SINGLE_FILE, str(self.path))
            self.tensors = read_header(str(file))[0]
        else:
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} here", file=str(self.path))

    def _read_index(self, index: Path) -> None:
        where = str(index)
        obj = read_json(where, "index")
        weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(
                'not a safetensors index: need a JSON object with a "weight_map" object',
                file=where,
            )
        if not isinstance(obj.get("metadata", {}), dict | None):
            raise CheckpointError('"metadata" must be an object', file=where)
        shards: dict[str, dict[str, TensorInfo]] = {}
        for name, shard in weight_map.items():
            if shard not in shards:
                file = _shard_path(self.path, shard, where)
                if not os.path.lexists(file):
                    raise CheckpointError(
                        f"shard {shard!r} listed in {INDEX_FILE} for this tensor is missing",
                        tensor=name,
                        file=str(file),
                    )
                shards[shard] = read_header(str(file))[0]
            if name not in shards[shard]:
                raise CheckpointError(
                    f"listed in {INDEX_FILE} but not in the file",
                    tensor=name,
                    file=str(self.path / shard),
                )
            self.tensors[name] = shards[shard][name]

    # Mapping ------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> np.ndarray:
        return self.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    # Lookups that read no tensor data -----------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        """The `TensorInfo` of `name` (MissingTensorError naming the checkpoint if absent)."""
        if name not in self.tensors:
            raise MissingTensorError(
                f"not in the checkpoint {str(self.path)!r} ({len(self)} tensors)", tensor=name
            )
        return self.tensors[name]

    def file_of(self, name: str) -> str:
        """The file that holds tensor `name`."""
        return self.info(name).file

    def dtype_of(self, name: str) -> str:
        """Tensor `name`'s dtype: a numpy name for floats, else the safetensors one (`"I8"`)."""
        code = self.info(name).dtype
        return _DTYPE_NAMES.get(code, code)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """Tensor `name`'s shape."""
        return self.info(name).shape

    # Reading ------------------------------------------------------------------------------
    def read(
        self, name: str, shape: tuple[int, ...] | None = None, row: int | None = None
    ) -> np.ndarray:
        """Tensor `name` (or its row `row` along the first axis) as a numpy array in its stored
        dtype; only those bytes are read.

        Args:
          name: the tensor name.
          shape: the shape the caller needs; another stored shape raises CheckpointError
            naming the file, the tensor and both shapes (before anything is allocated).
          row: None for the whole tensor, else one index of its first axis (e.g. one expert of
            a fused `[E, ...]` tensor).

        Raises:
          MissingTensorError: no such tensor. CheckpointError: another shape, a file that
            shrank since it was opened. NonFiniteError: NaN or Inf in a float tensor (unless
            `allow_nonfinite`).
        """
        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(
                f"has shape {info.shape}; the model needs {tuple(shape)}",
                tensor=name,
                file=info.file,
            )
        dtype = DTYPES[info.dtype]
        out_shape, begin = info.shape, info.begin
        if row is not None:
            if not (info.shape and 0 <= row < info.shape[0]):
                raise CheckpointError(f"row {row} outside its shape {info.shape}", tensor=name)
            out_shape = info.shape[1:]
            begin += row * math.prod(out_shape) * dtype.itemsize
        out = np.empty(out_shape, dtype)
        with _open_regular(info.file, "safetensors file") as f:
            f.seek(begin)
            if f.readinto(out.reshape(-1).view(np.uint8)) != out.nbytes:
                raise CheckpointError("file ends inside the tensor", tensor=name, file=info.file)
        if info.dtype in _FLOATS and not self.allow_nonfinite:
            bad = out.size - int(np.count_nonzero(np.isfinite(out)))
            if bad:
                part = "" if row is None else f" (row {row})"
                raise NonFiniteError(
                    f"{bad} of {out.size} values{part} are NaN or Inf",
                    tensor=name,
                    file=info.file,
                )
        return out

    def close(self) -> None:
        """Nothing to release (no file stays open between reads)."""

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
