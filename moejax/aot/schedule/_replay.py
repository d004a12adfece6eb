"""Parsed instructions replayed on a compute and a communication stream (`simulate`, `estimate`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from moejax.aot.schedule._hardware import H100_SXM, Hardware
from moejax.aot.schedule._ops import (
    BRANCH,
    COLLECTIVES,
    COMPUTE,
    DONE,
    LOOP,
    START,
    SYNC,
    Op,
    parse,
)

# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def collective_seconds(
    kind: str, nbytes: float, groups: Sequence[Sequence[int]], hardware: Hardware
) -> float:
    """Seconds one collective takes on `hardware` (the module docstring gives the rules).

    Args:
      kind: one of `COLLECTIVES`.
      nbytes: its buffer (`Op.comm_bytes`).
      groups: device ids of each replica group; collective-permute: (source, target) pairs.
      hardware: the device.

    Returns:
      Link time plus `hardware.collective_latency_s`.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"kind must be one of {COLLECTIVES}, got {kind!r}")
    node = hardware.node_size

    def same_node(a: int, b: int) -> bool:
        return not node or a // node == b // node

    if kind == "collective-permute":
        if not groups or all(len(p) < 2 or p[0] == p[1] for p in groups):
            return hardware.collective_latency_s
        local = all(same_node(p[0], p[-1]) for p in groups)
        rate = hardware.link_bytes_per_s if local else hardware.network_bytes_per_s
        return nbytes / rate + hardware.collective_latency_s
    n = max((len(g) for g in groups), default=1)
    if n <= 1:
        return hardware.collective_latency_s
    share = {"all-reduce": 2 * (n - 1) / n}.get(kind, (n - 1) / n)
    sent = share * nbytes
    if kind in ("all-to-all", "ragged-all-to-all"):
        # Each device sends to every peer: the in-node and cross-node parts go in parallel.
        worst = 0.0
        for group in groups:
            for d in group:
                peers_here = sum(same_node(d, e) for e in group) - 1
                here = peers_here / (len(group) - 1) if len(group) > 1 else 1.0
                worst = max(
                    worst,
                    sent * here / hardware.link_bytes_per_s,
                    sent * (1 - here) / hardware.network_bytes_per_s if here < 1 else 0.0,
                )
        return worst + hardware.collective_latency_s
    local = all(same_node(g[0], d) for g in groups for d in g)
    rate = hardware.link_bytes_per_s if local else hardware.network_bytes_per_s
    return sent / rate + hardware.collective_latency_s


def op_seconds(op: Op, hardware: Hardware) -> float:
    """Seconds of a COMPUTE op (roofline plus launch) or a collective's START / SYNC on
    `hardware`; 0 for the others."""
    if op.kind == COMPUTE:
        roofline = max(op.flops / hardware.peak(op.dtype), op.bytes / hardware.hbm_bytes_per_s)
        return roofline + hardware.launch_s
    if op.kind in (START, SYNC):
        return collective_seconds(op.collective, op.comm_bytes, op.groups, hardware)
    return 0.0


@dataclasses.dataclass(frozen=True)
class Window:
    """One collective as the model ran it (times per execution).

    Attributes:
      name: its start instruction (or the synchronous collective).
      collective: one of `COLLECTIVES`.
      bytes: its buffer (`Op.comm_bytes`).
      seconds: its time on the link.
      issue_s: when the compute stream issued it.
      done_s: when the compute stream reached its done (for a synchronous one: `issue_s`).
      exposed_s: how long the compute stream then waited for it.
      count: executions this record stands for (loop iterations).
      synchronous: whether it ran as a synchronous collective.
    """

    name: str
    collective: str
    bytes: float
    seconds: float
    issue_s: float
    done_s: float
    exposed_s: float
    count: int = 1
    synchronous: bool = False


