"""Values every process of a run must hold alike, decided on process 0 and shared with the others.

A value measured (a timing) or decided (by a host-side controller) separately on each process
may differ between them, and processes that apply different values to one global state (another
expert placement, another strategy) no longer run one program. `from_process_0` hands every
process process 0's value: through the `jax.distributed` coordination service's key-value store
(host to host, no device program: it does not wait for the step in flight), or, without a
coordination client, `jax.experimental.multihost_utils.broadcast_one_to_all`.

Calls pair up by topic and order: the n-th call of a topic on one process receives the n-th
call's value on process 0, so every process must make the same calls in the same order (as the
training loop does: one per step).
"""

from __future__ import annotations

import collections
import json

import jax
import numpy as np

TIMEOUT_MS = 10 * 60 * 1000  # how long a process waits for process 0's value
_calls: collections.Counter = collections.Counter()  # calls so far, by topic


def from_process_0(topic: str, value, *, keep: int | None = None):
    """Process 0's `value` on every process (one process: `value` itself).

    Args:
      topic: names the value (`"placement/decisions"`); see the module docstring.
      value: JSON-serialisable (what every process gets is it read back from JSON: tuples are
        lists, on process 0 too). Only process 0's is used.
      keep: with the key-value store, process 0 deletes the key of the call `keep` calls back
        (for a topic shared every step; every process has read it by then).

    Raises:
      TimeoutError: process 0's value did not come within `TIMEOUT_MS`.
    """
    if jax.process_count() == 1:
        return value
    n = _calls[topic]
    _calls[topic] += 1
    key = f"moejax/{topic}/{n}"
    client = _client()
    if client is None:
        return _broadcast(value)
    if jax.process_index() == 0:
        text = json.dumps(value)
        client.key_value_set(key, text)
        if keep is not None and n >= keep:
            client.key_value_delete(f"moejax/{topic}/{n - keep}")
        return json.loads(text)
    try:
        return json.loads(client.blocking_key_value_get(key, TIMEOUT_MS))
    except Exception as err:  # the client raises XlaRuntimeError (DEADLINE_EXCEEDED)
        raise TimeoutError(
            f"process {jax.process_index()}: no value {key!r} from process 0 within "
            f"{TIMEOUT_MS // 1000} s ({type(err).__name__}: {str(err)[:200]})"
        ) from None


def _client():
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return distributed.global_state.client


def _broadcast(value):
    """`from_process_0` without a coordination client: two device broadcasts (size, bytes)."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8) if jax.process_index() == 0 else None
    size = int(multihost_utils.broadcast_one_to_all(np.int32(0 if data is None else data.size)))
    buf = np.zeros(size, np.uint8)
    if data is not None:
        buf[:] = data
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).decode())
