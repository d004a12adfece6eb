"""`train_lm` under `jax.distributed`: whether to initialise it, how, and the checks that every
process was given the same run.

Decision (`decide`, `--distributed auto|on|off`):

- `--coordinator` given: `jax.distributed.initialize(coordinator, --num-processes,
  --process-id)` (explicit flags; any of them missing is filled in by jax's cluster detection).
- `auto` (default) without `--coordinator`: `jax.distributed.initialize()` with no arguments,
  so jax detects the cluster, when the environment is one jax detects and it runs more than one
  process (`cluster_environment`): a SLURM step (`srun`), an Open MPI job (`mpirun`), a Cloud
  TPU pod slice or a GKE TPU/JobSet pod (`TPU_WORKER_HOSTNAMES`, `MEGASCALE_*`), a Kubernetes
  indexed job with the `kubernetes` package; otherwise a single process, nothing initialised.
- `on`: always initialise (jax detects what the flags do not give; e.g. a Cloud TPU VM pod
  whose workers jax finds through the metadata server only); `off`: never.

Faults (tests/training/test_faults.py): a process that disagrees is one line per difference on
every process, exit 2, before anything compiles; a process that is killed makes every other one
exit 6 within `--peer-timeout` seconds (jax's heartbeat timeout) with one line naming it and the
checkpoint to resume from (`moejax/cli/_guard.py`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.util
import os
import signal
import subprocess
import sys

from moejax.cli._errors import InputError

EXIT_PEER_LOST = 6  # SIGABRT's number: the handler is libc's _exit itself (no Python)
# Flags that may differ between processes of one run (the rest must agree).
PER_PROCESS = frozenset({"process_id", "debug", "no_progress", "coordinator", "jax_cache"})
# Flags compared through the TrainConfig they set (a flag left out and the preset's default
# are the same run).
VIA_TRAIN_CONFIG = frozenset(
    {
        "steps", "batch_size", "seq_len", "lr", "seed", "checkpoint_every", "keep",
        "eval_batches", "expert_slots", "remat", "scan", "delay_wgrad", "microbatches",
        "max_skipped_fraction", "bf16_moments",
    }
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Decision:
    how: str | None  # "explicit", "detect" or None (a single process, nothing initialised)
    why: str  # for the start-up line


def _count(environ, *names) -> int | None:
    for name in names:
        value = environ.get(name)
        if value is not None:
            try:
                return int(str(value).split("(")[0])  # SLURM writes e.g. "2(x4)"
            except ValueError:
                return None
    return None


def cluster_environment(environ=None, *, find_spec=importlib.util.find_spec) -> str | None:
    """The multi-process cluster jax.distributed would detect here, from environment variables
    only (no network), or None. Mirrors jax's `clusters.*.is_env_present` (jax 0.10 to 0.12),
    and asks for more than one process so a single task (e.g. a 1-task `srun`, a plain
    `python` inside an `sbatch` script) stays a single-process run."""
    env = os.environ if environ is None else environ
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    if all(v in env for v in (*slurm, "SLURM_LOCALID")):
        n = _count(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if n and n > 1:
            return f"SLURM (job {env['SLURM_JOB_ID']}, {n} tasks)"
    if "OMPI_MCA_orte_hnp_uri" in env:
        n = _count(env, "OMPI_COMM_WORLD_SIZE")
        if n and n > 1:
            return f"Open MPI ({n} ranks)"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
    if hosts and len([h for h in hosts.split(",") if h.strip()]) > 1:
        return f"Cloud TPU ({len(hosts.split(','))} hosts)"
    if env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "Cloud TPU multislice (MEGASCALE_COORDINATOR_ADDRESS)"
    k8s = "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env
    if k8s and find_spec("kubernetes") is not None:
        return "Kubernetes indexed job (JOB_COMPLETION_INDEX)"
    return None


def decide(args, environ=None) -> Decision:
    """Whether and how `train_lm` initialises jax.distributed (module docstring)."""
    mode = getattr(args, "distributed", "auto")
    if mode == "off":
        if args.coordinator or args.num_processes > 1:
            raise InputError(
                "--distributed=off: not with --coordinator or --num-processes > 1 (they ask "
                "for jax.distributed)"
            )
        return Decision(None, "--distributed=off")
    if args.coordinator:
        return Decision("explicit", f"--coordinator {args.coordinator}")
    if mode == "on":
        return Decision("detect", "--distributed=on")
    cluster = cluster_environment(environ)
    if cluster is not None:
        return Decision("detect", f"detected {cluster}")
    if args.num_processes > 1:
        raise InputError(
            "--num-processes > 1 needs --coordinator host:port (no cluster that jax detects "
            "here: SLURM, Open MPI, Cloud TPU, Kubernetes; or pass --distributed on)"
        )
    return Decision(None, "a single process")


def _exit_on_abort() -> None:
    """SIGABRT -> libc `_exit(6)`: jax's coordination client aborts the process from a C++
    thread when a peer is lost; the handler, C code only, ends it with exit code 6 at once."""
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGABRT, ctypes.cast(libc._exit, ctypes.c_void_p))


def _start_guard(run_dir: str, timeout_s: int) -> None:
    """Pipe this process's stderr (fd 2) through `_guard.py` (a separate process)."""
    guard = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_guard.py")
    read, write = os.pipe()
    sys.stderr.flush()
    subprocess.Popen(
        [sys.executable, "-S", guard, os.path.abspath(run_dir), str(timeout_s)],
        stdin=read,
        stdout=os.dup(2),
        stderr=subprocess.DEVNULL,
        close_fds=True,
        start_new_session=False,
    )
    os.close(read)
    os.dup2(write, 2)
    os.close(write)


