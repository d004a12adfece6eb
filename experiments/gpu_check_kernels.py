"""`gpu_check.py`'s kernel parts: numerics (every grouped-matmul kernel compiled on the device
against `jax.lax.ragged_dot`) and kernels (TFLOP/s beside a dense matmul, jax's and torch's
grouped matmuls), with the kernel setup the fp8 part shares: our kernels per backend and
pipeline, aligned group sizes, operands. Descriptions and budgets: `gpu_check.py`.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from gpu_check_lib import Run, free_torch_cache, maybe_profile, rel_err, to_torch, torch_unavailable

import pallas_kernels as pk
from pallas_kernels import config as pk_config
from pallas_kernels import shapes as pk_shapes
from pallas_kernels import targets

BF16_TOL = 2 * float(jnp.finfo(jnp.bfloat16).eps)  # one bf16 rounding of the output, with margin
DRY_TILES = pk.Config(tm=64, tk=64, tn=128, num_stages=2, raster=2)  # interpreters: few tiles
SAMPLE_ROWS = 2048  # rows (gmm, gmm_t) of torch's output checked against ours; tgmm: 1 group


def kernel_kw(run: Run, backend: str) -> dict:
    """Kernel options: compiled on a GPU; interpreted with small tiles in a CPU dry run."""
    if run.on_gpu:
        return dict(backend=backend)
    return dict(backend=backend, interpret=True, config=DRY_TILES)


def alignment(run: Run) -> int:
    """What moejax's permute pads experts to for the Hopper kernels (their row tile)."""
    return DRY_TILES.tm if not run.on_gpu else pk.GROUP_ALIGNMENT


def aligned_sizes(routing: str, m: int, g: int, align: int, *, seed: int = 0, spare: int = 0):
    """[G] int32 sizes, each a multiple of `align` (what moejax's permute makes), summing to
    m // align - spare tiles: the routing's sizes drawn in units of `align` rows."""
    units = m // align - spare
    return (pk_shapes.make_group_sizes(routing, units, g, seed=seed) * align).astype(np.int32)


def operands(m: int, k: int, n: int, g: int, seed: int):
    """x [M, K], w [G, K, N] (scaled by 1/sqrt(K)), dy [M, N], bf16, made on the device (the
    DeepSeek-V3 weights, 3.8e9 values, take a minute to draw on the host)."""
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (g, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (m, n), jnp.bfloat16)
    return x, w, dy


def ours(run: Run, backend: str, align: int, pipeline: str | None = None, dims=None) -> dict:
    """kernel -> jitted fn(a, b, sizes) of our kernels on `backend`; Mosaic GPU's on
    `pipeline` (`pk.Config.pipeline`, with each kernel's default tiles for `dims`, the
    forward's (M, K, N, G)) where given."""
    kw = dict(kernel_kw(run, backend), group_alignment=align)
    if pipeline is not None:
        kw["config"] = with_pipeline(kw.get("config"), pipeline, dims)
    return {
        "gmm": jax.jit(lambda a, b, s: pk.gmm(a, b, s, **kw)),
        "gmm_t": jax.jit(lambda a, b, s: pk.gmm(a, b, s, transpose_rhs=True, **kw)),
        "tgmm": jax.jit(lambda a, b, s: pk.tgmm(a, b, s, **kw)),
    }


def with_pipeline(config, pipeline: str, dims) -> dict:
    """{kernel: Config} on `pipeline`: `config` (the dry run's tiles), else each kernel's
    default Mosaic GPU tiles for the forward's `dims` (M, K, N, G)."""
    if config is not None:
        return dict.fromkeys(
            ("gmm", "gmm_t", "tgmm"), dataclasses.replace(config, pipeline=pipeline)
        )
    return pk_config.vjp_configs("pallas_mosaic_gpu", jnp.bfloat16, *dims, pipeline=pipeline)


