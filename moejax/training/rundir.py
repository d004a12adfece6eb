"""A run directory belongs to one run at a time, and only to moejax runs.

- **Lock.** A run holds an advisory lock on `<run_dir>/.moejax-run.lock` (`fcntl.flock`, so the
  kernel releases it when the process dies, however it dies) with its pid, host and start time
  in the file. A second run on the same directory fails at once with `RunDirBusy`, one line
  naming the holder. A lock file naming a process that no longer holds the lock (a run killed
  with SIGKILL, or a crashed host) is taken over, with a one-line message naming it. The lock
  is re-entrant within a process (`experiments/train_lm.py` holds it around `train`, which
  takes it too), and only process 0 of a multi-process run takes it. Advisory: it keeps moejax
  runs apart, not other programs; on a network file system it is as good as that system's
  `flock`.
- **Foreign directories.** A run writes only into a directory that is absent, empty, one of its
  own (the lock file is there), or a run directory written before locks existed (only the
  entries a run writes); anything else is refused with `RunDirError` naming what is there
  (the run's plots and files would otherwise land over a user's).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import time

LOCK_NAME = ".moejax-run.lock"
# What runs write (a directory holding only these is a run directory of an older moejax).
RUN_ENTRIES = frozenset({
    "metrics.jsonl", "tensorboard", "checkpoints", "routing_trace.npy", "loss.png",
    "expert_load.png", "tuning_events.jsonl", "placement_events.jsonl",
    "placement_forecast.png", "placement_controller.json", "jax_cache",
})  # fmt: skip


class RunDirError(ValueError):
    """A run directory moejax may not use (names it and why)."""


class RunDirBusy(RunDirError):
    """The run directory is locked by another run (names its pid, host and start)."""


def _written_by_runs(name: str) -> str:
    """`name`, or the file a leftover temporary of `replace_atomically` was to replace
    (`loss.tmp-123.png` -> `loss.png`)."""
    m = re.fullmatch(r"(.+)\.tmp-\d+(\.[^.]*)?", name)
    return m.group(1) + (m.group(2) or "") if m else name


def check_run_dir(run_dir: str) -> None:
    """Raise RunDirError unless `run_dir` is absent, empty, a moejax run directory (its lock
    file), or holds only what runs write."""
    if not os.path.lexists(run_dir):
        return
    if not os.path.isdir(run_dir):
        raise RunDirError(f"run directory {run_dir} exists and is not a directory")
    for d in (run_dir, os.path.join(run_dir, "checkpoints")):
        if os.path.isdir(d) and not os.access(d, os.W_OK | os.X_OK):
            raise RunDirError(
                f"run directory {run_dir}: {d} is read-only (a run writes its records and "
                "checkpoints there); make it writable (chmod -R u+w) or choose another run "
                "directory (nothing was changed)"
            )
    entries = set(os.listdir(run_dir))
    if not entries or LOCK_NAME in entries:
        return
    foreign = sorted(n for n in entries if _written_by_runs(n) not in RUN_ENTRIES)
    if foreign:
        more = f", ... ({len(foreign)} in all)" if len(foreign) > 4 else ""
        shown = ", ".join(foreign[:4]) + more
        raise RunDirError(
            f"run directory {run_dir} holds files moejax did not write ({shown}); choose another "
            "run directory (nothing was changed)"
        )


def _describe(info: dict) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (started {when})"


class RunLock:
    """The lock of one run directory (module docstring); `acquire` / `release`.

    Args:
      run_dir: the run directory (created if absent).
      log: called with a one-line message when a stale lock is taken over.
    """

    def __init__(self, run_dir: str, log=None):
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_NAME)
        self.log = log or (lambda line: None)
        self._fd: int | None = None
        self.created = False  # whether `acquire` created the directory

    def acquire(self) -> None:
        """Take the lock; RunDirBusy naming the holder if another process has it."""
        import fcntl

        self.created = not os.path.exists(self.run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunDirBusy(
                f"run directory {self.run_dir} is in use by another run: "
                f"{_describe(self._read())}; wait for it to finish, or choose another run "
                "directory"
            ) from None
        previous = self._read(fd)
        if previous.get("pid") is not None:
            self.log(
                f"taking over the lock of {self.run_dir}: {_describe(previous)} no longer "
                "holds it (killed or crashed)"
            )
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def _read(self, fd: int | None = None) -> dict:
        try:
            if fd is None:
                with open(self.path, "rb") as f:
                    raw = f.read(4096)
            else:
                raw = os.pread(fd, 4096, 0)
            info = json.loads(raw) if raw.strip() else {}
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def release(self, *, failed: bool = False) -> None:
        """Empty the lock file (released) and drop the lock. The file stays: removing it
        would let a process that opened it before the removal lock a file no one else sees.
        Except after a run that `failed` before writing anything into the directory it
        created: the directory goes, so a refused run leaves nothing behind."""
        if self._fd is None:
            return
        import fcntl

        if failed and self.created and _only_the_lock(self.run_dir):
            shutil.rmtree(self.run_dir)
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _only_the_lock(run_dir: str) -> bool:
    """Whether `run_dir` holds no file but its lock (empty folders aside)."""
    files = [os.path.join(d, f) for d, _, names in os.walk(run_dir) for f in names]
    return files == [os.path.join(run_dir, LOCK_NAME)]


_HELD: dict[str, list] = {}  # real path -> [RunLock or None, depth]: this process's locks


@contextlib.contextmanager
def run_lock(run_dir: str, log=None, *, lazy: bool = False):
    """Hold the lock of `run_dir` for the block (re-entrant within this process); checks the
    directory (`check_run_dir`) before taking it.

    Args:
      run_dir: the run directory.
      log: called with the one-line message of a stale lock taken over.
      lazy: do not take the lock now, but keep it, once a nested `run_lock` took it, until this
        block ends (a script around `train` holds it over its own outputs without creating the
        directory before `train` has checked its inputs).

    A block that raises, in a directory the lock created and nothing else wrote to, removes the
    directory (`RunLock.release`).

    Raises:
      RunDirError: a foreign directory. RunDirBusy: another run holds it.
    """
    key = os.path.realpath(run_dir)
    failed = True
    entry = _HELD.setdefault(key, [None, 0])
    entry[1] += 1
    try:
        if entry[0] is None and not lazy:
            check_run_dir(run_dir)
            lock = RunLock(run_dir, log)
            lock.acquire()
            entry[0] = lock
        failed = True
        yield
        failed = False
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[key]
            if entry[0] is not None:
                entry[0].release(failed=failed)
