"""A deterministic, shuffled, checkpointable batch iterator over a flat token array.

The tokens are cut into `W = (n - 1) // S` windows of `S + 1` tokens starting at multiples of
`S` (consecutive windows share one token, so every next-token pair is a target exactly once per
epoch). Epoch `e` visits the windows in the order `default_rng([seed, e]).permutation(W)`, `B`
at a time; the `W mod B` windows left at the end of an epoch are skipped (they come back in other
epochs' orders). The whole state is three ints, `(seed, epoch, position)`, plus `W` as a check:
restoring it reproduces the stream exactly, with no data to replay.

Why not grain: the corpus fits in host memory and one permutation per epoch is all the shuffling
a byte-level LM needs; a 60-line iterator has no worker processes to checkpoint.
"""

from __future__ import annotations

import numpy as np

from moejax.data._corpus import DataError


class BatchIterator:
    """Shuffled `[B, S + 1]` windows of a token array (see the module docstring).

    Args:
      tokens: `[n]` int token ids.
      batch_size: `B`, windows per batch (the global batch; every process computes it whole).
      seq_len: `S`; a window holds `S + 1` tokens (inputs `[:-1]`, targets `[1:]`).
      seed: shuffling seed.

    >>> it = BatchIterator(np.arange(100), batch_size=2, seq_len=8, seed=0)
    >>> batch = it.next()
    >>> batch.shape, bool((batch[:, 1:] - batch[:, :-1] == 1).all())
    ((2, 9), True)
    >>> state = it.state(); a = it.next(); it.restore(state); bool((it.next() == a).all())
    True
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0):
        self.tokens = np.asarray(tokens, np.int32)
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.num_windows = max(0, (len(self.tokens) - 1) // self.seq_len)
        if self.num_windows < self.batch_size:
            raise DataError(
                f"corpus has {len(self.tokens)} tokens: fewer than one batch of "
                f"{self.batch_size} windows of {self.seq_len + 1} tokens "
                f"({self.batch_size * self.seq_len + 1} needed)"
            )
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order = np.zeros(0, np.int64)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_windows // self.batch_size

    def _order_of(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._order_epoch = epoch
        return self._order

    def next(self) -> np.ndarray:
        """The next batch, `[B, S + 1]` int32; advances the state."""
        if self.position + self.batch_size > self.num_windows:
            self.epoch, self.position = self.epoch + 1, 0
        ids = self._order_of(self.epoch)[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        starts = ids * self.seq_len
        return self.tokens[starts[:, None] + np.arange(self.seq_len + 1)[None, :]]

    def state(self) -> dict:
        """The checkpointable state (JSON-serialisable ints)."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "num_windows": self.num_windows,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    def restore(self, state: dict) -> None:
        """Continue from `state()` of an iterator over the same corpus and batch shape.

        Raises:
          DataError: the state is for another corpus size or batch shape.
        """
        for key in ("num_windows", "batch_size", "seq_len"):
            if int(state[key]) != getattr(self, key):
                raise DataError(
                    f"data iterator state has {key}={state[key]}, this run has "
                    f"{getattr(self, key)}: the corpus or batch shape changed since the checkpoint"
                )
        self.seed, self.epoch, self.position = (
            int(state[k]) for k in ("seed", "epoch", "position")
        )
