"""Errors of checkpoint reading and writing: each names the tensor and, when known, the file."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that moejax cannot read or write: a wrong shape or dtype, a missing shard.

    Attributes:
      tensor: the Hugging Face tensor name, or None when the error is about a whole file.
      file: the file involved, or None when not known (tensors given as an in-memory dict).
    """

    def __init__(self, message: str, *, tensor: str | None = None, file: str | None = None):
        where = []
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        if file is not None:
            where.append(f"in {str(file)!r}")
        super().__init__(f"{' '.join(where)}: {message}" if where else message)
        self.tensor = tensor
        self.file = file


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the block needs is not in the checkpoint (a `KeyError` and a `ValueError`)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]