@dataclasses.dataclass(frozen=True)
class ScheduleEstimate:
    """A schedule replayed on a `Hardware` model.

    Attributes:
      hardware: the model's name.
      step_s: estimated step time (both streams drained).
      compute_s: kernel time (the compute stream's busy time).
      comm_s: collective time, each counted in full.
      exposed_s: time the compute stream waited for collectives (the step minus compute).
      comm_by_kind: `comm_s` split by collective kind.
      exposed_by_kind: `exposed_s` split by the kind of the collective waited for.
      windows: every collective, in issue order.
      notes: assumptions made (unknown loop trip counts).
    """

    hardware: str
    step_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    comm_by_kind: dict[str, float]
    exposed_by_kind: dict[str, float]
    windows: tuple[Window, ...]
    notes: tuple[str, ...] = ()

    def exposed(self, kind: str) -> float:
        """Exposed seconds of one collective kind."""
        return self.exposed_by_kind.get(kind, 0.0)

    def comm(self, kind: str) -> float:
        """Seconds on the link of one collective kind."""
        return self.comm_by_kind.get(kind, 0.0)

    def summary(self) -> str:
        """One line: step, compute, communication and exposure, in ms."""
        kinds = ", ".join(
            f"{k} {self.exposed(k) * 1e3:.3f}/{self.comm(k) * 1e3:.3f}"
            for k in COLLECTIVES
            if self.comm(k)
        )
        return (
            f"{self.hardware}: step {self.step_s * 1e3:.3f} ms = compute "
            f"{self.compute_s * 1e3:.3f} + exposed {self.exposed_s * 1e3:.3f} "
            f"(comm {self.comm_s * 1e3:.3f}; exposed/total by kind: {kinds or 'none'})"
        )

    def table(self) -> str:
        """Markdown: one row per collective kind (ms), then the step."""
        rows = ["| collective | count | comm ms | exposed ms |", "|---|---:|---:|---:|"]
        for kind in COLLECTIVES:
            if self.comm(kind):
                count = sum(w.count for w in self.windows if w.collective == kind)
                rows.append(
                    f"| {kind} | {count} | {self.comm(kind) * 1e3:.3f} "
                    f"| {self.exposed(kind) * 1e3:.3f} |"
                )
        rows.append(
            f"| step {self.step_s * 1e3:.3f} ms | | compute {self.compute_s * 1e3:.3f} "
            f"| {self.exposed_s * 1e3:.3f} |"
        )
        return "\n".join(rows)


@dataclasses.dataclass
class _State:
    """The replay's clocks and running totals (mutable; copied for loops and branches)."""

    now: float = 0.0  # compute stream clock
    comm_free: float = 0.0  # when the communication stream is next free
    compute_s: float = 0.0
    comm: dict = dataclasses.field(default_factory=dict)
    exposed: dict = dataclasses.field(default_factory=dict)
    windows: list = dataclasses.field(default_factory=list)
    in_flight: dict = dataclasses.field(default_factory=dict)  # start name -> (Op, t0, t1, s)

    def copy(self) -> _State:
        return dataclasses.replace(
            self,
            comm=dict(self.comm),
            exposed=dict(self.exposed),
            windows=list(self.windows),
            in_flight=dict(self.in_flight),
        )


def _add(totals: dict, key: str, value: float) -> None:
    totals[key] = totals.get(key, 0.0) + value


def _window(op: Op, seconds, issue_s, done_s, exposed_s, synchronous=False) -> Window:
    return Window(
        op.name, op.collective, op.comm_bytes, seconds, issue_s, done_s, exposed_s, 1, synchronous
    )


