"""Corpora as one flat array of byte tokens: the default offline corpus, or user files.

Default corpus (present wherever Python is): the top-level `*.py` modules of the running
interpreter's standard library directory (`sysconfig.get_paths()["stdlib"]`, e.g.
`/usr/lib/python3.11`), sorted by file name, read whole in that order, joined with the NUL
separator and cut at `max_bytes` (default 2 MiB). On CPython 3.11 that is `__future__.py`,
`__hello__.py`, `_aix_support.py`, ... up to about `pickle.py`. Subpackages (`json/`,
`test/`, ...) are not read. The selection depends only on the Python version, so two machines
with the same CPython build read the same bytes.

User corpora (`load_corpus(paths)`): text files (any bytes, read as UTF-8 bytes, one token per
byte) and `.npy` files of pre-tokenized ids (a 1-D integer array with values in `[0, vocab)`);
a directory stands for every regular, non-hidden file below it, sorted by path.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from pathlib import Path

import numpy as np

from moejax.data._tokenizer import DOC_SEPARATOR, VOCAB_SIZE

DEFAULT_MAX_BYTES = 2 * 1024 * 1024


class DataError(ValueError):
    """A corpus that cannot be used (missing, empty, malformed); the message names the file."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus.

    Attributes:
      tokens: `[n]` int32 token ids, documents joined by `DOC_SEPARATOR`.
      sources: the files read, in order.
      name: a short description (for logs and the run summary).
    """

    tokens: np.ndarray
    sources: tuple[str, ...]
    name: str

    def split(self, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """`(train, eval)` token arrays: the last `eval_fraction` of the tokens are held out."""
        if not 0 <= eval_fraction < 1:
            raise DataError(f"eval_fraction={eval_fraction!r}: must lie in [0, 1)")
        cut = len(self.tokens) - int(len(self.tokens) * eval_fraction)
        return self.tokens[:cut], self.tokens[cut:]


def stdlib_files() -> list[Path]:
    """The standard library's top-level `*.py` files, sorted by name (see the module docstring)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in stdlib.glob("*.py") if p.is_file()), key=lambda p: p.name)


def default_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """The default offline corpus: Python's standard library sources (module docstring).

    >>> c = default_corpus(max_bytes=1000)
    >>> len(c.tokens), c.tokens.dtype
    (1000, dtype('int32'))
    """
    files = stdlib_files()
    if not files:
        raise DataError(
            f"no *.py files in the standard library dir {sysconfig.get_paths()['stdlib']}"
        )
    chunks, used, total = [], [], 0
    for path in files:
        if total >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        used.append(str(path))
        total += len(data) + 1
    tokens = _join([np.frombuffer(c, np.uint8) for c in chunks])[:max_bytes]
    name = f"python{_py_version()} stdlib *.py ({len(used)} files, {len(tokens)} bytes)"
    return Corpus(tokens=tokens, sources=tuple(used), name=name)


def load_corpus(paths, *, vocab_size: int = VOCAB_SIZE, max_bytes: int | None = None) -> Corpus:
    """Tokenize user files: text as bytes, `.npy` as pre-tokenized ids (module docstring).

    Args:
      paths: file or directory paths (a single path is accepted too).
      vocab_size: ids in `.npy` files must lie in `[0, vocab_size)`.
      max_bytes: optional cap on the total number of tokens.

    Returns:
      The `Corpus`.

    Raises:
      DataError: a path that does not exist, a directory with no files, an empty file or corpus,
        a `.npy` file that is not a 1-D integer array of ids in range.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    files = [f for p in paths for f in _expand(Path(p))]
    if not files:
        raise DataError(f"no corpus files given (paths={list(map(str, paths))!r})")
    parts = [_read(f, vocab_size) for f in files]
    tokens = _join(parts)
    if max_bytes is not None:
        tokens = tokens[:max_bytes]
    name = files[0].name if len(files) == 1 else f"{len(files)} files"
    return Corpus(
        tokens=tokens, sources=tuple(map(str, files)), name=f"{name} ({len(tokens)} tokens)"
    )


def _expand(path: Path) -> list[Path]:
    if not path.exists():
        raise DataError(f"corpus path {path}: no such file or directory")
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataError(f"corpus directory has no files: {path}")
        return files
    return [path]


def _read(path: Path, vocab_size: int) -> np.ndarray:
    if path.suffix == ".npy":
        try:
            ids = np.load(path, allow_pickle=False)
        except Exception as err:  # numpy raises ValueError, TypeError, EOFError... on junk
            raise DataError(f"token file {path}: not a readable .npy array ({err})") from None
        numeric = np.issubdtype(ids.dtype, np.integer) or np.issubdtype(ids.dtype, np.floating)
        if ids.ndim != 1 or not numeric:
            raise DataError(
                f"token file {path}: need a 1-D integer array, got {ids.dtype}{list(ids.shape)}"
            )
        if ids.size == 0:
            raise DataError(f"token file {path} is empty")
        check_token_ids(ids, vocab_size, f"token file {path}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise DataError(
                f"token file {path}: need a 1-D integer array, got {ids.dtype}{list(ids.shape)} "
                "(whole numbers: save them as int32)"
            )
        return ids.astype(np.int32)
    data = path.read_bytes()
    if not data:
        raise DataError(f"corpus file is empty: {path}")
    return np.frombuffer(data, np.uint8)


def check_token_ids(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """DataError naming `where`, the index and the value of the first token id that is not a
    whole number in `[0, vocab_size)` (a NaN or a fraction in a float array, a negative or
    out-of-vocabulary id): cast to int32 they would index the embedding out of range and
    make the batch's losses NaN without a message."""
    tokens = np.asarray(tokens)
    if np.issubdtype(tokens.dtype, np.integer):
        bad = (tokens < 0) | (tokens >= vocab_size)
    elif np.issubdtype(tokens.dtype, np.floating):
        with np.errstate(invalid="ignore"):
            whole = np.isfinite(tokens) & (np.floor(tokens) == tokens)
            bad = ~whole | (tokens < 0) | (tokens >= vocab_size)
    else:
        raise DataError(f"{where}: token ids of dtype {tokens.dtype}, need integers")
    if bad.any():
        i = int(np.argmax(bad))
        value = tokens[i].item()
        raise DataError(
            f"{where}: index {i} holds {value!r}; token ids must be whole numbers in "
            f"[0, {vocab_size})"
        )


def _join(parts: list[np.ndarray]) -> np.ndarray:
    out = []
    for i, part in enumerate(parts):
        if i:
            out.append(np.array([DOC_SEPARATOR], np.int32))
        out.append(part.astype(np.int32))
    return np.concatenate(out) if out else np.zeros(0, np.int32)


def _py_version() -> str:
    return sysconfig.get_python_version()