def references(out_dtype) -> dict:
    """kernel -> jitted fn(a, b, sizes) of XLA's ragged dot (the oracle and a baseline)."""
    return {
        "gmm": jax.jit(
            lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=out_dtype)
        ),
        "gmm_t": jax.jit(
            lambda a, b, s: jax.lax.ragged_dot(
                a, jnp.swapaxes(b, 1, 2), s, preferred_element_type=out_dtype
            )
        ),
        "tgmm": jax.jit(
            lambda a, b, s: pk.reference_tgmm(a, b, s, preferred_element_type=out_dtype)
        ),
    }


# -------------------------------------------------------------------------- part: numerics
STREAM = "pallas_mosaic_gpu, stream"  # the numerics rows of `Config(pipeline="stream")`


def part_numerics(run: Run) -> None:
    """Every kernel on the device against jax.lax.ragged_dot(_general), bf16."""
    m, k, n, g = (8192, 1024, 768, 16) if not run.dry else (512, 128, 128, 4)
    align = alignment(run)
    x, w, dy = operands(m, k, n, g, seed=0)
    # The aligned cases leave one row tile past the groups (it must come out zero). The first
    # two compile every kernel (aligned, then realigned rows): a short budget keeps them.
    cases = {
        "zipf_aligned": (aligned_sizes("zipf", m, g, align, spare=1), align),
        "unaligned_partial": (pk_shapes.make_group_sizes("zipf", m - 37, g, seed=3), 1),
        "empty_groups_aligned": (aligned_sizes("with_empty", m, g, align, spare=1), align),
        "balanced_aligned": (aligned_sizes("balanced", m, g, align, spare=1), align),
    }
    want_fns = references(jnp.float32)
    got_fns = {
        (b, a): ours(run, b, a) for b in ("pallas_mosaic_gpu", "pallas_triton") for a in {align, 1}
    }
    for a in {align, 1}:  # the Mosaic GPU kernels on their other pipeline (`Config.pipeline`)
        got_fns[STREAM, a] = ours(run, "pallas_mosaic_gpu", a, "stream", (m, k, n, g))
    run.results["numerics_tolerance"] = BF16_TOL
    rows = run.results["numerics"] = []
    for case, (sizes, case_align) in cases.items():
        if run.left() < 0:
            run.skip("numerics", case, "the part's time budget is spent")
            continue
        s, used = jnp.asarray(sizes), int(sizes.sum())
        args = {"gmm": (x, w, s), "gmm_t": (dy, w, s), "tgmm": (x, dy, s)}
        want = {kernel: fn(*args[kernel]) for kernel, fn in want_fns.items()}
        for backend in ("pallas_mosaic_gpu", STREAM, "pallas_triton"):
            for kernel, fn in got_fns[backend, case_align].items():
                try:
                    value = fn(*args[kernel])
                except Exception as err:  # noqa: BLE001  (reported as a failed row)
                    run.log(traceback.format_exc())
                    rows.append(dict(case=case, backend=backend, kernel=kernel, ok=False,
                                     error=f"{type(err).__name__}: {str(err)[:300]}"))  # fmt: skip
                    continue
                err, scale = rel_err(value, want[kernel]), float(jnp.abs(want[kernel]).max())
                zero_tail = kernel == "tgmm" or not np.asarray(value[used:], np.float32).any()
                # A NaN error fails the comparison; so does an all-zero reference (no check).
                ok = bool(err <= BF16_TOL and zero_tail and scale > 0)
                rows.append(dict(case=case, backend=backend, kernel=kernel, rel_err=err,
                                 ref_max=scale, zero_past_groups=bool(zero_tail),
                                 ok=ok))  # fmt: skip
                run.log(f"  {case:22s} {backend:18s} {kernel:6s} err {err:.2e} ok={ok}")
    # What the layer runs: grouped_matmul(backend="pallas") forward and VJP, aligned groups.
    sizes = jnp.asarray(cases["zipf_aligned"][0])

    def fwd_vjp(impl):
        def f(x, w):
            out, vjp = jax.vjp(
                lambda a, b: pk.grouped_matmul(a, b, sizes, group_alignment=align, **impl), x, w
            )
            return (out, *vjp(out))

        return jax.jit(f)

    pallas = dict(backend="pallas") if run.on_gpu else kernel_kw(run, "pallas_mosaic_gpu")
    got, want = fwd_vjp(pallas)(x, w), fwd_vjp(dict(backend="reference"))(x, w)
    for what, a, b in zip(("out", "dlhs", "drhs"), got, want, strict=True):
        err, scale = rel_err(a, b), float(jnp.abs(b).max())
        ok = bool(err <= BF16_TOL and scale > 0)
        rows.append(dict(case="grouped_matmul_vjp", backend=pallas["backend"], kernel=what,
                         rel_err=err, ref_max=scale, ok=ok))  # fmt: skip
        run.log(f"  grouped_matmul fwd+VJP {pallas['backend']} {what}: err {err:.2e}")
    run.results["numerics_ok"] = all(r["ok"] for r in rows)


