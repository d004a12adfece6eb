"""The stderr of a `train_lm` process under `jax.distributed`, turned into one line when a peer
is lost.

When a process of the run dies (kill -9, a crashed host) jax's coordination service notices
(process 0 within `heartbeat_timeout_seconds`; the others at once when process 0 itself is
gone) and aborts every other process from a C++ thread: a 20-line log and stack trace, exit
code 134. Python cannot catch that abort in the process, so `train_lm` runs with its stderr
piped through this filter, a separate small process (this file run as a script: no jax, no
moejax imports) that outlives it:

- everything passes through unchanged, except the coordination service's log lines
  (held back while they accumulate, and passed through after a few seconds or at the end if no
  abort follows);
- on the abort's `Terminating process because the JAX distributed service detected fatal
  errors` line it writes instead one line: which process is gone and which checkpoint of the
  run directory to resume from, and drops the rest of the C++ report.

`train_lm` also sets SIGABRT's handler to `_exit`, so the process ends with exit code 6
(`EXIT_PEER_LOST`) instead of 134 and no core dump.

  python moejax/cli/_guard.py RUN_DIR HEARTBEAT_TIMEOUT_S < stderr-pipe
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import sys
import time

# "E1203 07:39:59.068091   18816 coordination_service.cc:1518] ..."
_GLOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ (?P<file>[^:\]]+)[:\]]")
_SERVICE_FILES = (b"coordination", b"preemption_sync_manager", b"client.h")
_FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
_UNHEALTHY = b"stopped sending heartbeats"
_LEADER = b"Failed to send RPC to coordination service"
_HOLD_S = 5.0  # service log lines not followed by an abort within this are passed through


def newest_checkpoint(run_dir: str) -> int | None:
    """The newest finished checkpoint step of `run_dir` (orbax renames a step directory into
    place only when every process has written it)."""
    ckpts = os.path.join(run_dir, "checkpoints")
    try:
        steps = [int(n) for n in os.listdir(ckpts) if n.isdigit()]
    except OSError:
        return None
    return max(steps, default=None)


def lost_line(run_dir: str, gone: list[int], leader_gone: bool, timeout_s: str) -> str:
    """The one line that replaces the abort's report."""
    if gone:
        names = ", ".join(map(str, sorted(set(gone))))
        who = f"process {names} is" if len(set(gone)) == 1 else f"processes {names} are"
        what = f"{who} gone (no heartbeat for {timeout_s} s)"
    elif leader_gone:
        what = "process 0 (the coordinator) is gone"
    else:
        what = "the jax.distributed service failed (another process stopped)"
    step = newest_checkpoint(run_dir)
    if step is None:
        resume = "no checkpoint was written yet: rerunning every process starts from step 0"
    else:
        where = os.path.join(run_dir, "checkpoints", str(step))
        resume = f"rerun every process with the same flags to resume from step {step} ({where})"
    return f"error: {what}; this process stops too (exit 6); {resume}\n"


class Filter:
    def __init__(self, run_dir: str, timeout_s: str, write):
        self.run_dir, self.timeout_s, self.write = run_dir, timeout_s, write
        self.held: list[bytes] = []  # service log lines (and what followed them) held back
        self.held_since = 0.0
        self.gone: list[int] = []
        self.leader_gone = False
        self.expect_ids = False
        self.fatal, self.fatal_at, self.emitted = False, 0.0, False

    def line(self, line: bytes) -> None:
        if self.emitted:
            return  # the rest of the C++ report
        if self.expect_ids:
            ids = line.strip().replace(b",", b" ").split()
            if ids and all(i.isdigit() for i in ids):
                self.gone += [int(i) for i in ids]
            else:
                self.expect_ids = False
        if _UNHEALTHY in line:
            self.expect_ids = True
        if _LEADER in line:
            self.leader_gone = True
        if self.fatal:  # the ids of the processes gone follow the abort's line
            if not self.expect_ids:
                self.emit()
            return
        m = _GLOG.match(line)
        service = m is not None and any(f in m.group("file") for f in _SERVICE_FILES)
        if service and not self.held:
            self.held_since = time.monotonic()
        if _FATAL in line:
            self.fatal, self.fatal_at, self.held = True, time.monotonic(), []
            if not self.expect_ids:
                self.emit()
            return
        if service or self.held:
            self.held.append(line)
        else:
            self.write(line)

    def emit(self) -> None:
        if not self.emitted:
            self.emitted = True
            line = lost_line(self.run_dir, self.gone, self.leader_gone, self.timeout_s)
            self.write(line.encode())

    def tick(self) -> None:
        """Pass held lines through once no abort followed them."""
        if self.fatal and time.monotonic() - self.fatal_at > 0.5:
            self.emit()
        if self.held and time.monotonic() - self.held_since > _HOLD_S:
            for line in self.held:
                self.write(line)
            self.held = []

    def close(self) -> None:
        if self.fatal:
            self.emit()
        for line in self.held:
            self.write(line)
        self.held = []


def main(argv) -> int:
    run_dir, timeout_s = argv[1], argv[2]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the trainer decides; this ends at its EOF

    def write(data: bytes) -> None:
        with contextlib.suppress(OSError):
            os.write(1, data)

    filt = Filter(run_dir, timeout_s, write)
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 1.0)
        filt.tick()
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            filt.line(line + b"\n")
        # A partial line (a progress bar's \r updates) passes at once unless it may be a log line.
        if pending and not filt.held and not filt.fatal and not re.match(rb"^[IWEF]\d", pending):
            write(pending)
            pending = b""
    if pending:
        filt.line(pending)
    filt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
