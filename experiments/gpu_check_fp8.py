"""`gpu_check.py --parts fp8`: the fp8 expert matmuls (DeepSeek-V3 recipe) on a lent Hopper GPU.

In about 5 minutes on one H100 (budget `BUDGET_S`), each step skipped with its reason when it
fails or the budget is spent:
  numerics (25 s): the fp8 kernels (fp8_gmm forward and lhs gradient, fp8_tgmm), with the
    consumers halving each tile by columns and by rows (`fp8_mosaic_gpu.SPLITS`), and on the
    pipeline each kernel does not default to (`fp8_mosaic_gpu.PIPELINES`), compiled on the
    device against the dequantize-then-matmul reference (XLA, fp32), bf16 outputs.
  train (85 s): gpu_check's OLMoE-shaped ~1B train step, fp8 vs bf16 experts (moejax only).
  kernels (150 s): TFLOP/s of forward, dlhs and tgmm at the Mixtral, DeepSeek-V3 and
    fine-grained shapes (balanced groups): the fp8 kernels on pre-quantized operands (both
    splits and both pipelines: each kernel's defaults are "fp8 (quantized operands)"), the
    forward again with its quantization (what the layer pays), our bf16 Mosaic GPU kernels,
    the activation and weight quantizations alone (XLA against the fused `quantize_both` and
    `quantize_blocks_both`, GB/s), and
    `torch._scaled_grouped_mm` (rowwise-scaled fp8, the forward) where torch has it.
  ffn (30 s): the SwiGLU expert FFN forward + backward at the Mixtral shape with its
    quantizations fused into their producers (`fp8_ops.fp8_swiglu_ffn`: what the layer runs)
    against three `fp8_grouped_matmul` calls around XLA's activation, its kernels' output and
    gradients against its emulation (norm-wise, within 2^-8), and the fused activation
    quantizers (`quantize_swiglu`, `quantize_swiglu_grad`) against XLA: GB/s, and how many
    elements differ from XLA's (the kernel's exp and XLA's may round differently).
  layer (30 s): moejax's MoE layer forward + backward at Mixtral sizes, fp8 vs bf16 experts.
`--dry-run` takes every path at tiny shapes (the kernels in the Mosaic GPU interpreter).
"""

from __future__ import annotations

import functools
import gc
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from gpu_check_lib import Run, free_torch_cache, rel_err, to_torch, torch_unavailable

import pallas_kernels as pk
from pallas_kernels import fp8, fp8_mosaic_gpu, fp8_ops, fp8_quantizers, targets
from pallas_kernels import shapes as pk_shapes

BUDGET_S = {"numerics": 25, "train": 85, "kernels": 150, "ffn": 30, "layer": 30}
SHAPES = ("mixtral_8x7b", "deepseek_v3", "fine_grained")
TOL = 2 * float(jnp.finfo(jnp.bfloat16).eps)  # the bf16 rounding of the same fp32 sums


def _fp8_fns(run: Run, align: int, split: str | None = None, pipeline: str | None = None) -> dict:
    """kernel -> jitted fn on pre-quantized operands (the fp8 kernels, consumers halving each
    tile by `split`, K blocks on `pipeline`; None: each kernel's default)."""
    kw = dict(out_dtype=jnp.bfloat16, group_alignment=align, interpret=not run.on_gpu,
              split=split, pipeline=pipeline)  # fmt: skip
    return {
        "gmm": jax.jit(lambda a, b, s: fp8_mosaic_gpu.fp8_gmm(*a, *b, s, **kw)),
        "gmm_t": jax.jit(lambda a, b, s: fp8_mosaic_gpu.fp8_gmm(*a, *b, s, **kw)),
        "tgmm": jax.jit(lambda a, b, s: fp8_mosaic_gpu.fp8_tgmm(*a, *b, s, **kw)),
    }


_FP8_KERNEL = {"gmm": "fp8_gmm", "gmm_t": "fp8_gmm", "tgmm": "fp8_tgmm"}


def _other_pipeline(kernel: str) -> str:
    """The pipeline `kernel`'s fp8 kernel does not default to."""
    default = fp8_mosaic_gpu.DEFAULT_PIPELINE[_FP8_KERNEL[kernel]]
    return next(p for p in fp8_mosaic_gpu.PIPELINES if p != default)


