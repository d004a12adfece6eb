"""What `experiments/gpu_check.py` runs its parts with: the shared state and time budgets, the
hard time limit, timing of jax and torch calls, torch views of jax arrays, and the report.

Timing: every figure is the median over batches of back-to-back calls (async dispatch keeps the
device busy; one sync per batch) after one warm-up call that compiles. A dry run (`--dry-run`,
any machine) times one call after the warm-up: it proves the code paths, not speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Run:
    """Shared state: options, the output directory, the results, and the part's deadline."""

    out: pathlib.Path
    dry: bool
    profile: bool
    on_gpu: bool
    results: dict
    log_file: object = None
    deadline: float = float("inf")

    def log(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self.log_file is not None:
            self.log_file.write(line + "\n")
            self.log_file.flush()

    def left(self) -> float:
        """Seconds left in the current part's budget."""
        return self.deadline - time.perf_counter()

    def skip(self, part: str, what: str, why: str) -> None:
        self.results.setdefault("skipped", []).append(dict(part=part, what=what, why=why))
        self.log(f"  skipped {what}: {why}")

    def seconds(self, fn, *args, slow: bool = False) -> float:
        """Seconds per call of fn(*args) (jax): ~0.1 s batches, 3 of them; `slow` (a call of
        seconds, e.g. XLA's ragged_dot at G=128) one call; a dry run one call."""
        if self.dry or slow:
            return median_seconds(fn, *args, batches=0)
        return median_seconds(fn, *args, target_s=0.1, batches=3)

    def torch_seconds(self, fn) -> float:
        if self.dry:
            return torch_median_seconds(fn, batches=0)
        return torch_median_seconds(fn, target_s=0.1, batches=3)

    def write(self) -> None:
        """results.json and results.md as they stand (after each part, and at the time limit)."""
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "results.md").write_text(markdown(self.results))


# ------------------------------------------------------------------------------------ timing
def _batches(call, sync, target_s: float, batches: int) -> float:
    call()  # compiles
    sync()
    start = time.perf_counter()
    call()
    sync()
    once = time.perf_counter() - start
    if batches == 0:
        return once
    calls = max(1, min(50, int(target_s / max(once, 1e-6))))
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def median_seconds(fn, *args, target_s: float = 0.1, batches: int = 3) -> float:
    """Median over `batches` of the mean time of back-to-back calls of a jax function, calls per
    batch chosen so that a batch lasts ~target_s; batches=0: one call after the warm-up."""
    last = []

    def call():
        last[:] = [fn(*args)]

    return _batches(call, lambda: jax.block_until_ready(last), target_s, batches)


def torch_median_seconds(fn, target_s: float = 0.1, batches: int = 3) -> float:
    """`median_seconds` for a torch function (synchronized with CUDA where there is one)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    return _batches(fn, sync, target_s, batches)


@contextlib.contextmanager
def maybe_profile(run: Run, name: str):
    """A jax trace of the block into OUT/profile/<name> with `--profile`."""
    if not run.profile:
        yield
        return
    path = run.out / "profile" / name
    path.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(path)):
        yield


def rel_err(got, want) -> float:
    """max |got - want| / max |want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1e-30))


def to_torch(x):
    """A torch view of a jax array on the same device (dlpack: no copy, no host trip)."""
    import torch

    return torch.from_dlpack(x)


def torch_unavailable() -> str | None:
    """Why torch cannot run the comparison here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (torch._grouped_mm is timed on the GPU only)"
    return None


def free_torch_cache() -> None:
    """Hands torch's cached GPU memory back (jax allocates beside it), if torch is in use."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ time limit
def start_time_limit(run: Run, seconds: float | None) -> threading.Timer | None:
    """Past `seconds`, write what was measured (marked aborted) and exit with status 3: the
    script never outlives its slot on a lent machine, whatever a compile or a call does."""
    if seconds is None:
        return None

    def expire():
        run.results["aborted"] = f"the time limit ({seconds:.0f} s) ran out"
        run.log(f"# aborted: {run.results['aborted']}; results so far in {run.out}")
        with contextlib.suppress(Exception):  # the main thread may be changing the results
            run.write()
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