# --------------------------------------------------------------------------- part: kernels
def kernel_problems(run: Run) -> list[tuple[str, int, int, int, int]]:
    """(shape, M, K, N, G): the model shapes on a GPU; one tiny problem in a dry run."""
    if run.dry:
        return [("tiny", 512, 128, 256, 4)]
    out = []
    for name in ("mixtral_8x7b", "fine_grained", "deepseek_v3"):
        spec = pk_shapes.SHAPES[name]
        out.append((name, spec.m, spec.k, spec.n, spec.g))
    return out


def _mgpu_module(name: str):
    return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")


def kernel_impls(run: Run, m: int, k: int, n: int, g: int) -> dict[str, dict]:
    """name -> kernel -> jitted fn(a, b, sizes), or a string: why it is unavailable."""
    align = alignment(run)
    impls = {"ours: Mosaic GPU": ours(run, "pallas_mosaic_gpu", align),
             "ours: Mosaic GPU, stream": ours(run, "pallas_mosaic_gpu", align, "stream",
                                              (m, k, n, g)),
             "ours: Triton": ours(run, "pallas_triton", align)}  # fmt: skip
    if g >= 256 and not run.dry:
        impls["jax.lax.ragged_dot"] = "not timed at G >= 256 (XLA:GPU: seconds per call)"
    else:
        impls["jax.lax.ragged_dot"] = references(jnp.bfloat16)
    if not (run.on_gpu and targets.is_hopper(jax.devices()[0].device_kind)):
        impls["jax ragged_dot_mgpu"] = "needs a Hopper GPU (compiled Mosaic GPU, no interpreter)"
        return impls
    mgpu, tmgpu = _mgpu_module("ragged_dot_mgpu"), _mgpu_module("transposed_ragged_dot_mgpu")
    kw = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
    impls["jax ragged_dot_mgpu"] = {
        "gmm": jax.jit(lambda a, b, s: mgpu.ragged_dot(a, b, group_sizes=s, **kw)),
        "gmm_t": jax.jit(
            lambda a, b, s: mgpu.ragged_dot(a, b, group_sizes=s, transpose_rhs=True, **kw)
        ),
        # lhs (K, M) contracted over its ragged first dim: x [rows, K] with dy [rows, N].
        "tgmm": jax.jit(lambda a, b, s: tmgpu.transposed_ragged_dot(a, b, group_sizes=s, **kw)),
    }
    return impls


def torch_grouped_mm(run: Run, kernel: str, a, b, sizes: np.ndarray, sample):
    """(seconds, max |err| / max |ours| on a sample or None) of torch._grouped_mm on the same
    operands (dlpack views of the jax arrays), or why not (a string)."""
    if why := torch_unavailable():
        return why
    import torch

    ta, tb = to_torch(a), to_torch(b)
    offs = torch.tensor(np.cumsum(sizes), device=ta.device, dtype=torch.int32)
    if kernel == "gmm_t":
        tb = tb.transpose(-2, -1)  # [G, N, K], a strided view: what the weights' backward reads
    elif kernel == "tgmm":
        ta = ta.t()  # [K, rows] @ [rows, N], grouped over the contracted rows: [G, K, N]

    def fn():
        return torch._grouped_mm(ta, tb, offs=offs)

    try:
        secs = run.torch_seconds(fn)
        err = None
        if sample is not None:
            cut = 1 if kernel == "tgmm" else SAMPLE_ROWS
            err = rel_err(fn()[:cut].float().cpu().numpy(), sample)
        return secs, err
    except Exception as err:  # noqa: BLE001  (a comparison column; reported, not fatal)
        return f"{type(err).__name__}: {str(err)[:200]}"