def _other_pipeline_fns(run: Run, align: int) -> dict:
    """kernel -> jitted fn as `_fp8_fns`, on the pipeline the kernel does not default to."""
    return {kernel: _fp8_fns(run, align, pipeline=_other_pipeline(kernel))[kernel]
            for kernel in _FP8_KERNEL}  # fmt: skip


def _emulated(kernel: str, a, b, s):
    """The dequantize-then-matmul reference of one kernel, fp32 (XLA's ragged dot)."""
    m = fp8_ops.REFERENCE_MATMULS
    if kernel == "tgmm":
        return m.tgmm(fp8.dequantize_rows(*a).T, fp8.dequantize_rows(*b).T, s)
    return m.gmm_t(fp8.dequantize_rows(*a), fp8.dequantize_blocks(*b), s)


@jax.jit
def _quantized(x, w, dy):
    """The operands each kernel reads, as `fp8_ops` makes them (rows past the groups are
    already zero in these problems)."""
    wq = fp8.quantize_blocks(w)
    return {
        "gmm": (fp8.quantize_rows(x), fp8.transpose_blocks(*wq)),
        "gmm_t": (fp8.quantize_rows(dy), wq),
        "tgmm": (fp8.quantize_cols(x), fp8.quantize_cols(dy)),
    }


def _quantize_x(x, interpret):
    """x quantized both ways (1 x 128 for the forward, 128 x 1 kept for the weight gradient),
    as `fp8_ops` does it: the fused kernel where it runs, else XLA."""
    if fp8_quantizers.quantize_supports(x, jnp.float8_e4m3fn):
        return fp8_quantizers.quantize_both(x, interpret=interpret)
    return _XLA_QUANTIZERS["activation"](x)


def _quantize_w(w, interpret):
    """w block-quantized as stored and transposed (the forward's copy), as `fp8_ops` does it."""
    if fp8_quantizers.quantize_blocks_supports(w, jnp.float8_e4m3fn):
        return fp8_quantizers.quantize_blocks_both(w, interpret=interpret)
    return _XLA_QUANTIZERS["weights"](w)


def _blocks_both(w):
    wq = fp8.quantize_blocks(w)
    return wq, fp8.transpose_blocks(*wq)


# operand -> XLA's quantization of both layouts; operand -> (the fused kernel's name, the
# quantization `fp8_ops` runs, whether the fused kernel takes the operand)
_XLA_QUANTIZERS = {
    "activation": lambda x: (fp8.quantize_rows(x), fp8.quantize_cols(x)),
    "weights": _blocks_both,
}
_FUSED_QUANTIZERS = {
    "activation": ("quantize_both", _quantize_x, fp8_quantizers.quantize_supports),
    "weights": (
        "quantize_blocks_both",
        _quantize_w,
        fp8_quantizers.quantize_blocks_supports,
    ),
}


def _quantize_and_gmm(run: Run, align: int):
    """The forward as the layer runs it: quantize x both ways and w (128 x 128), then fp8_gmm."""
    kw = dict(out_dtype=jnp.bfloat16, group_alignment=align, interpret=not run.on_gpu)

    def fn(x, w, s):
        _, wq_t = _quantize_w(w, not run.on_gpu)
        (xq, _) = _quantize_x(x, not run.on_gpu)
        return fp8_mosaic_gpu.fp8_gmm(*xq, *wq_t, s, **kw)

    return jax.jit(fn)


def _quantization(run: Run, operand: str, x, shape: str, out: dict) -> None:
    """GB/s of quantizing an activation or the weights both ways: XLA (two passes) against the
    fused kernel (one read), each counted at the bytes it must move (x once, two fp8 copies)."""
    row = dict(shape=shape, operand=operand, dims=list(x.shape))
    moved = x.size * (x.dtype.itemsize + 2)
    _, fused, supported = _FUSED_QUANTIZERS[operand]
    fns = {"xla": jax.jit(_XLA_QUANTIZERS[operand])}
    if supported(x, jnp.float8_e4m3fn):
        fns["fused"] = jax.jit(lambda x: fused(x, not run.on_gpu))
    for name, fn in fns.items():
        try:
            row[f"{name}_gb_per_s"] = moved / run.seconds(fn, x) / 1e9
        except Exception as err:  # noqa: BLE001
            run.log(traceback.format_exc())
            row[f"{name}_error"] = f"{type(err).__name__}: {str(err)[:200]}"
    if fns.keys() <= {"xla"}:
        row["fused_unavailable"] = f"no fused quantizer runs this on jax {jax.__version__}"
    out.setdefault("quantize", []).append(row)
    run.log(f"  fp8 quantize {row}")


