"""The processes of one run talking through the `jax.distributed` coordination service.

Under `jax.distributed` every process holds a client of the coordination service (process 0
hosts it): a key-value store and barriers that work before, and without, any device collective.
moejax uses them for two things:

- `exchange` / `disagreements`: each process posts a small record (the flags it was given) and
  reads everyone's, so processes started with different settings are told apart in one line per
  difference before anything compiles (`moejax.cli.train_lm`).
- `StopAgreement`: at each step boundary every process says whether it received SIGTERM or
  SIGINT and waits at a barrier; then all read the same set of requests, so one signal to any
  one process stops every process after the same step (`moejax.training.loop`).

The key-value store and `wait_at_barrier` are those of
`jax._src.distributed.global_state.client` (the same calls on jax 0.10.2, 0.11 and 0.12).
"""

from __future__ import annotations

import itertools
import json

_DAY_MS = 24 * 3600 * 1000


def client():
    """The coordination-service client of this process, or None (not under jax.distributed)."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - every supported jax has it
        return None
    state = distributed.global_state
    if state.client is None or not state.num_processes or state.num_processes < 1:
        return None
    return state.client


def process_info() -> tuple[int, int]:
    """`(process id, process count)` as `jax.distributed` was initialised ((0, 1) otherwise);
    read without starting jax's backends (unlike `jax.process_index()`)."""
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None:
        return 0, 1
    return int(state.process_id), int(state.num_processes)


class PeerTimeout(RuntimeError):
    """A peer posted nothing within the time allowed."""


def exchange(tag: str, payload, *, timeout_s: float) -> list:
    """Every process's `payload` (JSON-able), in process order; this process's included.

    Each process posts `moejax/<tag>/<id>` and reads the others' keys. Raises PeerTimeout
    naming the first process that posted nothing within `timeout_s`."""
    me, count = process_info()
    kv = client()
    if kv is None or count == 1:
        return [payload]
    kv.key_value_set(f"moejax/{tag}/{me}", json.dumps(payload))
    out = []
    for p in range(count):
        if p == me:
            out.append(payload)
            continue
        try:
            text = kv.blocking_key_value_get(f"moejax/{tag}/{p}", int(timeout_s * 1000))
        except Exception as err:  # DEADLINE_EXCEEDED from the service (JaxRuntimeError)
            if "DEADLINE_EXCEEDED" in str(err) or "timed out" in str(err).lower():
                raise PeerTimeout(
                    f"process {p} sent nothing within {timeout_s:g} s (still starting, or "
                    "stopped: see its output)"
                ) from None
            raise
        out.append(json.loads(text))
    return out


def _show(value) -> str:
    return "not given" if value is None else json.dumps(value)


def disagreements(records: list[dict]) -> list[str]:
    """One line per key whose value differs between processes' `records` (dicts of name ->
    JSON value, in process order): `--batch-size is 8 on process 0, 16 on process 1`."""
    lines = []
    names = list(dict.fromkeys(itertools.chain.from_iterable(records)))
    for name in names:
        values = [r.get(name) for r in records]
        if all(v == values[0] for v in values):
            continue
        groups: dict[str, list[int]] = {}
        for p, v in enumerate(values):
            groups.setdefault(_show(v), []).append(p)
        parts = []
        for shown, ids in groups.items():
            who = "process" if len(ids) == 1 else "processes"
            parts.append(f"{shown} on {who} {', '.join(map(str, ids))}")
        lines.append(f"{name} is {', '.join(parts)}")
    return lines


_SESSIONS = itertools.count()


class StopAgreement:
    """One stop decision for all processes, taken at step boundaries.

    `agree(boundary, received)` posts this process's signal (if any) under the boundary's key,
    waits at a barrier every process reaches at that boundary, then reads the requests posted
    for it: every process reads the same set (each was posted before its poster reached the
    barrier), so all stop after the same step. A signal that arrives after a process passed a
    boundary is posted at its next one. Costs one barrier per step (a round trip to the
    coordination service: about a millisecond on one host).
    """

    def __init__(self):
        self._kv = client()
        self._me, self._count = process_info()
        # train() is called the same number of times on every process: the same session ids.
        self._session = next(_SESSIONS)
        self._posted = False

    @classmethod
    def current(cls) -> StopAgreement | None:
        """An agreement among this run's processes, or None on a single process."""
        if client() is None or process_info()[1] == 1:
            return None
        return cls()

    def agree(self, boundary, received: str | None) -> str | None:
        """The reason every process stops at `boundary` (`"SIGTERM"` for this process's own
        signal, `"SIGTERM on process 1"` for another's; the lowest process id's if several),
        or None to go on."""
        prefix = f"moejax/train{self._session}/stop"
        if received and not self._posted:
            self._kv.key_value_set(f"{prefix}/{boundary}/{self._me}", received)
            self._posted = True
        # No timeout of its own: a process that died is detected by jax's heartbeats.
        self._kv.wait_at_barrier(f"{prefix}-barrier", _DAY_MS)
        requests = self._kv.key_value_dir_get(f"{prefix}/{boundary}/")
        if not requests:
            return None
        first = min(requests, key=lambda kv: int(kv[0].rsplit("/", 1)[-1]))
        who = int(first[0].rsplit("/", 1)[-1])
        return first[1] if who == self._me else f"{first[1]} on process {who}"
