"""The one error tree of `moejax.interop.hf`: every refusal of something read from or written to
disk is a `CheckpointError` (a `ValueError`) naming the tensor, the file or the config field.

```
CheckpointError (ValueError)     a file, config.json field or output path moejax refuses
├── MissingTensorError (KeyError)  a tensor the block or model needs is absent
├── NonFiniteError                 a float tensor holding NaN or Inf (unless allowed)
└── ConvertedDirError              not a converted model directory, or one failing its checksums
```

Wrong arguments (an unknown family name, a `MoEConfig` a family cannot express, parameters of
the wrong shape) are plain `ValueError` / `KeyError`: they are the caller's, not the file's.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that moejax cannot read or write: a wrong shape or dtype, a missing shard, a
    `config.json` field moejax cannot honour, an output path it may not write.

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


class NonFiniteError(CheckpointError):
    """A float tensor holding NaN or Inf (names the tensor, the file and the count); readers
    and loaders accept such tensors only when given `allow_nonfinite=True`."""


class ConvertedDirError(CheckpointError):
    """A directory that is not a converted model (`save_converted`), or whose parameters fail
    their checksums (names the directory and the array or file)."""
