"""Output directories that never destroy what moejax did not write.

Every writer of a whole directory (`save_hf_model`, `CheckpointWriter`, the converted-model
writer behind `convert_hf.py`) goes through `OutputDir`:

- **Refusals, before anything is written.** The output may not be, lie inside, or contain one of
  the inputs. An existing output must be absent or an empty directory, unless it is an earlier
  output of moejax (a `.moejax-output.json` marker listing its top-level entries and every file
  it wrote, at any depth) and `overwrite` is set; a directory holding anything its marker does
  not list (a README the user added, a `thesis.tex`, a run's checkpoints, a user's file inside
  `params/`) is refused even then, naming those files. A marker of an older moejax lists only
  the top-level entries: below them, a file changed or added after the marker was written (its
  `ctime` later than the marker's) counts as not listed. Symlinks and files in the output's
  place are refused.
- **Atomic replacement.** Everything is written into a temporary sibling `.<name>.tmp-*` (its
  marker written first) and swapped with the old output in one `renameat2(RENAME_EXCHANGE)`
  (Linux), so a kill at any moment leaves either the old output or the new one complete at the
  path, never neither or half; the old one is then deleted from the temporary name, marker
  last. Where the exchange is not available (other systems, some network file systems) the old
  output is renamed aside (`.<name>.old-*`) before the new one is renamed in; a kill between
  the two leaves it there, and the next write to the same path renames it back first.
- **Leftovers.** What a killed writer leaves beside the path is deleted by the next write to
  it: a half-written temporary sibling (its marker names a process of this host that no longer
  runs), or a complete earlier output swapped out and not yet deleted (its marker lists its
  entries). Two writers of one output at the same time are not supported.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import socket
import sys
import tempfile

from moejax.interop.hf._errors import CheckpointError

MARKER = ".moejax-output.json"
FORMAT = "moejax-output/1"
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _umask() -> int:
    """This process's umask (from /proc where Linux has it: `os.umask` can only be read by
    setting it, which races with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _is_within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def _read_marker(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == FORMAT else None


def _listing(names, limit: int = 4) -> str:
    names = sorted(names)
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_output(path: str, *, overwrite: bool, inputs=()) -> None:
    """Raise CheckpointError (naming the path and why) unless `path` may be written: not one
    of `inputs` nor inside or around one, and absent, an empty directory, or (with
    `overwrite`) an earlier moejax output holding only what its marker lists."""
    real = os.path.realpath(path)
    for given in inputs:
        other = os.path.realpath(given)
        if _is_within(real, other) or _is_within(other, real):
            how = "is" if real == other else "lies inside" if _is_within(real, other) else "holds"
            raise CheckpointError(
                f"the output {how} the input {given!r}; choose an output outside it",
                file=str(path),
            )
    if not os.path.lexists(path):
        return
    if os.path.islink(path):
        raise CheckpointError("the output is a symlink; give the directory itself", file=path)
    if not os.path.isdir(path):
        raise CheckpointError("exists and is not a directory; nothing was changed", file=path)
    entries = set(os.listdir(path))
    if not entries:
        return
    marker = _read_marker(path)
    if marker is None:
        raise CheckpointError(
            f"exists and holds files moejax did not write ({_listing(entries)}); choose "
            "another output (nothing was changed)",
            file=path,
        )
    foreign = entries - set(marker.get("entries", ())) - {MARKER}
    if not foreign:
        foreign = _unlisted_files(path, marker)
    if foreign:
        raise CheckpointError(
            f"holds an earlier moejax output and files moejax did not write "
            f"({_listing(foreign)}); move those away or choose another output (nothing was "
            "changed)",
            file=path,
        )
    if not overwrite:
        raise CheckpointError(
            f"holds an earlier moejax output ({marker.get('kind', '?')}); pass --overwrite "
            "(overwrite=True) to replace it",
            file=path,
        )
    locked = _read_only_dirs(path)
    if locked:
        raise CheckpointError(
            f"holds an earlier moejax output that cannot be deleted: {_listing(locked)} "
            "read-only; make it writable (chmod -R u+w) or choose another output (nothing was "
            "changed)",
            file=path,
        )


def _read_only_dirs(path: str) -> list[str]:
    """Directories under `path` (itself included) whose entries this process may not delete
    (no write or search permission: replacing the output would swap the new one in and then
    fail deleting the old one). Root may delete anything: `os.access` says so."""
    out = []
    for d, _, _ in os.walk(path):
        if not os.access(d, os.W_OK | os.X_OK):
            rel = os.path.relpath(d, path)
            out.append("." if rel == "." else rel.replace(os.sep, "/"))
    return out


def _files(directory: str) -> list[str]:
    """Every file under `directory` (symlinks included, a symlinked directory not followed), as
    `/`-separated paths relative to it, the marker excepted."""
    out = []
    for d, dirs, names in os.walk(directory):
        rel = os.path.relpath(d, directory)
        links = [n for n in dirs if os.path.islink(os.path.join(d, n))]
        for n in names + links:
            out.append(n if rel == "." else f"{rel}/{n}".replace(os.sep, "/"))
    return sorted(set(out) - {MARKER, MARKER + ".tmp"})


def _unlisted_files(path: str, marker: dict) -> set[str]:
    """Files under `path` its marker does not list (module docstring: refusals)."""
    found = _files(path)
    if "files" in marker:
        return set(found) - set(marker["files"])
    # An older marker lists the top-level entries only: what changed after it was written.
    try:
        written = os.lstat(os.path.join(path, MARKER)).st_ctime_ns
    except OSError:
        return set(found)
    return {f for f in found if "/" in f and os.lstat(os.path.join(path, f)).st_ctime_ns > written}


def _write_marker(directory: str, kind: str, entries=None) -> None:
    marker = {"format": FORMAT, "kind": kind, "pid": os.getpid(), "host": socket.gethostname()}
    if entries is not None:
        marker["entries"] = sorted(entries)
        marker["files"] = _files(directory)
    tmp = os.path.join(directory, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(directory, MARKER))


def _remove_ours(directory: str) -> None:
    """Delete a directory of ours, its marker last (a leftover is then still recognisable)."""
    for name in os.listdir(directory):
        if name == MARKER:
            continue
        full = os.path.join(directory, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        elif os.path.lexists(full):
            os.unlink(full)
    marker = os.path.join(directory, MARKER)
    if os.path.lexists(marker):
        os.unlink(marker)
    os.rmdir(directory)


def _pid_running(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # another user's process (or an unreadable pid): assume alive
    return True


def _siblings(path: str, kind: str) -> list[str]:
    parent, name = os.path.split(os.path.abspath(path))
    prefix = f".{name}.{kind}-"
    try:
        return [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return []


def recover(path: str, log=None) -> None:
    """Put back an output a killed fallback replacement left aside, and delete what killed
    writers left beside `path` (module docstring: leftovers)."""
    log = log or (lambda line: print(f"moejax: {line}", file=sys.stderr))
    if not os.path.lexists(path):
        aside = [d for d in _siblings(path, "old") if _read_marker(d)]
        if aside:
            os.rename(sorted(aside)[-1], path)
            log(f"{path}: put back the earlier output a killed replacement had set aside")
    host = socket.gethostname()
    for tmp in _siblings(path, "tmp") + _siblings(path, "old"):
        marker = _read_marker(tmp)
        if marker is None:
            continue
        dead = marker.get("host") == host and not _pid_running(marker.get("pid"))
        if dead or "entries" in marker:  # half-written by a dead writer, or swapped out
            try:
                _remove_ours(tmp)
            except OSError as err:  # (read-only, say): left there, named once per write
                log(f"{tmp}: a leftover of an earlier write could not be deleted ({err})")


def _exchange(a: str, b: str) -> bool:
    """Swap paths `a` and `b` atomically (Linux `renameat2(RENAME_EXCHANGE)`); False where
    the system or the file system does not offer it."""
    if not sys.platform.startswith("linux"):
        return False
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


class OutputDir:
    """A directory written through a temporary sibling and swapped into place (module
    docstring). Write into `self.tmp`; `commit()` swaps it in, `abort()` removes it; as a
    context manager it commits on success and aborts on an exception.

    Args:
      path: the output directory.
      kind: what is written ("hf-checkpoint", "converted"), recorded in the marker.
      overwrite: replace an earlier moejax output at `path`.
      inputs: paths the output may not be, lie in, or hold.

    Raises:
      CheckpointError: `check_output` refuses `path` (nothing is written).
    """

    def __init__(self, path, *, kind: str, overwrite: bool = False, inputs=()):
        self.path = os.path.abspath(os.fspath(path))
        self.kind, self.overwrite, self.inputs = kind, overwrite, tuple(inputs)
        recover(self.path)
        check_output(self.path, overwrite=overwrite, inputs=self.inputs)
        parent, name = os.path.split(self.path)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
        # mkdtemp's 0700 would become the output's mode: the umask's default instead, as for
        # every file and directory written inside it (and by `mkdir`).
        os.chmod(self.tmp, 0o777 & ~_umask())
        _write_marker(self.tmp, kind)  # first: a killed writer's leftover is recognisable

    def commit(self) -> str:
        """Swap the written directory into place; returns the path."""
        try:
            entries = set(os.listdir(self.tmp)) - {MARKER}
            _write_marker(self.tmp, self.kind, entries)
            check_output(self.path, overwrite=self.overwrite, inputs=self.inputs)  # since?
        except BaseException:
            self.abort()
            raise
        if not os.path.lexists(self.path):
            os.rename(self.tmp, self.path)  # atomic; fails if the path appeared meanwhile
            return self.path
        if _exchange(self.tmp, self.path):
            old = self.tmp  # the swap left the old output at the temporary name
        else:
            parent, name = os.path.split(self.path)
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rmdir(old)
            os.rename(self.path, old)
            os.rename(self.tmp, self.path)
        try:
            if _read_marker(old) is not None:
                _remove_ours(old)
            else:  # an empty directory was there
                os.rmdir(old)
        except OSError as err:  # the new output is in place: say what is left, do not fail
            print(f"moejax: {old}: the replaced output could not be deleted ({err})",
                  file=sys.stderr)  # fmt: skip
        return self.path

    def abort(self) -> None:
        """Remove everything written so far."""
        if os.path.lexists(self.tmp):
            _remove_ours(self.tmp)

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
