"""moejax.data: byte-level tokenization, corpora, and a checkpointable shuffled batch iterator.

>>> from moejax import data
>>> corpus = data.default_corpus(max_bytes=10_000)
>>> it = data.BatchIterator(corpus.tokens, batch_size=4, seq_len=32, seed=0)
>>> it.next().shape
(4, 33)
"""

from moejax.data._corpus import DEFAULT_MAX_BYTES as DEFAULT_MAX_BYTES
from moejax.data._corpus import Corpus as Corpus
from moejax.data._corpus import DataError as DataError
from moejax.data._corpus import default_corpus as default_corpus
from moejax.data._corpus import load_corpus as load_corpus
from moejax.data._corpus import stdlib_files as stdlib_files
from moejax.data._iterator import BatchIterator as BatchIterator
from moejax.data._tokenizer import DOC_SEPARATOR as DOC_SEPARATOR
from moejax.data._tokenizer import VOCAB_SIZE as VOCAB_SIZE
from moejax.data._tokenizer import decode as decode
from moejax.data._tokenizer import encode as encode

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DOC_SEPARATOR",
    "VOCAB_SIZE",
    "BatchIterator",
    "Corpus",
    "DataError",
    "decode",
    "default_corpus",
    "encode",
    "load_corpus",
    "stdlib_files",
]