def _time_row(run: Run, row: dict, impls: dict, args: tuple, flops: float, slow: bool):
    """Times every implementation of row's kernel; returns a sample of our first output."""
    sample = None
    for name, impl in impls.items():
        if isinstance(impl, str):
            row["unavailable"][name] = impl
            continue
        if run.left() < 2:
            row["unavailable"][name] = "the part's time budget is spent"
            continue
        fn = impl[row["kernel"]]
        try:
            tag = re.sub(r"\W+", "_", f"{row['shape']}_{row['routing']}_{row['kernel']}_{name}")
            with maybe_profile(run, tag):
                secs = run.seconds(fn, *args, slow=slow and name == "jax.lax.ragged_dot")
            row["tflops"][name] = flops / secs / 1e12
            if sample is None and name.startswith("ours"):
                cut = 1 if row["kernel"] == "tgmm" else SAMPLE_ROWS
                sample = np.asarray(fn(*args)[:cut], np.float32)
        except Exception as err:  # noqa: BLE001  (one column fails, the rest runs)
            row["unavailable"][name] = f"{type(err).__name__}: {str(err)[:200]}"
    return sample


def part_kernels(run: Run) -> None:
    rows = run.results["kernels"] = []
    align = alignment(run)
    for shape, m, k, n, g in kernel_problems(run):
        if run.left() < 5:
            run.skip("kernels", shape, "the part's time budget is spent")
            continue
        impls = kernel_impls(run, m, k, n, g)  # compiled once per shape, for both routings
        x, w, dy = operands(m, k, n, g, seed=1)
        args = {"gmm": (x, w), "gmm_t": (dy, w), "tgmm": (x, dy)}
        for routing in ("balanced", "zipf"):
            sizes_np = aligned_sizes(routing, m, g, align, seed=1)  # every row tile used
            sizes, used = jnp.asarray(sizes_np), int(sizes_np.sum())
            flops = 2.0 * used * k * n
            dense = {
                "gmm": (jax.jit(lambda a, b: a @ b), (x[:used], w[0])),
                "gmm_t": (jax.jit(lambda a, b: a @ b.T), (dy[:used], w[0])),
                "tgmm": (jax.jit(lambda a, b: a.T @ b), (x[:used], dy[:used])),
            }
            for kernel in ("gmm", "gmm_t", "tgmm"):
                if run.left() < 2:
                    run.skip("kernels", f"{shape} {routing} {kernel}", "the budget is spent")
                    continue
                row = dict(shape=shape, routing=routing, kernel=kernel, m=m, k=k, n=n, g=g,
                           rows=used, tflops={}, unavailable={})  # fmt: skip
                fn, dense_args = dense[kernel]
                row["tflops"]["dense jnp"] = flops / run.seconds(fn, *dense_args) / 1e12
                sample = _time_row(run, row, impls, (*args[kernel], sizes), flops, slow=g >= 64)
                t = torch_grouped_mm(run, kernel, *args[kernel], sizes_np, sample)
                if isinstance(t, str):
                    row["unavailable"]["torch._grouped_mm"] = t
                else:
                    row["tflops"]["torch._grouped_mm"] = flops / t[0] / 1e12
                    if t[1] is not None:
                        row["torch_vs_ours"] = t[1]
                rows.append(row)
                figures = " ".join(f"{name}={v:.1f}" for name, v in row["tflops"].items())
                run.log(f"  {shape:13s} {routing:8s} {kernel:6s} {figures}")
            del dense
        del x, w, dy, args, impls
        gc.collect()
        free_torch_cache()
