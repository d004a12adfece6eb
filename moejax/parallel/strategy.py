"""`Strategy`: how one sharded MoE call moves tokens and weights (never what it computes).

Fields: the parallel mode (`moejax.parallel.modes`), the dispatcher (expert mode only), the
pipeline degree and whether its chunks are staggered, and the dropless bucket. Every strategy
computes the same function as the single-device layer. `strategy_space` lists the ways a layer
can run (the deviceless compile suite covers them; `moejax.training.tuning` picks among them by
timing train steps). `DISPATCHERS` names the dispatchers, `PIPELINE_DEGREES` the allowed
pipeline degrees (`chunks`).

>>> Strategy(mode="expert", dispatcher="dropless", chunks=2, bucket=16).exchange
'padded'
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from moejax._config import MoEConfig
from moejax.parallel.modes import MODES, Mode

Dispatcher = Literal["capacity", "dropless", "allgather"]
Exchange = Literal["padded", "ragged"]
DISPATCHERS: tuple[str, ...] = Dispatcher.__args__
PIPELINE_DEGREES = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run a sharded MoE call.

    Args:
      mode: `"expert"` (send tokens to experts), `"data"` (all-gather expert weights, no token
        exchange) or `"tensor"` (re-slice weights over F, all-gather tokens, reduce-scatter).
      dispatcher: how tokens travel in expert mode: `"capacity"` (GShard all-to-all, fixed
        per-(device, expert) buffers; needs `config.drop_policy == "capacity"`), `"dropless"`
        (bounded all-to-all in rounds), `"allgather"` (all-gather + reduce-scatter). Ignored by
        the other modes.
      chunks: pipeline degree: dispatch, experts and combine run on this many token chunks
        (1, 2, 4 or 8), so one chunk's exchange can overlap another's compute.
      stagger: staggered pipelining (`moejax.parallel.pipeline`): with `chunks > 1`, chunk
        i+1's exchange is paired with chunk i's expert output in an optimization barrier so XLA
        can neither re-merge the chunks' matmuls nor serialize them (a GPU/TPU scheduling aid;
        the math is unchanged).
      bucket: dropless rows per (source, destination) pair per round, for the whole local batch
        (each chunk gets `ceil(bucket / chunks)`); None = the balanced share `ceil(T K / N)`.
      exchange: how the dropless dispatcher moves a round's rows: `"padded"` (an `all_to_all`
        of the `[N * B, D]` buffer; XLA:GPU's scheduler overlaps it with independent work) or
        `"ragged"` (`ragged_all_to_all` of exactly the rows when compiled for GPU or TPU, fewer
        bytes under skew; padded on CPU). Measured on deviceless schedules with jax 0.10.2:
        XLA:GPU leaves the ragged exchange's window empty in the LM step and libtpu runs it
        synchronously, hence the default.
    """

    mode: Mode = "expert"
    dispatcher: Dispatcher = "dropless"
    chunks: int = 1
    bucket: int | None = None
    stagger: bool = False
    exchange: Exchange = "padded"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Strategy.mode={self.mode!r}: must be one of {MODES}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(
                f"Strategy.dispatcher={self.dispatcher!r}: must be one of {DISPATCHERS}"
            )
        if self.chunks not in PIPELINE_DEGREES:
            raise ValueError(f"Strategy.chunks={self.chunks!r}: must be one of {PIPELINE_DEGREES}")
        if self.exchange not in Exchange.__args__:
            raise ValueError(
                f"Strategy.exchange={self.exchange!r}: must be one of {Exchange.__args__}"
            )
        if not isinstance(self.stagger, bool):
            raise ValueError(f"Strategy.stagger={self.stagger!r}: must be a bool")
        if self.bucket is not None and (isinstance(self.bucket, bool) or self.bucket < 1):
            raise ValueError(f"Strategy.bucket={self.bucket!r}: must be a positive int or None")

    def replace(self, **changes) -> Strategy:
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def strategy_space(config: MoEConfig) -> tuple[Strategy, ...]:
    """The strategy space of a layer: the default (`resolve_strategy("auto", config)`) first,
    the default pipelined (`chunks=2`, staggered), then each other (mode, dispatcher) that can
    run `config` (the capacity dispatcher only for capacity routing). Buckets are left unset:
    they follow the routing load.

    >>> [s.dispatcher if s.mode == "expert" else s.mode for s in strategy_space(
    ...     MoEConfig(d_model=8, d_ff=16, num_experts=4))]
    ['dropless', 'dropless', 'allgather', 'data', 'tensor']
    """
    first = resolve_strategy("auto", config)
    capacity_routing = config.drop_policy == "capacity" or config.router == "expert_choice"
    dispatchers = ("capacity",) * capacity_routing + ("dropless", "allgather")
    out = [first, first.replace(chunks=2, stagger=True)]
    out += [Strategy(dispatcher=d) for d in dispatchers]
    out += [Strategy(mode=m) for m in MODES if m != "expert"]
    return tuple(dict.fromkeys(out))


def resolve_strategy(strategy: Strategy | str, config: MoEConfig) -> Strategy:
    """`"auto"` -> expert parallel with the capacity dispatcher for capacity configs, the bounded
    dropless one otherwise; a `Strategy` is checked against `config`."""
    if isinstance(strategy, str):
        if strategy != "auto":
            raise ValueError(f"strategy={strategy!r}: must be a Strategy or 'auto'")
        capacity = config.drop_policy == "capacity" and config.router != "expert_choice"
        return Strategy(dispatcher="capacity" if capacity else "dropless")
    if not isinstance(strategy, Strategy):
        raise ValueError(f"strategy={strategy!r}: must be a Strategy or 'auto'")
    capacity_routing = config.drop_policy == "capacity" or config.router == "expert_choice"
    if strategy.mode == "expert" and strategy.dispatcher == "capacity" and not capacity_routing:
        raise ValueError(
            "Strategy.dispatcher='capacity': needs MoEConfig.drop_policy='capacity' (a dropless "
            f"layer would drop past the buffers), got drop_policy={config.drop_policy!r}"
        )
    return strategy
