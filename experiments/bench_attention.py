"""The causal attention core, forward + backward, on one GPU: each implementation moejax can run
(`moejax.models.causal_attention`) and the Triton kernel's backward block sizes, in TFLOP/s at the
Mixtral-8x7B and OLMoE shapes, each checked against the XLA core (`implementation="xla"`).

  xla            the reference core (fp32 scores in memory)
  triton b=...   jax's Pallas-Triton flash attention, backward blocks (q_dkv, kv_dkv, q_dq,
                 kv_dq) and warps as named (`"pallas"` runs the first)
  cudnn          cuDNN's flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`)

FLOPs: the causal half of `4 B S^2 H Dh` forward, 2.5x that backward. Times: median over
batches of back-to-back calls after a warm-up (`gpu_check_lib.median_seconds`).

Run on a lent GPU from the repository root (~1 min on an H200):

    python3 experiments/bench_attention.py --out $OUT/attention

`--dry-run`: tiny shapes on any machine (the Triton kernel interpreted on a CPU; cuDNN skipped
where it does not run).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from gpu_check_lib import median_seconds, rel_err, versions  # noqa: E402

from moejax.models import causal_attention  # noqa: E402

SHAPES = {  # name -> (B, S, H, Hkv, Dh)
    "mixtral_8x7b": (4, 4096, 32, 8, 128),
    "olmoe": (8, 2048, 16, 16, 128),
}
DRY_SHAPES = {"tiny": (1, 128, 4, 2, 64)}
# Triton backward blocks (q_dkv, kv_dkv, q_dq, kv_dq) and warps (None: jax's choice): jax's
# default first, moejax's `"pallas"` last. q_dq must equal kv_dkv (the fused backward walks both
# at once). Forward blocks: 128 rows (moejax's at these shapes).
TRITON_BWD = [
    ((32, 32, 32, 32), None),
    ((32, 128, 128, 32), 4),
    ((32, 128, 128, 32), 8),
    ((64, 128, 128, 64), 8),
    ((64, 64, 64, 64), 4),
    ((128, 128, 128, 128), 8),
]


def flops(b, s, h, dh) -> float:
    return 0.5 * 4.0 * b * s * s * h * dh * (1 + 2.5)


def _jax_triton_attention():
    """jax's Triton flash-attention module (deprecated in jax 0.11, still shipped)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention

    return attention


def triton_core(blocks, warps, interpret):
    """jax's Triton kernel with these backward blocks, kv heads repeated (as moejax does)."""
    gpu_attention = _jax_triton_attention()

    def core(q, k, v):
        s, h, dh = q.shape[1], q.shape[2], q.shape[3]
        fwd = min(128, s)
        qdkv, kvdkv, qdq, kvdq = (min(x, s) for x in blocks)
        bs = gpu_attention.BlockSizes(
            block_q=fwd,
            block_k=fwd,
            block_q_dkv=qdkv,
            block_kv_dkv=kvdkv,
            block_q_dq=qdq,
            block_kv_dq=kvdq,
        )
        k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
        with warnings.catch_warnings():  # the Pallas-Triton lowering's deprecation
            warnings.simplefilter("ignore", DeprecationWarning)
            return gpu_attention.mha(
                q,
                k,
                v,
                None,
                sm_scale=dh**-0.5,
                causal=True,
                block_sizes=bs,
                num_warps=warps,
                interpret=interpret,
            )

    return core


def cudnn_core(q, k, v):
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5, implementation="cudnn"
    )


def fwd_bwd(core):
    """(q, k, v, dout) -> (out, dq, dk, dv), jitted."""

    def f(q, k, v, dout):
        out, vjp = jax.vjp(core, q, k, v)
        return (out, *vjp(dout))

    return jax.jit(f)


