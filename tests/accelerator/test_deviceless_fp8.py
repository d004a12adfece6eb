"""The fp8 Mosaic GPU kernels (forward and lhs gradient: fp8_gmm; weight gradient: fp8_tgmm),
compiled for H100 on this CPU machine: in the program, zero spills, registers within the
three-warpgroup launch budget, shared memory within the limit. The default run compiles one
case (DeepSeek-V3's expert shape, the up projection) on each pipeline; the other shapes and
projections are slow.
"""

import functools

import pytest
from _targets import CACHE_WARNING, needs_cuda

from pallas_kernels import config, fp8_mosaic_gpu, mgpu_compat, resources, targets

pytestmark = [pytest.mark.deviceless, CACHE_WARNING]


@functools.cache
def _rows(cases):
    return resources.report("cuda", list(cases))


def _check(rows, cases):
    assert len(rows) == 2 * cases
    for r in rows:
        what = f"{r['case']} {r['kernel']}"
        # fp8_gmm runs twice (forward, lhs gradient), fp8_tgmm once
        assert r["in_program"] == (2 if r["kernel"] == "fp8_gmm" else 1), what
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, what
        assert 0 < r["registers"] <= 168, what
        assert r["smem_model"] <= config.MOSAIC_GPU_SMEM_LIMIT, what
        assert r["tiles"] == [fp8_mosaic_gpu.TILE] * 3, what


@needs_cuda
@pytest.mark.parametrize("pipeline", fp8_mosaic_gpu.PIPELINES)
def test_h100_fp8_kernels_compile_without_spills_deepseek_v3(pipeline):
    case = resources.Case(
        "deepseek_v3", "bfloat16", "in", backend=resources.FP8_BACKEND, pipeline=pipeline
    )
    rows = _rows((case,))
    _check(rows, 1)
    assert {r["config"]["pipeline"] for r in rows} == {pipeline}


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("split", fp8_mosaic_gpu.SPLITS)
def test_h100_fp8_kernels_compile_without_spills_every_shape(split):
    _check(_rows(tuple(resources.fp8_cases(split=split))), len(resources.MOSAIC_GPU_SHAPES) * 2)


_PTX_PROGRAM = """
import sys, jax, jax.numpy as jnp
from pallas_kernels import fp8_mosaic_gpu, targets
mesh = targets.mesh_for("cuda", (1,), ("x",))
m, k, n, g = 1024, 512, 512, 4
f8, f32 = jnp.float8_e4m3fn, jnp.float32
args = [((m, k), f8), ((m, k // 128), f32), ((g, n, k), f8), ((g, n // 128, k // 128), f32),
        ((g,), jnp.int32)]
args = targets.shapes_on([jax.ShapeDtypeStruct(s, d) for s, d in args], mesh)
def fn(*a):
    return fp8_mosaic_gpu.fp8_gmm(*a, out_dtype=jnp.bfloat16, group_alignment=128,
                                  split=sys.argv[1])
with targets.lowering(mesh):
    jax.jit(fn).lower(*args).compile()
"""


def _compile_output(program: str, dump: str, *args: str) -> str:
    """What compiling `program` in a fresh process prints with Mosaic GPU's `dump` on
    (`MOSAIC_GPU_DUMP_PTX`, `MOSAIC_GPU_DUMP_PTXAS`: read when jax loads)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu", dump: "1"}
    proc = subprocess.run(
        [sys.executable, "-c", program, *args], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@needs_cuda
@pytest.mark.parametrize(("split", "width"), [("cols", 64), ("rows", 128)])
def test_h100_fp8_gmm_wgmma_width_follows_the_split(split, width):
    """The PTX Mosaic GPU emits for fp8_gmm (its MOSAIC_GPU_DUMP_PTX output): each consumer's
    wgmma is 64 columns wide when the consumers split the tile by columns, 128 when by rows."""
    import re

    out = _compile_output(_PTX_PROGRAM, "MOSAIC_GPU_DUMP_PTX", split)
    shapes = set(
        re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.e4m3\.e4m3", out)
    )
    assert shapes == {f"m64n{width}k32"}, shapes


_QUANTIZE_PROGRAM = """
import jax, jax.numpy as jnp
from moejax.aot import schedule
from pallas_kernels import fp8_quantizers, targets
mesh = targets.mesh_for("cuda", (1,), ("x",))
m, k = 2048, 1024
x = targets.shapes_on(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), mesh)
w = targets.shapes_on(jax.ShapeDtypeStruct((4, k, m), jnp.bfloat16), mesh)
live = targets.shapes_on(jax.ShapeDtypeStruct((), jnp.int32), mesh)
def masked(x, live):  # rows from live on zeroed as they are read
    return fp8_quantizers.quantize_both(x, live_rows=live)
