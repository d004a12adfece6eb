"""The candidate space: `Candidate` (a strategy and a batch split), parsing, the defaults, what fits
a run, and the dropless bucket a routing imbalance needs."""

from __future__ import annotations

import dataclasses
import math

from moejax._config import MoEConfig
from moejax.parallel.dispatch_dropless import choose_bucket
from moejax.parallel.modes import MODES
from moejax.parallel.strategy import DISPATCHERS, Strategy, strategy_space


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the training step: the MoE layers' strategy and the batch split.

    Args:
      strategy: the sharded MoE `Strategy`; its `bucket` is set by the tuner per routing load.
      batch_split: micro-batches side by side through every block (`lm_forward`); must divide
        each token shard's rows (per gradient-accumulation micro-batch).
    """

    strategy: Strategy = Strategy()
    batch_split: int = 1

    def __post_init__(self):
        if not isinstance(self.strategy, Strategy):
            raise ValueError(f"Candidate.strategy={self.strategy!r}: must be a Strategy")
        bs = self.batch_split
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"Candidate.batch_split={bs!r}: must be a positive int")
        s = self.strategy
        if s.mode != "expert" and (s.dispatcher != "dropless" or s.bucket is not None):
            # The dispatcher and bucket only matter in expert mode: one spelling per program.
            object.__setattr__(self, "strategy", s.replace(dispatcher="dropless", bucket=None))

    @property
    def bucketed(self) -> bool:
        """Whether the program depends on the dropless bucket."""
        return self.strategy.mode == "expert" and self.strategy.dispatcher == "dropless"

    @property
    def label(self) -> str:
        """The `parse_candidate` spelling, e.g. `"dropless,chunks=2,stagger,bucket=160"`."""
        s = self.strategy
        parts = [s.dispatcher if s.mode == "expert" else s.mode]
        if s.chunks > 1:
            parts.append(f"chunks={s.chunks}")
        if s.stagger:
            parts.append("stagger")
        if self.bucketed and s.exchange == "ragged":
            parts.append("ragged")
        if self.batch_split > 1:
            parts.append(f"batch_split={self.batch_split}")
        if self.bucketed and s.bucket is not None:
            parts.append(f"bucket={s.bucket}")
        return ",".join(parts)

    def unbucketed(self) -> Candidate:
        return dataclasses.replace(self, strategy=self.strategy.replace(bucket=None))


def parse_candidate(text: str) -> Candidate:
    """A `Candidate` from comma-separated parts: a mode (`expert`, `data`, `tensor`), a
    dispatcher (`dropless`, `allgather`, `capacity`; implies expert mode), `chunks=N`,
    `stagger`, `ragged` (the dropless exchange, `Strategy.exchange`), `batch_split=N` (or
    `split=N`), `bucket=N`.

    Raises:
      ValueError: naming the part that is not understood.
    """
    mode, dispatcher, fields, split = "expert", "dropless", {}, 1
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, _, value = part.partition("=")
        if part in MODES:
            mode = part
        elif part in DISPATCHERS:
            dispatcher = part
        elif part == "stagger":
            fields["stagger"] = True
        elif part == "ragged":
            fields["exchange"] = "ragged"
        elif key in ("chunks", "bucket", "batch_split", "split") and value.isdigit():
            if key in ("batch_split", "split"):
                split = int(value)
            else:
                fields[key] = int(value)
        else:
            raise ValueError(
                f"strategy {text!r}: cannot read {part!r} (parts: a mode {'/'.join(MODES)}, a "
                f"dispatcher {'/'.join(DISPATCHERS)}, chunks=N, stagger, ragged, batch_split=N, "
                "bucket=N)"
            )
    return Candidate(Strategy(mode=mode, dispatcher=dispatcher, **fields), split)


def parse_candidates(text: str) -> tuple[Candidate, ...]:
    """`parse_candidate` of each `;`-separated spec."""
    return tuple(parse_candidate(p) for p in text.split(";") if p.strip())


def default_candidates(config: MoEConfig, platform: str) -> tuple[Candidate, ...]:
    """The candidates tried by default, from the layer's `strategy_space`, the default
    (`strategy="auto"`) first.

    Everywhere: the default, data-parallel experts (weights all-gathered, no token exchange)
    and the all-gather dispatcher. On GPU and TPU also the space's staggered 2-chunk pipeline
    and a batch split of 2, which only pay where collectives run beside compute: XLA:CPU runs
    them synchronously, so on CPU they only add work (and each costs a compile). Tensor mode and,
    for a capacity layer, the dropless dispatcher are not tried by default: give them in
    `TuningConfig.candidates`.
    """
    first, pipelined, *others = strategy_space(config)
    out = [Candidate(first)]
    if platform != "cpu":
        out += [Candidate(pipelined), Candidate(first, batch_split=2)]
    out += [Candidate(s) for s in others if s.mode == "data"]
    out += [Candidate(s) for s in others if s.mode == "expert" and s.dispatcher == "allgather"]
    return tuple(out)


def wanted_bucket(imbalance: float, tokens: int, top_k: int, n: int, *, margin: float = 2.0):
    """The dropless bucket that carries one step's busiest (source, destination) pair in one
    round, estimated from the layer's device-load imbalance (module docstring).

    Args:
      imbalance: busiest device's rows over the mean over the `expert` axis (>= 1).
      tokens: `T`, tokens per device in one MoE call.
      top_k: `K`.
      n: `N`, devices on the `expert` axis.
      margin: standard deviations above the mean count.

    Returns:
      `choose_bucket` of the estimate: a multiple of `balanced / 8`, at most 1.25 x balanced.
    """
    share = min(1.0, max(1.0, imbalance) / n)
    mean = tokens * top_k * share
    pair = math.ceil(mean + margin * math.sqrt(mean * (1.0 - share)))
    return choose_bucket(pair, tokens, top_k, n)


def candidate_problems(candidate: Candidate, model_cfg, train_cfg, mesh) -> list[str]:
    """Why `candidate` cannot run this model, batch and mesh (empty: it can)."""
    from moejax.parallel import mesh as mesh_lib

    if mesh is None:
        return [] if candidate.batch_split == 1 else ["batch_split needs a mesh here"]
    s, moe = candidate.strategy, model_cfg.moe
    rows = train_cfg.batch_size // mesh_lib.token_shards(mesh) // train_cfg.microbatches
    seq_len = train_cfg.seq_len or model_cfg.max_seq_len
    n, m = mesh_lib.axis_size(mesh, "expert"), mesh_lib.axis_size(mesh, "model")
    problems = []
    if rows % candidate.batch_split:
        problems.append(
            f"batch_split={candidate.batch_split} does not divide the {rows} sequences of a "
            f"token shard"
        )
    elif (rows // candidate.batch_split * seq_len) % s.chunks:
        problems.append(f"chunks={s.chunks} does not divide a shard's tokens")
    if s.mode == "tensor" and (moe.d_ff // m) % n:
        problems.append(f"tensor mode needs d_ff/model={moe.d_ff // m} divisible by expert={n}")
    capacity_routing = moe.drop_policy == "capacity" or moe.router == "expert_choice"
    if s.mode == "expert" and s.dispatcher == "capacity":
        if not capacity_routing:
            problems.append("the capacity dispatcher needs a capacity config")
        if train_cfg.expert_slots_per_device:
            problems.append("the capacity dispatcher does not take an expert placement")
    return problems


def candidate_space(model_cfg, train_cfg, mesh, candidates=None) -> tuple[Candidate, ...]:
    """The candidates (default: `default_candidates` for the mesh's platform) that fit the run,
    duplicates dropped, order kept.

    Raises:
      ValueError: if none fits (naming each one's problem).
    """
    if candidates is None:
        platform = "cpu" if mesh is None else mesh.devices.flat[0].platform
        candidates = default_candidates(model_cfg.moe, platform)
    out, why = [], []
    for c in candidates:
        problems = candidate_problems(c, model_cfg, train_cfg, mesh)
        if problems:
            why.append(f"{c.label}: {'; '.join(problems)}")
        elif c not in out:
            out.append(c)
    if not out:
        raise ValueError("no candidate strategy fits the run: " + " | ".join(why))
    return tuple(out)