def measure(shapes: dict, impls: dict, seconds, log, left=lambda: float("inf")) -> list[dict]:
    """One row per shape and implementation: ms and TFLOP/s of forward + backward
    (`seconds(fn, *args)`), and the relative error of the output and the three gradients
    against the first implementation's; a row whose call fails names the error."""
    rows = []
    for shape, (b, s, h, hkv, dh) in shapes.items():
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (b, s, h, dh), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, s, hkv, dh), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, s, hkv, dh), jnp.bfloat16)
        dout = jax.random.normal(keys[3], (b, s, h, dh), jnp.bfloat16)
        want = None
        for name, core in impls.items():
            row = dict(shape=shape, impl=name)
            if left() < 5:
                row["error"] = "the time budget is spent"
                rows.append(row)
                continue
            try:
                fn = fwd_bwd(core)
                got = jax.block_until_ready(fn(q, k, v, dout))
                if want is None:
                    want = [np.asarray(x, np.float32) for x in got]
                row["rel_err"] = {
                    n: rel_err(g, w)
                    for n, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
                }
                del got
                secs = seconds(fn, q, k, v, dout)
                row["ms"] = secs * 1e3
                row["tflops"] = flops(b, s, h, dh) / secs / 1e12
            except Exception as err:  # noqa: BLE001  (the next one runs)
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                if not isinstance(err, (RuntimeError, NotImplementedError, ValueError)):
                    traceback.print_exc()
            rows.append(row)
            errs = " ".join(f"{n} {e:.1e}" for n, e in row.get("rel_err", {}).items())
            figure = f"{row['ms']:8.2f} ms {row['tflops']:6.0f} TFLOP/s" if "ms" in row else ""
            log(f"  {shape:13s} {name:32s} {figure} {errs} {row.get('error', '')}")
    return rows


def part_attention(run) -> None:
    """`gpu_check.py`'s attention part: the cores `causal_attention` runs, "xla" (the
    reference), "pallas" (Triton on a GPU) and "auto" (cuDNN's where jax finds it), forward +
    backward at both shapes (`run.dry`: tiny), checked against "xla"; under results["attention"]."""
    impls = {
        i: functools.partial(causal_attention, implementation=i) for i in ("xla", "pallas", "auto")
    }
    run.results["attention"] = measure(
        DRY_SHAPES if run.dry else SHAPES, impls, run.seconds, run.log, run.left
    )


def markdown(rows: list[dict]) -> list[str]:
    """The attention part's table for gpu_check's results.md."""
    lines = [
        '**Attention core**, forward + backward, bf16 (max rel. err. against "xla")',
        "",
        "| shape | implementation | ms | TFLOP/s | max rel. err. |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "ms" in r:
            err = max(r["rel_err"].values())
            lines.append(
                f"| {r['shape']} | {r['impl']} | {r['ms']:.2f} | {r['tflops']:.0f} | {err:.1e} |"
            )
        else:
            lines.append(f"| {r['shape']} | {r['impl']} | - | - | {r.get('error', '')[:80]} |")
    return [*lines, ""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    on_gpu = jax.devices()[0].platform == "gpu"
    dry = args.dry_run or not on_gpu
    results = dict(
        device=jax.devices()[0].device_kind, **versions(), date=time.strftime("%Y-%m-%dT%H:%M:%S")
    )
    print(
        f"# bench_attention: {results['device']}, jax {results['jax']}, commit {results['commit']}",
        flush=True,
    )
    impls = {"xla": functools.partial(causal_attention, implementation="xla")}
    for blocks, warps in TRITON_BWD[: 1 if dry else None]:
        impls[f"triton b={','.join(map(str, blocks))} w={warps or '-'}"] = triton_core(
            blocks, warps, interpret=not on_gpu
        )
    impls["cudnn"] = cudnn_core

    def seconds(fn, *a):
        return median_seconds(fn, *a, batches=0 if dry else 3)

    results["rows"] = measure(
        DRY_SHAPES if dry else SHAPES, impls, seconds, lambda line: print(line, flush=True)
    )
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    from pallas_kernels.targets import use_cpu_unless_accelerator

    use_cpu_unless_accelerator()  # no GPU/TPU here: no plugin tracebacks
    sys.exit(main())