def _problem(m, k, n, g, align, seed):
    from gpu_check_kernels import aligned_sizes, operands

    x, w, dy = operands(m, k, n, g, seed=seed)
    sizes_np = aligned_sizes("balanced", m, g, align, seed=seed)
    return x, w, dy, sizes_np


def _numerics(run: Run, align: int, out: dict) -> None:
    m, k, n, g = (8192, 1024, 768, 16) if not run.dry else (256, 128, 128, 2)
    x, w, dy, sizes_np = _problem(m, k, n, g, align, seed=0)
    s = jnp.asarray(sizes_np)
    q = _quantized(x, w, dy)
    rows = out["numerics"] = []
    fns = [(f"{kernel} {split}", kernel, fn) for split in fp8_mosaic_gpu.SPLITS
           for kernel, fn in _fp8_fns(run, align, split).items()]  # fmt: skip
    fns += [(f"{kernel} {_other_pipeline(kernel)} pipeline", kernel, fn)
            for kernel, fn in _other_pipeline_fns(run, align).items()]  # fmt: skip
    for name, kernel, fn in fns:
        try:
            got = fn(*q[kernel], s)
            with jax.default_matmul_precision("float32"):  # no TF32 in the reference
                want = _emulated(kernel, *q[kernel], s)
            err = rel_err(got, want)
            rows.append(dict(kernel=name, rel_err=err, ok=bool(err <= TOL)))
        except Exception as err:  # noqa: BLE001  (reported; the rest runs)
            run.log(traceback.format_exc())
            rows.append(dict(kernel=name, ok=False, error=f"{type(err).__name__}: {err}"[:300]))
        run.log(f"  fp8 numerics {name}: {rows[-1]}")
    for operand, arg in (("activation", x), ("weights", w)):  # the fused quantizers: same bits
        name, fused, supported = _FUSED_QUANTIZERS[operand]
        if not supported(arg, jnp.float8_e4m3fn):
            continue
        try:
            got = jax.jit(lambda a, fused=fused: fused(a, not run.on_gpu))(arg)
            want = jax.jit(_XLA_QUANTIZERS[operand])(arg)
            pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
            diff = sum(int(np.sum(np.asarray(a, np.float32) != np.asarray(b, np.float32)))
                       for a, b in pairs)  # fmt: skip
            rows.append(dict(kernel=name, rel_err=float(diff), ok=diff == 0))
        except Exception as err:  # noqa: BLE001
            run.log(traceback.format_exc())
            rows.append(dict(kernel=name, ok=False, error=f"{type(err).__name__}: {err}"[:300]))
        run.log(f"  fp8 numerics {name} (elements differing from XLA's): {rows[-1]}")
    out["numerics_ok"] = all(r["ok"] for r in rows)


def _torch_scaled(run: Run, x, w, sizes_np):
    """Seconds of torch._scaled_grouped_mm (fp8 e4m3, rowwise scales) on x @ w[g], or why not."""
    if why := torch_unavailable():
        return why
    import torch

    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no _scaled_grouped_mm"
    try:
        # Quantized in bf16 (a timing baseline: DeepSeek-V3's weights in fp32 need 15 GB).
        tx = to_torch(x)
        sa = tx.abs().amax(1).float().clamp(min=1e-12) / 448
        a = (tx / sa[:, None].to(tx.dtype)).to(torch.float8_e4m3fn)
        wt = to_torch(w).transpose(-2, -1).contiguous()  # [G, N, K]: B column-major for torch
        sb = wt.abs().amax(-1).float().clamp(min=1e-12) / 448  # [G, N]
        b = (wt / sb[..., None].to(wt.dtype)).to(torch.float8_e4m3fn).transpose(-2, -1)
        del tx, wt
        offs = torch.tensor(np.cumsum(sizes_np), device=a.device, dtype=torch.int32)

        def fn():
            return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)

        return run.torch_seconds(fn)
    except Exception as err:  # noqa: BLE001  (a comparison column; reported, not fatal)
        return f"{type(err).__name__}: {str(err)[:200]}"


