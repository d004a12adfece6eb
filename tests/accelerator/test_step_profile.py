"""`experiments/step_profile.py` (a train step's measured time by kernel class, from a jax trace
read by `moejax.aot.trace`) and `experiments/bench_attention.py` (the attention cores forward +
backward) on this CPU machine: the trace reader on a trace shaped as an H200's, and
`--dry-run` of both scripts. What they measure needs a GPU (BENCHMARKS.md)."""

import gzip
import json
import os
import pathlib
import subprocess
import sys

import pytest

from moejax.aot import trace

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _event(pid, op, dur, module="jit_train_step"):
    args = {"hlo_module": module, "hlo_op": op, "correlation_id": "1"}
    return {"ph": "X", "pid": pid, "tid": 14, "ts": 0.0, "dur": dur, "name": op, "args": args}


def _trace(tmp_path, events) -> pathlib.Path:
    names = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    path = tmp_path / "plugins" / "profile" / "run" / "host.trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": names + events}, f)
    return path


def test_kernel_seconds_sums_the_gpu_kernels_of_the_step_per_instruction(tmp_path):
    """The GPU's kernel events of the step's module, summed per XLA instruction (one
    instruction may launch several kernels); host events and other modules left out."""
    path = _trace(
        tmp_path,
        [
            _event(1, "fusion.1", 100.0),
            _event(1, "fusion.1", 50.0),
            _event(1, "custom-call.3", 7.0),
            _event(701, "fusion.1", 1e6),  # the host's view of the same op
            _event(1, "fusion.9", 1e6, module="jit_other"),
            {"ph": "X", "pid": 1, "tid": 14, "ts": 0.0, "dur": 5.0, "name": "memcpy", "args": {}},
        ],
    )
    assert trace.trace_file(tmp_path) == path
    seconds, where = trace.kernel_seconds(path, "jit_train_step")
    assert where == "GPU kernels"
    assert seconds == pytest.approx({"fusion.1": 150e-6, "custom-call.3": 7e-6})
    with pytest.raises(ValueError, match="no GPU kernels of module 'jit_step'.*jit_other"):
        trace.kernel_seconds(path, "jit_step")


def _run(script, *args, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it
    return subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), "--dry-run", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.slow  # ~1.5 min on 2 cores
def test_step_profile_dry_run_measures_and_models_each_class(tmp_path):
    out = _run("step_profile.py", "--out", str(tmp_path), "--fp8-pipelines", "per_tile,stream")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["configs"]["dry"]
    assert list(rows) == ["bf16", "fp8_per_tile", "fp8_stream"]
    for precision in rows:
        row = rows[precision]
        assert row["step_ms"] > 0 and row["measured_on"] == "host XLA ops"
        measured = {k: c["measured_ms"] for k, c in row["classes"].items()}
        assert measured["unmatched"] == 0  # every traced op found in the compiled program
        assert measured["rest of the MoE layer"] > 0 and measured["everything else"] > 0
        assert row["top_ops"] and row["modelled_step_ms"] > 0
    assert (tmp_path / "dry_fp8_stream.trace.json.gz").exists()
    text = (tmp_path / "results.md").read_text()
    assert "| step (wall) |" in text and "fp8_stream / bf16 step:" in text


def test_step_profile_refuses_an_unknown_fp8_pipeline(tmp_path):
    out = _run("step_profile.py", "--out", str(tmp_path), "--fp8-pipelines", "stream,ring")
    assert out.returncode != 0
    assert "'ring' is not one of ('per_tile', 'stream')" in out.stderr


def test_bench_attention_dry_run_checks_each_core_against_xla(tmp_path):
    out = _run("bench_attention.py", "--out", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r["impl"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    triton = rows["triton b=32,32,32,32 w=-"]  # the Triton kernel, interpreted on a CPU
    assert triton["ms"] > 0 and max(triton["rel_err"].values()) < 2e-2  # bf16 outputs
    assert "error" in rows["cudnn"]  # cuDNN runs on NVIDIA GPUs only