def initialize(args, decision: Decision) -> None:
    """`jax.distributed.initialize` as decided, after the fault handling is in place; updates
    `args.num_processes` and `args.process_id` from what jax detected."""
    import jax
    from jax._src import distributed

    run_dir = args.out or os.path.join("runs", args.preset)
    if os.environ.get("MOEJAX_NO_STDERR_GUARD") != "1":
        _start_guard(run_dir, args.peer_timeout)
    _exit_on_abort()
    kwargs = {"heartbeat_timeout_seconds": args.peer_timeout}
    if decision.how == "explicit" or args.num_processes > 1:
        kwargs.update(num_processes=args.num_processes, process_id=args.process_id)
    if args.coordinator:
        kwargs["coordinator_address"] = args.coordinator
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as err:  # RuntimeError / ValueError / JaxRuntimeError from jax
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"jax.distributed.initialize ({decision.why}) failed: {first}") from None
    state = distributed.global_state
    args.num_processes, args.process_id = int(state.num_processes), int(state.process_id)


def await_peer_loss(timeout_s: int) -> None:
    """Called with an exception in flight under jax.distributed: a peer that died makes the
    collectives fail at once, before jax's heartbeats declare it gone. Wait that long (the
    abort then ends this process with exit 6 and `_guard.py`'s line); return (and let the
    exception show) if nothing comes."""
    import time

    deadline = time.monotonic() + timeout_s + 10
    while time.monotonic() < deadline:
        time.sleep(0.2)


def data_fingerprint(args) -> str:
    """`<sha256 prefix> (<files> files, <bytes> bytes)` of the corpus files' names (relative to
    each --data path) and sizes; the default corpus's standard-library files likewise. Reads no
    file's contents."""
    from pathlib import Path

    from moejax import data

    entries = []
    if args.data:
        for given in args.data:
            path = Path(given)
            if path.is_dir():
                files = sorted(
                    p
                    for p in path.rglob("*")
                    if p.is_file()
                    and not any(part.startswith(".") for part in p.relative_to(path).parts)
                )
                entries += [(str(p.relative_to(path)), p.stat().st_size) for p in files]
            elif path.is_file():
                entries.append((path.name, path.stat().st_size))
            else:
                entries.append((given, "missing"))
    else:
        entries = [(p.name, p.stat().st_size) for p in data.stdlib_files()]
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()[:12]
    size = sum(s for _, s in entries if isinstance(s, int))
    return f"{digest} ({len(entries)} files, {size} bytes)"


def _versions() -> dict:
    import importlib.metadata

    import jax
    import jaxlib

    try:
        moejax_version = importlib.metadata.version("moejax")
    except importlib.metadata.PackageNotFoundError:
        moejax_version = "unknown"
    return {
        "moejax version": moejax_version,
        "jax version": jax.__version__,
        "jaxlib version": jaxlib.__version__,
    }


def flags_record(args, *, mesh: str) -> dict:
    """What every process must have been given alike, from the flags alone (cannot fail);
    `mesh`: `--mesh` normalised (`train_inputs.mesh_text`)."""
    record = _versions()
    for name, value in sorted(vars(args).items()):
        if name in PER_PROCESS or name in VIA_TRAIN_CONFIG or name in ("mesh_axes", "upcycled"):
            continue
        if isinstance(value, str | int | float | bool | list | None):
            record["--" + name.replace("_", "-")] = mesh if name == "mesh" else value
    try:
        record["--data"] = data_fingerprint(args)
    except OSError as err:
        record["--data"] = f"unreadable ({err})"
    return record


_RECORD_TIMEOUT_S = 600.0  # each process reads its configs (and --upcycle-from's weights) first


def check_same_run(args, *, mesh: str, configs: dict | None = None, error: str | None = None):
    """Every process posts its flags record (and its configs' record, `train_inputs.
    config_record`, or the error it got deriving them) and reads everyone's: raises InputError,
    one line per difference, on every process alike. Nothing has compiled yet; a process that
    died meanwhile is caught by jax's heartbeats."""
    from moejax.training import peers

    mine = {"flags": flags_record(args, mesh=mesh), "error": error}
    if configs is not None:
        mine["configs"] = configs
    try:
        everyone = peers.exchange("run-record", mine, timeout_s=_RECORD_TIMEOUT_S)
    except peers.PeerTimeout as err:
        raise InputError(str(err)) from None
    lines = peers.disagreements([r["flags"] for r in everyone])
    if not lines and not any(r["error"] for r in everyone):
        lines = peers.disagreements([r.get("configs", {}) for r in everyone])
    if lines:
        raise Disagree(lines)
    failed = [(p, r["error"]) for p, r in enumerate(everyone) if r["error"]]
    if failed and error is None:
        p, message = failed[0]
        raise InputError(f"process {p} refused its inputs: {message}")


def check_ready(error: str | None) -> None:
    """After the rest of the set-up: every process learns whether another one refused its
    inputs (mesh, corpus, strategy), so all exit 2 together instead of one waiting for the
    others in the first step's collective."""
    from moejax.training import peers

    try:
        everyone = peers.exchange("ready", {"error": error}, timeout_s=3 * _RECORD_TIMEOUT_S)
    except peers.PeerTimeout as err:
        raise InputError(str(err)) from None
    failed = [(p, r["error"]) for p, r in enumerate(everyone) if r["error"]]
    if failed and error is None:
        p, message = failed[0]
        raise InputError(f"process {p} refused its inputs: {message}")


class Disagree(InputError):
    """Processes were given different runs: one line per difference."""

    def __init__(self, lines):
        super().__init__("\n".join(f"processes disagree: {line}" for line in lines))
        self.lines = lines