def _kernels(run: Run, align: int, out: dict, deadline: float) -> None:
    from gpu_check_kernels import ours

    rows = out["kernels"] = []
    problems = [(s, *_dims(s)) for s in SHAPES] if not run.dry else [("tiny", 256, 128, 128, 2)]
    for shape, m, k, n, g in problems:
        if deadline - time.perf_counter() < 10:
            run.skip("fp8", f"kernels {shape}", "the fp8 kernels' time budget is spent")
            continue
        x, w, dy, sizes_np = _problem(m, k, n, g, align, seed=1)
        s, used = jnp.asarray(sizes_np), int(sizes_np.sum())
        _quantization(run, "activation", x, shape, out)
        _quantization(run, "weights", w, shape, out)
        flops = 2.0 * used * k * n
        q = _quantized(x, w, dy)
        fp8_fns, bf16_fns = _fp8_fns(run, align), ours(run, "pallas_mosaic_gpu", align)
        other = {}  # kernel -> the split its fp8 kernel does not default to
        for kernel, fp8_kernel in _FP8_KERNEL.items():
            default = fp8_mosaic_gpu.DEFAULT_SPLIT[fp8_kernel]
            other[kernel] = next(s for s in fp8_mosaic_gpu.SPLITS if s != default)
        other_fns = {split: _fp8_fns(run, align, split) for split in set(other.values())}
        pipeline_fns = _other_pipeline_fns(run, align)
        args16 = {"gmm": (x, w), "gmm_t": (dy, w), "tgmm": (x, dy)}
        for kernel in ("gmm", "gmm_t", "tgmm"):
            row = dict(shape=shape, kernel=kernel, m=m, k=k, n=n, g=g, tflops={}, unavailable={})
            timed = {
                "fp8 (quantized operands)": (fp8_fns[kernel], (*q[kernel], s)),
                "bf16 Mosaic GPU": (bf16_fns[kernel], (*args16[kernel], s)),
                f"fp8 split by {other[kernel]}": (
                    other_fns[other[kernel]][kernel],
                    (*q[kernel], s),
                ),
                f"fp8 {_other_pipeline(kernel)} pipeline": (pipeline_fns[kernel], (*q[kernel], s)),
            }
            if kernel == "gmm":
                timed["fp8 incl. quantization"] = (_quantize_and_gmm(run, align), (x, w, s))
            for name, (fn, a) in timed.items():
                if deadline - time.perf_counter() < 3:
                    row["unavailable"][name] = "the time budget is spent"
                    continue
                try:
                    row["tflops"][name] = flops / run.seconds(fn, *a) / 1e12
                except Exception as err:  # noqa: BLE001
                    run.log(traceback.format_exc())
                    row["unavailable"][name] = f"{type(err).__name__}: {str(err)[:200]}"
            if kernel == "gmm":
                t = _torch_scaled(run, x, w, sizes_np)
                if isinstance(t, str):
                    row["unavailable"]["torch._scaled_grouped_mm"] = t
                else:
                    row["tflops"]["torch._scaled_grouped_mm"] = flops / t / 1e12
            ratio = row["tflops"].get("fp8 (quantized operands)", 0) / max(
                row["tflops"].get("bf16 Mosaic GPU", float("inf")), 1e-9
            )
            row["fp8_over_bf16"] = ratio
            rows.append(row)
            figures = " ".join(f"{k_}={v:.0f}" for k_, v in row["tflops"].items())
            run.log(f"  fp8 {shape:13s} {kernel:6s} {figures} fp8/bf16={ratio:.2f}")
        del x, w, dy, q, args16
        gc.collect()
        free_torch_cache()


def _dims(shape):
    spec = pk_shapes.SHAPES[shape]
    return spec.m, spec.k, spec.n, spec.g


