"""Disk errors in one line: a full disk, a quota, a read-only file system or directory.

orbax reports a failed write as whatever its storage layer raised (tensorstore's
`ValueError: RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']`, an
`OSError`, wrapped or chained) and logs the traceback of every background thread that saw it
(hundreds of lines before the error reaches the caller). `disk_error` recognises such errors
by errno or message anywhere in the exception chain; `quiet_orbax_disk_errors` drops orbax's
log records of them (other orbax errors are still logged), so the writer's own one-line error
is all that is printed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import threading

_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
_TEXTS = {  # what tensorstore / the OS message says, in lower case
    "no space left on device": errno.ENOSPC,
    "os_error_code='28'": errno.ENOSPC,
    "disk quota exceeded": errno.EDQUOT,
    "read-only file system": errno.EROFS,
    "permission denied": errno.EACCES,
}


def disk_error(err: BaseException | None) -> str | None:
    """`"no space left on device"`, `"disk quota exceeded"`, `"read-only file system"` or
    `"permission denied"` when `err` (or an exception it was raised from or during) is one;
    else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        code = getattr(err, "errno", None)
        if isinstance(err, OSError) and code in _REASONS:
            return _REASONS[code]
        text = str(err).lower()
        for needle, code in _TEXTS.items():
            if needle in text:
                return _REASONS[code]
        err = err.__cause__ or err.__context__
    return None


class OutputWriteError(ValueError):
    """An output (a run's records, a checkpoint) could not be written for a disk error: one line
    naming the file, the reason and what to do."""


class _DropDiskErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.name == "asyncio":  # "Future exception was never retrieved" of orbax's writes
            return disk_error(exc) is None
        if "orbax" not in (record.pathname or ""):
            return True
        if disk_error(exc) is not None:
            return False
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let logging handle it
            return True
        return disk_error(Exception(message)) is None


_FILTER = _DropDiskErrors()


def _from_orbax(tb) -> bool:
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _quiet_excepthook(args) -> None:
    """`threading.excepthook` that drops a disk error of one of orbax's threads (the writer
    reports it in one line); everything else as before."""
    if disk_error(args.exc_value) is not None and _from_orbax(args.exc_traceback):
        return
    _previous_hook(args)


_previous_hook = threading.excepthook


def quiet_orbax_disk_errors() -> None:
    """Drop orbax's log records and thread tracebacks of disk errors (module docstring);
    idempotent."""
    global _previous_hook
    for name in ("absl", "orbax", "asyncio"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    if threading.excepthook is not _quiet_excepthook:
        _previous_hook = threading.excepthook
        threading.excepthook = _quiet_excepthook


def exit_quietly(code: int) -> None:
    """End a command after it reported a disk error in one line: stdout and stderr flushed,
    then `os._exit` without the interpreter's shutdown, whose atexit handlers and background
    writers (tensorboardX, orbax) would each print a traceback of the same full disk."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
