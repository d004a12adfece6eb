"""Byte-level tokenizer: one token per UTF-8 byte, vocabulary 256, no special tokens.

Documents are joined with the NUL byte (token 0) as separator: it never occurs in source text, so
it plays the role of an end-of-document token without growing the vocabulary.
"""

from __future__ import annotations

import numpy as np

VOCAB_SIZE = 256
DOC_SEPARATOR = 0  # the NUL byte


def encode(text: str | bytes) -> np.ndarray:
    """Token ids `[n]` int32 of `text` (UTF-8 bytes).

    >>> encode("hé").tolist()
    [104, 195, 169]
    """
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, np.uint8).astype(np.int32)


def decode(tokens) -> str:
    """Text of byte tokens (invalid UTF-8 sequences become U+FFFD).

    >>> decode(encode("hé"))
    'hé'
    """
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= VOCAB_SIZE):
        raise ValueError(
            f"byte tokens must lie in [0, {VOCAB_SIZE}), got {tokens.min()}..{tokens.max()}"
        )
    return tokens.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