def _swiglu_xla(gate, up):
    h = fp8.swiglu(gate, up).astype(gate.dtype)
    return fp8.quantize_rows(h), fp8.quantize_cols(h)


def _swiglu_grad_xla(dh, gate, up):
    grads = (d.astype(dh.dtype) for d in fp8.swiglu_grad(dh, gate, up))
    return tuple((fp8.quantize_rows(d), fp8.quantize_cols(d)) for d in grads)


def _norm_rel(got, want) -> float:
    """||got - want|| / ||want||, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _ffn(run: Run, align: int, out: dict) -> None:
    """The fused SwiGLU FFN against the unfused composition, and its two fused quantizers."""
    m, d, f, g = _dims("mixtral_8x7b") if not run.dry else (256, 128, 256, 2)  # D != F
    x, w, _, sizes_np = _problem(m, d, f, g, align, seed=3)
    sizes = jnp.asarray(sizes_np)
    keys = jax.random.split(jax.random.key(5), 3)
    dy = jax.random.normal(keys[2], x.shape, x.dtype)  # the FFN's output gradient [M, D]
    ws = (w, (w * jax.random.normal(keys[0], (), w.dtype)),
          jax.random.normal(keys[1], (g, f, d), jnp.bfloat16) * float(f) ** -0.5)  # fmt: skip
    rows = out["ffn"] = []
    # The kernels, interpreted in a dry run (named: "auto" would put the interpreter's
    # callbacks in a platform conditional, which jax does not lower).
    kw = dict(backend="pallas_mosaic_gpu", group_alignment=align, interpret=not run.on_gpu)

    def unfused(x, wg, wu, wd):
        def mm(a, w_):
            return fp8_ops.fp8_grouped_matmul(a, w_, sizes, **kw)

        return mm(fp8.swiglu(mm(x, wg), mm(x, wu)).astype(x.dtype), wd)

    def fused(x, wg, wu, wd):
        return fp8_ops.fp8_swiglu_ffn(x, wg, wu, wd, sizes, **kw)

    flops = 2 * 3 * 3 * int(np.sum(sizes_np)) * d * f  # 3 matmuls, forward + 2 gradients
    times = {}
    for name, fn in (("unfused", unfused), ("fused", fused)):
        step = jax.jit(jax.value_and_grad(lambda *a, fn=fn: jnp.vdot(fn(*a), dy), (0, 1, 2, 3)))
        try:
            times[name] = run.seconds(step, x, *ws)
            rows.append(dict(what=f"ffn fwd+bwd, {name} quantization", ms=times[name] * 1e3,
                             tflops=flops / times[name] / 1e12))  # fmt: skip
        except Exception as err:  # noqa: BLE001
            run.log(traceback.format_exc())
            rows.append(dict(what=f"ffn {name}", error=f"{type(err).__name__}: {err}"[:300]))
        run.log(f"  fp8 {rows[-1]}")
    if len(times) == 2:
        out["ffn_fused_speedup"] = times["unfused"] / times["fused"]
    # On the device: the fused op's kernels against its emulation (the same quantized operands
    # up to rare fp8 flips where the kernel's exp and XLA's round h apart): norm-wise relative
    # error of the output and the four gradients, within bf16 rounding (2^-8).
    try:

        def fwd_vjp(backend):
            def ffn(*a):
                return fp8_ops.fp8_swiglu_ffn(*a, sizes, **{**kw, "backend": backend})

            y, vjp = jax.vjp(ffn, x, *ws)
            return (y, *vjp(dy))

        got = jax.jit(lambda: fwd_vjp("pallas_mosaic_gpu"))()
        want = jax.jit(lambda: fwd_vjp("emulated"))()
        names = ("out", "dx", "dw_gate", "dw_up", "dw_down")
        errs = {n: _norm_rel(a, b) for n, a, b in zip(names, got, want, strict=True)}
        rows.append(dict(what="ffn numerics, kernels vs emulated", rel_err=errs,
                         ok=bool(max(errs.values()) <= 2.0**-8)))  # fmt: skip
    except Exception as err:  # noqa: BLE001
        run.log(traceback.format_exc())
        rows.append(dict(what="ffn numerics", ok=False, error=f"{type(err).__name__}: {err}"[:300]))
    run.log(f"  fp8 {rows[-1]}")
    h = jax.random.normal(keys[0], (m, f), jnp.bfloat16)
    cases = (("quantize_swiglu", fp8_quantizers.quantize_swiglu, _swiglu_xla, (h, h * 0.5)),
             ("quantize_swiglu_grad", fp8_quantizers.quantize_swiglu_grad, _swiglu_grad_xla,
              (h, h * 0.5, h * -2)))  # fmt: skip
    for name, kernel, xla, args in cases:
        row = dict(what=name, dims=[m, f])
        if not fp8_quantizers.quantize_supports(h, jnp.float8_e4m3fn):
            row["fused_unavailable"] = f"no fused quantizer runs on jax {jax.__version__}"
            rows.append(row)
            continue
        outputs = 1 if name == "quantize_swiglu" else 2
        moved = h.size * (2 * len(args) + 2 * outputs)  # bf16 inputs, two fp8 copies each
        fused_fn = functools.partial(kernel, interpret=not run.on_gpu)
        fns = {"xla": jax.jit(xla), "fused": jax.jit(fused_fn)}
        try:
            for which, fn in fns.items():
                row[f"{which}_gb_per_s"] = moved / run.seconds(fn, *args) / 1e9
            pairs = zip(jax.tree.leaves(fns["fused"](*args)), jax.tree.leaves(fns["xla"](*args)),
                        strict=True)  # fmt: skip
            row["elements_differing"] = sum(
                int(np.sum(np.asarray(a, np.float32) != np.asarray(b, np.float32)))
                for a, b in pairs
            )
        except Exception as err:  # noqa: BLE001
            run.log(traceback.format_exc())
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
        run.log(f"  fp8 {row}")


def _layer(run: Run, out: dict) -> None:
    import moejax

    c = dict(d_model=4096, d_ff=14336, num_experts=8, top_k=2)
    t = 8192
    if run.dry:
        c, t = dict(d_model=128, d_ff=128, num_experts=2, top_k=1), 128
    row = out["layer"] = dict(config=c, tokens=t)
    x = jax.random.normal(jax.random.key(1), (t, c["d_model"]), jnp.bfloat16)
    params = None
    for precision in ("bf16", "fp8"):
        cfg = moejax.MoEConfig(**c, param_dtype="bfloat16", expert_precision=precision)
        params = params or moejax.init_moe_params(cfg, jax.random.key(0))

        def loss(p, x, cfg=cfg):
            y, aux = moejax.moe_apply(p, x, cfg, implementation="pallas")
            return jnp.sum(y.astype(jnp.float32)) + aux.load_balance_loss

        try:
            secs = run.seconds(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x)
            row[f"{precision}_ms"] = secs * 1e3
        except Exception as err:  # noqa: BLE001
            run.log(traceback.format_exc())
            row[f"{precision}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    if "bf16_ms" in row and "fp8_ms" in row:
        row["fp8_speedup"] = row["bf16_ms"] / row["fp8_ms"]
    run.log(f"  fp8 layer: {row}")


def _train(run: Run, out: dict) -> None:
    from gpu_check import olmoe_hf_config

    from moejax.interop.hf import lm_config_from_hf
    from moejax.training import TrainConfig, init_train_state, make_train_step

    hf = olmoe_hf_config(run.dry)
    batch, seq = (2, 32) if run.dry else (8, 2048)
    base, _ = lm_config_from_hf(hf)
    base = base.replace(dtype="bfloat16", max_seq_len=seq)
    row = out["train"] = dict(batch=batch, seq=seq)
    data = jnp.asarray(
        np.random.default_rng(0).integers(0, hf["vocab_size"], (batch, seq + 1)), jnp.int32
    )
    for precision in ("bf16", "fp8"):
        if run.left() < 20 and not run.dry:
            run.skip("fp8", f"train {precision}", "the fp8 part's time budget is spent")
            continue
        cfg = base.replace(moe=base.moe.replace(expert_precision=precision))
        train_cfg = TrainConfig(steps=100, batch_size=batch, seq_len=seq, warmup_steps=1)
        try:
            step = make_train_step(cfg, train_cfg)
            holder = {"state": init_train_state(cfg, train_cfg)}

            def one_step(step=step, holder=holder):
                holder["state"], metrics = step(holder["state"], data)
                return metrics.loss

            start = time.perf_counter()
            row[f"{precision}_first_loss"] = float(one_step())
            row[f"{precision}_first_step_s"] = time.perf_counter() - start
            secs = run.seconds(one_step)
            row[f"{precision}_step_ms"] = secs * 1e3
            row[f"{precision}_tokens_per_s"] = batch * seq / secs
            holder.clear()
        except Exception as err:  # noqa: BLE001
            run.log(traceback.format_exc())
            row[f"{precision}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
        gc.collect()
    if "bf16_step_ms" in row and "fp8_step_ms" in row:
        row["fp8_speedup"] = row["bf16_step_ms"] / row["fp8_step_ms"]
    run.log(f"  fp8 train: {row}")


def part_fp8(run: Run) -> None:
    """The fp8 part (module docstring); results under results["fp8"]."""
    out = run.results["fp8"] = {}
    if run.on_gpu and not targets.is_hopper(jax.devices()[0].device_kind):
        run.skip("fp8", "everything", "the fp8 kernels need a Hopper GPU")
        return
    align = pk.GROUP_ALIGNMENT  # the fp8 kernels' row tile, on a GPU and interpreted alike
    # The train step first after the numerics: its two compiles are the longest wait, and
    # its fp8 / bf16 ratio the figure the slot is for; the kernel shapes then fill the rest.
    steps = (("numerics", lambda d: _numerics(run, align, out)),
             ("train", lambda d: _train(run, out)),
             ("kernels", lambda d: _kernels(run, align, out, d)),
             ("ffn", lambda d: _ffn(run, align, out)),
             ("layer", lambda d: _layer(run, out)))  # fmt: skip
    for name, fn in steps:
        deadline = time.perf_counter() + (float("inf") if run.dry else BUDGET_S[name])
        if run.left() < 5:
            run.skip("fp8", name, "the fp8 part's time budget is spent")
            continue
        try:
            fn(min(deadline, run.deadline))
        except Exception as err:  # noqa: BLE001  (one step fails, the next runs)
            run.log(traceback.format_exc())
            out.setdefault("errors", []).append(f"{name}: {type(err).__name__}: {err}"[:500])
        gc.collect()
        jax.clear_caches()


def markdown(fp8_results: dict) -> list[str]:
    """The fp8 tables for results.md."""
    lines = ["**FP8 experts** (DeepSeek-V3 recipe)", ""]
    for r in fp8_results.get("numerics", []):
        lines.append(f"- numerics {r['kernel']}: rel err {r.get('rel_err', float('nan')):.2e}, "
                     f"ok={r['ok']} {r.get('error', '')}")  # fmt: skip
    rows = fp8_results.get("kernels", [])
    if rows:
        names = sorted({n for r in rows for n in r["tflops"]})
        lines += ["", "| shape | kernel | " + " | ".join(names) + " | fp8 / bf16 |",
                  "|---|---|" + "---|" * (len(names) + 1)]  # fmt: skip
        for r in rows:
            cells = [f"{r['tflops'][n]:.0f}" if n in r["tflops"] else "-" for n in names]
            lines.append(f"| {r['shape']} | {r['kernel']} | " + " | ".join(cells)
                         + f" | {r['fp8_over_bf16']:.2f} |")  # fmt: skip
    for r in fp8_results.get("quantize", []):
        figures = ", ".join(f"{k_.removesuffix('_gb_per_s')} {v:.0f} GB/s" for k_, v in r.items()
                            if k_.endswith("_gb_per_s"))  # fmt: skip
        lines.append(f"- quantize {r['operand']} {r['dims']} both ways ({r['shape']}): {figures}")
    for r in fp8_results.get("ffn", []):
        rest = {k_: v for k_, v in r.items() if k_ != "what"}
        lines.append(f"- {r['what']}: {rest}")
    if "ffn_fused_speedup" in fp8_results:
        lines.append(f"- ffn: fused quantization {fp8_results['ffn_fused_speedup']:.3f}x unfused")
    for key in ("layer", "train"):
        if key in fp8_results:
            lines += ["", f"- {key}: {fp8_results[key]}"]
    return [*lines, ""]
