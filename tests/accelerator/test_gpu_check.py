"""`experiments/gpu_check.py`, the script a session with a lent GPU runs first, on this CPU
machine: `--dry-run` takes every code path at tiny shapes (the kernels in their interpreters,
checked against `jax.lax.ragged_dot`), and the time limit ends the script with what it has.
What it measures on a GPU needs one (BENCHMARKS.md)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "gpu_check.py"
OURS = ("ours: Mosaic GPU", "ours: Mosaic GPU, stream", "ours: Triton")


def _run(*args, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
        timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def test_help_says_time_and_needs():
    out = _run("--help", timeout=120)
    assert out.returncode == 0, out.stderr
    for words in ("~7 min", "--time-limit", "Needs:", "no wheels to carry", "--dry-run"):
        assert words in out.stdout, words


def test_time_limit_writes_results_and_exits(tmp_path):
    """Past --time-limit the script stops mid-part with status 3, results marked aborted."""
    out = _run("--dry-run", "--parts", "train", "--time-limit", "1", "--out", str(tmp_path))
    assert out.returncode == 3, out.stdout + out.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert "time limit (1 s)" in results["aborted"]
    assert "**Aborted**" in (tmp_path / "results.md").read_text()


@pytest.mark.slow  # ~2.5 min on 2 idle cores (6.5 with other jobs beside it)
def test_dry_run_takes_every_path(tmp_path):
    out = _run("--dry-run", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert "errors" not in results and "aborted" not in results
    assert set(results["part_seconds"]) == {"numerics", "kernels", "layer", "train", "attention"}
    # The attention cores against "xla": the Triton kernel interpreted, "auto" = "xla" on a CPU.
    attention = {r["impl"]: r for r in results["attention"]}
    assert set(attention) == {"xla", "pallas", "auto"}
    assert max(attention["pallas"]["rel_err"].values()) < 2e-2  # bf16 outputs
    assert max(attention["auto"]["rel_err"].values()) == 0

    # Numerics: every kernel on both backends (Mosaic GPU on both pipelines), every case,
    # against a non-zero reference.
    rows = results["numerics"]
    assert results["numerics_ok"] and all(r["ok"] and r["ref_max"] > 0 for r in rows)
    kernels = {(r["case"], r["backend"], r["kernel"]) for r in rows}
    cases = ("zipf_aligned", "unaligned_partial", "empty_groups_aligned", "balanced_aligned")
    backends = ("pallas_mosaic_gpu", "pallas_mosaic_gpu, stream", "pallas_triton")
    assert kernels >= {(c, b, k) for c in cases for b in backends for k in ("gmm", "gmm_t", "tgmm")}
    assert {k for c, _, k in kernels if c == "grouped_matmul_vjp"} == {"out", "dlhs", "drhs"}
    assert all(r["zero_past_groups"] for r in rows if "zero_past_groups" in r)

    # Kernels: both routings, three kernels, ours and the baselines timed; what needs a GPU is
    # named, not silently missing.
    rows = results["kernels"]
    assert {(r["routing"], r["kernel"]) for r in rows} == {
        (routing, k) for routing in ("balanced", "zipf") for k in ("gmm", "gmm_t", "tgmm")
    }
    for r in rows:
        assert set(r["tflops"]) == {"dense jnp", *OURS, "jax.lax.ragged_dot"}, r
        assert {"jax ragged_dot_mgpu", "torch._grouped_mm"} <= set(r["unavailable"]), r
        assert r["rows"] > 0 and r["rows"] % 64 == 0

    assert [r["config"] for r in results["layer"]] == ["tiny"]
    assert results["layer"][0]["layer_ms"] > 0
    assert results["train"]["moejax_step_ms"] > 0
    md = (tmp_path / "results.md").read_text()
    for title in ("**Numerics**", "**Kernels", "**MoE layer", "**Train step"):
        assert title in md


@pytest.mark.slow  # ~2 min of CPU (the fp8 kernels interpreted, two tiny train steps compiled)
def test_dry_run_fp8_part(tmp_path):
    """`--parts fp8` (what the lead runs alone on an H100): the fp8 kernels (both splits, both
    pipelines) against the dequantize-then-matmul reference, timed beside our bf16 kernels,
    torch's scaled grouped matmul named when missing, the SwiGLU FFN with fused and unfused
    quantization and the fused activation quantizers, the layer and the train step with both
    precisions."""
    out = _run("--dry-run", "--parts", "fp8", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    fp8 = json.loads((tmp_path / "results.json").read_text())["fp8"]
    assert "errors" not in fp8
    from pallas_kernels import fp8_mosaic_gpu, mgpu_compat

    kernels = {f"{k} {split}" for k in ("gmm", "gmm_t", "tgmm") for split in fp8_mosaic_gpu.SPLITS}
    # and each kernel on the pipeline it does not default to
    fp8_kernel = {"gmm": "fp8_gmm", "gmm_t": "fp8_gmm", "tgmm": "fp8_tgmm"}
    other = {
        k: next(p for p in fp8_mosaic_gpu.PIPELINES if p != fp8_mosaic_gpu.DEFAULT_PIPELINE[f])
        for k, f in fp8_kernel.items()
    }
    kernels |= {f"{k} {other[k]} pipeline" for k in fp8_kernel}
    if mgpu_compat.LOADS_TRANSPOSED:  # the fused quantizers, compared with XLA's bits
        kernels |= {"quantize_both", "quantize_blocks_both"}
    assert fp8["numerics_ok"] and {r["kernel"] for r in fp8["numerics"]} == kernels
    for r in fp8["kernels"]:
        pipeline = f"fp8 {other[r['kernel']]} pipeline"
        timed = {"fp8 (quantized operands)", "bf16 Mosaic GPU", pipeline}
        assert timed <= set(r["tflops"]), r
        if r["kernel"] == "gmm":
            assert "fp8 incl. quantization" in r["tflops"], r
            assert "torch._scaled_grouped_mm" in {*r["tflops"], *r["unavailable"]}, r
    ffn = {r["what"]: r for r in fp8["ffn"]}
    for how in ("unfused", "fused"):
        assert ffn[f"ffn fwd+bwd, {how} quantization"]["ms"] > 0
    assert fp8["ffn_fused_speedup"] > 0
    assert ffn["ffn numerics, kernels vs emulated"]["ok"], ffn
    for name in ("quantize_swiglu", "quantize_swiglu_grad"):
        row = ffn[name]
        if mgpu_compat.LOADS_TRANSPOSED:  # the interpreter evaluates XLA's expression: 0 differ
            assert row["fused_gb_per_s"] > 0 and row["elements_differing"] == 0, row
        else:
            assert "fused_unavailable" in row, row
    assert fp8["layer"]["bf16_ms"] > 0 and fp8["layer"]["fp8_ms"] > 0
    assert fp8["train"]["bf16_step_ms"] > 0 and fp8["train"]["fp8_step_ms"] > 0
    assert "**FP8 experts**" in (tmp_path / "results.md").read_text()