for name, fn, args in (("activations", masked, (x, live)),
                       ("weights", fp8_quantizers.quantize_blocks_both, (w,)),
                       ("swiglu", fp8_quantizers.quantize_swiglu, (x, x)),
                       ("swiglu_grad", fp8_quantizers.quantize_swiglu_grad, (x, x, x))):
    with targets.lowering(mesh):
        text = jax.jit(fn).lower(*args).compile().as_text()
    ops = [op for op in schedule.parse(text) if op.kind == schedule.COMPUTE]
    print(f"@@kernel_bytes {name}", max(op.bytes for op in ops) / (2 * args[0].size))
"""


@needs_cuda
@pytest.mark.skipif(not mgpu_compat.LOADS_TRANSPOSED, reason="jax 0.10: no transposed tile loads")
def test_h100_fused_quantizers_read_their_operand_once_without_spills():
    """The fused quantizers compiled for H100: ptxas reports no spills, and each call moves
    its operands' bytes once plus its outputs': quantize_both and quantize_blocks_both 2 x
    their operand (read once, rows past the groups zeroed on the way, its two fp8 copies, the
    scales; XLA's quantization of the same two layouts moves 5 x for activations and 3 x for
    weights, test_h100_quantization_traffic_is_two_passes); quantize_swiglu 3 x one input
    (gate and up read, h's two fp8 copies written: XLA's activation then quantize_both move
    3 + 2); quantize_swiglu_grad 5 x (dh, gate and up read, two pairs of fp8 copies: 5 + 2 x 2
    with XLA's activation gradient then two quantize_both)."""
    import re

    out = _compile_output(_QUANTIZE_PROGRAM, "MOSAIC_GPU_DUMP_PTXAS")
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", out)]
    assert spills and all(a == b == "0" for a, b in spills), spills
    # 128 threads a CTA: at most 168 registers each lets three CTAs share an SM's registers
    # (the activation gradient's 97 KiB of shared memory allows two)
    assert registers and max(registers) <= 168, registers
    moved = dict(re.findall(r"@@kernel_bytes (\w+) ([\d.]+)", out))
    assert moved.keys() == {"activations", "weights", "swiglu", "swiglu_grad"}, out[-2000:]
    expected = {"activations": 2, "weights": 2, "swiglu": 3, "swiglu_grad": 5}
    assert all(expected[k] <= float(v) <= expected[k] + 0.07 for k, v in moved.items()), moved


def _kernels(fn, *shapes):
    """The kernels of `fn`'s H100 program (XLA's fusions and the custom calls, as compiled),
    costed by `moejax.aot.schedule`."""
    import jax

    from moejax.aot import schedule
    from pallas_kernels import targets

    mesh = targets.mesh_for("cuda", (1,), ("x",))
    args = targets.shapes_on(tuple(jax.ShapeDtypeStruct(*s) for s in shapes), mesh)
    with targets.lowering(mesh):
        text = jax.jit(fn).lower(*args).compile().as_text()
    return [op for op in schedule.parse(text) if op.kind == schedule.COMPUTE]


def _hbm_bytes(fn, *shapes):
    """HBM bytes the kernels of `fn`'s H100 program read and write."""
    return sum(op.bytes for op in _kernels(fn, *shapes))


@needs_cuda
def test_h100_schedule_model_prices_the_fp8_kernels():
    """The schedule model (moejax.aot.schedule) counts each fp8 kernel's products, at the fp8
    rate: forward, lhs gradient and weight gradient, 2 M K N each."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import fp8_ops

    m, k, n, g = 1024, 512, 256, 4

    def fn(x, w, sizes):
        def op(x, w):
            return fp8_ops.fp8_grouped_matmul(
                x, w, sizes, backend="pallas_mosaic_gpu", group_alignment=128
            )

        out, vjp = jax.vjp(op, x, w)
        return out, *vjp(out)

    shapes = (((m, k), jnp.bfloat16), ((g, k, n), jnp.bfloat16), ((g,), jnp.int32))
    priced = [(op.flops, op.dtype) for op in _kernels(fn, *shapes) if op.flops]
    assert priced == [(2.0 * m * k * n, "f8")] * 3, priced


@needs_cuda
def test_h100_quantization_traffic_is_two_passes():
    """Quantizing a bf16 operand both ways (1 x 128 and 128 x 1 tiles, the forward's and the
    weight gradient's layouts) costs two passes over it per layout: one read for the tile
    maxima, one to scale and cast, and the fp8 writes (half its size each): 5 x its bytes,
    plus the fp32 scales (1/128 of the elements; 5% covers them). Weights (128 x 128 blocks,
    both orientations from one reduction): two reads and two fp8 writes, 3 x. Taking the
    maxima on fp32 copies of x^T, as fp8.py once did, cost 12 x."""
    import jax.numpy as jnp

    from pallas_kernels import fp8

    m, k, g, n = 4096, 2048, 4, 1024
    got = _hbm_bytes(lambda x: (fp8.quantize_rows(x), fp8.quantize_cols(x)), ((m, k), jnp.bfloat16))
    assert got <= 5 * 1.05 * (2 * m * k), got / (2 * m * k)

    def weights(w):
        q, s = fp8.quantize_blocks(w)
        return (q, s), fp8.transpose_blocks(q, s)

    got = _hbm_bytes(weights, ((g, k, n), jnp.bfloat16))
    assert got <= 3 * 1.05 * (2 * g * k * n), got / (2 * g * k * n)


@needs_cuda
@pytest.mark.skipif(not mgpu_compat.LOADS_TRANSPOSED, reason="jax 0.10: no fused quantizers")
def test_h100_fp8_swiglu_ffn_moves_each_operand_once():
    """The fp8 SwiGLU FFN's H100 program (forward and VJP, fp32 master weights), everything
    but its nine matmuls, in bytes per element (M x D for x, dy, dx; M x F for the hidden
    activations; G x D x F per weight):
      * each weight read in fp32 and written as two fp8 copies (6), its gradient widened from
        bf16 to fp32 (6, what an optimizer's fusion would absorb in a train step): 3 x 12;
      * x and dy quantized both ways (4 each; rows past the groups zeroed as they are read),
        dx = the two input gradients summed (6): 14;
      * the activation read as gate and up (4) and written as h's two fp8 copies (2); its
        gradient read as dh, gate and up (6) and written as four fp8 copies (4): 16.
    The unfused composition (three fp8_grouped_matmul calls around XLA's activation, with
    the weights cast to bf16 first) moves a third more."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import fp8_ops

    m, d, f, g = 4096, 1024, 2048, 8
    kw = dict(backend="pallas_mosaic_gpu", group_alignment=128)

    def fused(x, *ws):
        return fp8_ops.fp8_swiglu_ffn(x, *ws[:3], ws[3], **kw)

    def unfused(x, *ws):
        def mm(a, w):
            return fp8_ops.fp8_grouped_matmul(a, w.astype(a.dtype), ws[3], **kw)

        return mm(jax.nn.silu(mm(x, ws[0])) * mm(x, ws[1]), ws[2])

    def fwd_vjp(op):
        def fn(x, wg, wu, wd, sizes, dy):
            out, vjp = jax.vjp(lambda x, *w: op(x, *w, sizes), x, wg, wu, wd)
            return out, *vjp(dy)

        return fn

    shapes = (((m, d), jnp.bfloat16), ((g, d, f), jnp.float32), ((g, d, f), jnp.float32),
              ((g, f, d), jnp.float32), ((g,), jnp.int32), ((m, d), jnp.bfloat16))  # fmt: skip
    moved = {}
    for name, op in (("fused", fused), ("unfused", unfused)):
        kernels = _kernels(fwd_vjp(op), *shapes)
        assert sum(1 for k in kernels if k.flops) == 9, name
        moved[name] = sum(k.bytes for k in kernels if not k.flops)
    expected = 3 * 12 * g * d * f + 14 * m * d + 16 * m * f
    assert expected <= moved["fused"] <= 1.02 * expected, moved["fused"] / expected
    assert moved["unfused"] >= 1.3 * moved["fused"], moved


_SASS_PROGRAM = """
import sys, jax, jax.numpy as jnp
from pallas_kernels import fp8_mosaic_gpu, targets
mesh = targets.mesh_for("cuda", (1,), ("x",))
m, k, n, g = 1024, 512, 512, 4
f8, f32 = jnp.float8_e4m3fn, jnp.float32
if sys.argv[1] == "fp8_gmm":
    fn = fp8_mosaic_gpu.fp8_gmm
    args = [((m, k), f8), ((m, k // 128), f32), ((g, n, k), f8), ((g, n // 128, k // 128), f32)]
else:
    fn = fp8_mosaic_gpu.fp8_tgmm
    args = [((k, m), f8), ((k, m // 128), f32), ((n, m), f8), ((n, m // 128), f32)]
args = targets.shapes_on([jax.ShapeDtypeStruct(s, d) for s, d in args + [((g,), jnp.int32)]], mesh)
with targets.lowering(mesh):
    jax.jit(lambda *a: fn(*a, out_dtype=jnp.bfloat16, group_alignment=128)).lower(*args).compile()
"""


@needs_cuda
@pytest.mark.skipif(
    not targets.has_nvdisasm(), reason="no nvdisasm: python -m pallas_kernels.targets --install"
)
@pytest.mark.parametrize("kernel", ["fp8_gmm", "fp8_tgmm"])
def test_h100_fp8_kernels_issue_their_wgmmas_before_the_scale_products(kernel):
    """The SASS of each consumer step (default split and pipeline, from MOSAIC_GPU_DUMP_SASS):
    all the step's wgmmas (QGMMA) are issued before any scale product (FMUL: the weight
    gradient's 64 row x column products per thread, the forward's row x block scale), which
    then run in their shadow or after the wait (WARPGROUP.DEPBAR), before the promotion (64
    FFMA). Before the scale was traced after the wgmma call (and, in fp8_tgmm, behind a
    warpgroup barrier), ptxas issued one QGMMA, 52 FMULs, then the other seven, the tensor
    cores idle while the FMULs issued."""
    import re

    out = _compile_output(_SASS_PROGRAM, "MOSAIC_GPU_DUMP_SASS", kernel)
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", out)
    first = ops.index("QGMMA")
    wait = ops.index("WARPGROUP", first + 1)
    step = ops[first:wait]
    assert step.count("QGMMA") in (4, 8), step  # 64 x 128 x 32 (rows) or 64 x 64 x 32 (cols)
    last = len(step) - 1 - step[::-1].index("QGMMA")
    assert "FMUL" not in step[:last], " ".join(step)
    scale = ops[first : wait + 100]
    assert scale.count("FMUL") >= (64 if kernel == "fp8_tgmm" else 1), " ".join(scale)
    promotion = ops[wait:]
    assert promotion[: promotion.index("FFMA") + 64].count("FFMA") == 64, promotion[:80]