# ------------------------------------------------------------------------------- reporting
def versions() -> dict:
    """jax, python, torch, transformers versions and the repository's commit."""
    out = dict(jax=jax.__version__, python=sys.version.split()[0])
    for name in ("torch", "transformers"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = None
    try:
        out["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=ROOT,
        ).stdout.strip() or "unknown"  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        out["commit"] = "unknown"
    return out


def _numerics_md(results: dict) -> list[str]:
    bad = [r for r in results["numerics"] if not r["ok"]]
    total = len(results["numerics"])
    tol = results.get("numerics_tolerance", float("nan"))
    lines = [f"**Numerics** (bf16, max |err| / max |ref| <= {tol:.2e}): "
             f"{total - len(bad)} of {total} ok", ""]  # fmt: skip
    return lines + [f"- FAILED {r}" for r in bad]


def _kernels_md(rows: list[dict]) -> list[str]:
    names = sorted(
        {n for r in rows for n in r["tflops"]} | {n for r in rows for n in r["unavailable"]}
    )
    lines = ["", "**Kernels, TFLOP/s (bf16)**", "",
             "| shape | groups | kernel | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]  # fmt: skip
    for r in rows:
        cells = [f"{r['tflops'][n]:.0f}" if n in r["tflops"] else "-" for n in names]
        lines.append(
            f"| {r['shape']} | {r['routing']} | {r['kernel']} | " + " | ".join(cells) + " |"
        )
    why = {(n, v) for r in rows for n, v in r["unavailable"].items()}
    lines += [f"- {n}: {v}" for n, v in sorted(why)]
    errs = [f"{r['shape']} {r['routing']} {r['kernel']}: {r['torch_vs_ours']:.1e}"
            for r in rows if "torch_vs_ours" in r]  # fmt: skip
    if errs:
        lines.append(
            "- torch._grouped_mm vs ours, max |err| / max |ours| on a sample: " + "; ".join(errs)
        )
    return lines


def _layer_md(rows: list[dict]) -> list[str]:
    lines = ["", "**MoE layer fwd+bwd vs a dense FFN of the same FLOPs**", "",
             "| config | layer ms | TFLOP/s | dense ms | TFLOP/s | layer / dense |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['config']} | {r['layer_ms']:.2f} | {r['layer_tflops']:.0f} | "
                     f"{r['dense_ms']:.2f} | {r['dense_tflops']:.0f} | "
                     f"{r['layer_over_dense']:.2f} |")  # fmt: skip
    return lines


def _train_md(t: dict) -> list[str]:
    def mfu(v):
        return "-" if v is None else f"{v:.1%}"

    lines = ["", f"**Train step, OLMoE shapes x 2 layers ({t['params_total'] / 1e9:.2f} B "
             f"params), {t['batch']} x {t['seq']} tokens**", "",
             "| | ms / step | tokens / s | MFU |", "|---|---|---|---|"]  # fmt: skip
    if "moejax_step_ms" in t:
        lines.append(f"| moejax | {t['moejax_step_ms']:.1f} | {t['moejax_tokens_per_s']:.0f} | "
                     f"{mfu(t['moejax_mfu'])} |")  # fmt: skip
    if "hf_step_ms" in t:
        lines.append(f"| transformers ({t['hf_experts_implementation']} experts) | "
                     f"{t['hf_step_ms']:.1f} | {t['hf_tokens_per_s']:.0f} | "
                     f"{mfu(t['hf_mfu'])} |")  # fmt: skip
    return lines


def markdown(results: dict) -> str:
    """The results as markdown tables."""
    lines = [f"# gpu_check {results['date']}", "",
             f"device: {results['device']}, jax {results['jax']}, torch {results.get('torch')}, "
             f"transformers {results.get('transformers')}, commit {results['commit']}, "
             f"dry run: {results['dry_run']}", ""]  # fmt: skip
    if results.get("aborted"):
        lines += [f"**Aborted**: {results['aborted']}", ""]
    if results.get("numerics"):
        lines += _numerics_md(results)
    if results.get("kernels"):
        lines += _kernels_md(results["kernels"])
    if results.get("layer"):
        lines += _layer_md(results["layer"])
    if results.get("train", {}).get("params_total"):
        lines += _train_md(results["train"])
    if results.get("attention"):
        from bench_attention import markdown as attention_markdown

        lines += attention_markdown(results["attention"])
    if results.get("fp8"):
        from gpu_check_fp8 import markdown as fp8_markdown

        lines += fp8_markdown(results["fp8"])
    if results.get("part_seconds"):
        spent = ", ".join(f"{k} {v:.0f} s" for k, v in results["part_seconds"].items())
        lines += ["", f"Seconds per part: {spent}."]
    for key, title in (("skipped", "Skipped"), ("errors", "Errors")):
        if results.get(key):
            lines += ["", f"**{title}**", ""]
            lines += [f"- {s['part']}: {s.get('what', '')}: {s.get('why', s.get('error'))}"
                      for s in results[key]]  # fmt: skip
    return "\n".join(lines) + "\n"
