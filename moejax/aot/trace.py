"""Device time per XLA instruction, read from a jax profiler trace: the measured counterpart of
the schedule model (`moejax.aot.schedule`), joined to the compiled program by instruction name.

`jax.profiler.trace(log_dir)` exports a trace-viewer file (`<host>.trace.json.gz`) under
`log_dir/plugins/profile/<run>/` (`trace_file` finds it). On a GPU each kernel the program
launches is an event of the `/device:GPU:N` process whose args name its XLA module
(`hlo_module`) and instruction (`hlo_op`); on a CPU the host's XLA ops carry the same args.
`kernel_seconds` sums those events per instruction of one module; with CUDA graphs off
(`--xla_gpu_enable_command_buffer=`) every kernel is traced with its instruction
(`experiments/step_profile.py` does that).

>>> import gzip, json, pathlib, tempfile
>>> run = pathlib.Path(tempfile.mkdtemp()) / "plugins" / "profile" / "run"
>>> run.mkdir(parents=True)
>>> gpu = {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}}
>>> k = {"ph": "X", "pid": 1, "dur": 5.0, "args": {"hlo_module": "jit_f", "hlo_op": "fusion.1"}}
>>> with gzip.open(run / "host.trace.json.gz", "wt") as f:
...     json.dump({"traceEvents": [gpu, k, k]}, f)
>>> kernel_seconds(trace_file(run.parents[2]), "jit_f")
({'fusion.1': 1e-05}, 'GPU kernels')
"""

from __future__ import annotations

import gzip
import json
import pathlib


def trace_file(log_dir) -> pathlib.Path:
    """The trace-viewer JSON that `jax.profiler.trace(log_dir)` exported last."""
    found = sorted(pathlib.Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}")
    return found[-1]


def kernel_seconds(path, module: str) -> tuple[dict[str, float], str]:
    """`({instruction: seconds in all}, where)`: device time per XLA instruction of `module`
    (a compiled module's name, as `HloModule <name>` says) in the trace at `path`: the GPU's
    kernel events where the trace has a GPU ("GPU kernels"), else the host's XLA ops ("host
    XLA ops"). One instruction may launch several kernels; their times add up.

    Raises:
      ValueError: no such events of `module` (the message lists the modules there are).
    """
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    gpus = {pid for pid, name in names.items() if "/device:GPU" in name}
    per_op: dict[str, float] = {}
    modules: dict[str, float] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args or (gpus and e["pid"] not in gpus):
            continue
        name = args.get("hlo_module", "")
        modules[name] = modules.get(name, 0.0) + e["dur"]
        if name.split("(")[0] == module:  # microseconds, summed
            per_op[args["hlo_op"]] = per_op.get(args["hlo_op"], 0.0) + e["dur"]
    where = "GPU kernels" if gpus else "host XLA ops"
    if not per_op:
        raise ValueError(f"no {where} of module {module!r} in the trace; modules: {modules}")
    return {op: us / 1e6 for op, us in per_op.items()}, where