class _Replay:
    def __init__(self, hardware, default_trip_count, measured):
        self.hw = hardware
        self.default_trip_count = default_trip_count
        self.measured = measured
        self.notes: list[str] = []

    def seconds(self, op: Op) -> float:
        if op.name in self.measured:
            return float(self.measured[op.name])
        return op_seconds(op, self.hw)

    def run(self, ops: Sequence[Op], st: _State) -> _State:
        for op in ops:
            if op.kind == COMPUTE:
                seconds = self.seconds(op)
                st.now += seconds
                st.compute_s += seconds
            elif op.kind == START:
                seconds = self.seconds(op)
                begin = max(st.now, st.comm_free)
                st.comm_free = begin + seconds
                st.in_flight[op.name] = (op, st.now, st.comm_free, seconds)
                _add(st.comm, op.collective, seconds)
            elif op.kind == DONE and op.start in st.in_flight:
                start, issued, finish, seconds = st.in_flight.pop(op.start)
                wait = max(0.0, finish - st.now)
                st.windows.append(_window(start, seconds, issued, st.now, wait))
                _add(st.exposed, start.collective, wait)
                st.now += wait
            elif op.kind == SYNC:
                seconds = self.seconds(op)
                finish = max(st.now, st.comm_free) + seconds
                wait = finish - st.now
                st.windows.append(_window(op, seconds, st.now, st.now, wait, synchronous=True))
                _add(st.comm, op.collective, seconds)
                _add(st.exposed, op.collective, wait)
                st.now = st.comm_free = finish
            elif op.kind == LOOP:
                st = self.loop(op, st)
            elif op.kind == BRANCH and op.branches:
                ends = [self.run(branch, st.copy()) for branch in op.branches]
                st = max(ends, key=lambda s: s.now)
        return st

    def loop(self, op: Op, st: _State) -> _State:
        trips = op.trip_count
        if trips is None:
            trips = self.default_trip_count
            self.notes.append(f"{op.name}: trip count unknown, ran {trips}")
        done = 0
        while done < trips:
            clean = not st.in_flight
            before = st.copy()
            st = self.run(op.body, st)
            done += 1
            rest = trips - done
            if clean and not st.in_flight and rest:
                # Same state at both ends: every remaining iteration repeats this one, shifted.
                shift = st.now - before.now
                st.now += rest * shift
                st.comm_free += rest * shift
                st.compute_s += rest * (st.compute_s - before.compute_s)
                for totals, old in ((st.comm, before.comm), (st.exposed, before.exposed)):
                    for key in totals:
                        totals[key] += rest * (totals[key] - old.get(key, 0.0))
                new = len(before.windows)
                st.windows[new:] = [
                    dataclasses.replace(w, count=w.count * (rest + 1)) for w in st.windows[new:]
                ]
                break
        return st


def simulate(
    ops: Sequence[Op],
    hardware: Hardware,
    *,
    default_trip_count: int = 1,
    measured: Mapping[str, float] | None = None,
) -> ScheduleEstimate:
    """Replay scheduled ops on a compute and a communication stream.

    Args:
      ops: `parse`'s output (or hand-made `Op`s).
      hardware: the device model.
      default_trip_count: iterations of a loop whose trip count XLA could not prove.
      measured: seconds by instruction name, replacing the model's for those ops.

    Returns:
      The `ScheduleEstimate`.
    """
    if default_trip_count < 0:
        raise ValueError(f"default_trip_count must be >= 0, got {default_trip_count!r}")
    replay = _Replay(hardware, default_trip_count, dict(measured or {}))
    st = replay.run(ops, _State())
    for start, issued, finish, seconds in st.in_flight.values():  # never waited for
        st.windows.append(_window(start, seconds, issued, finish, 0.0))
    step = max(st.now, st.comm_free)
    exposed = sum(st.exposed.values())
    st.windows.sort(key=lambda w: w.issue_s)
    return ScheduleEstimate(
        hardware=hardware.name,
        step_s=step,
        compute_s=st.compute_s,
        comm_s=sum(st.comm.values()),
        exposed_s=exposed,
        comm_by_kind=dict(st.comm),
        exposed_by_kind=dict(st.exposed),
        windows=tuple(st.windows),
        notes=tuple(dict.fromkeys(replay.notes)),
    )


def estimate(program, hardware: Hardware = H100_SXM, **kwargs) -> ScheduleEstimate:
    """`simulate(parse(text), hardware)` of a compiled program.

    Args:
      program: compiled HLO text, or anything with a `.text` holding it (`aot.Compiled`).
      hardware: the device model (`H100_SXM`, `TPU_V5E`, `TPU_V5P`, or your own).
      **kwargs: `default_trip_count`, `measured`, as for `simulate`.

    Returns:
      The `ScheduleEstimate`.
    """
    text = program if isinstance(program, str) else program.text
    return simulate(parse(text), hardware, **kwargs)
