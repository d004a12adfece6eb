"""What each kernel costs on the real target, read from deviceless compiles (no GPU or TPU).

For H100, the compiler's own reports: ptxas's registers and spill stores per kernel (XLA logs
`ptxas -v` with `TF_CPP_VMODULE=subprocess_compilation=3`, Mosaic GPU kernels included) and
each Triton launch's grid and shared memory (XLA's thunk sequence, `--xla_dump_to`). A Mosaic
GPU kernel is a custom call there, without either: its shared memory is the model
(`config.mosaic_gpu_smem_bytes`), which equals what Mosaic GPU computes and checks against the
limit when it lowers the kernel (tested), and its grid is one CTA per SM. For TPU, Mosaic
compiles each kernel for real (an oversized block fails); its VMEM use is not reported, so the
report gives the block model (`config.mosaic_vmem_bytes`) and the compile time.

Both logs are per process, so `report(platform, cases)` runs the compiles in a subprocess
(`python -m pallas_kernels.resources`) and parses what it printed and dumped.

A `Case` is one differentiable expert matmul at a named model shape (`shapes.SHAPES`), compiled
as forward and VJP together (kernels gmm, gmm_t, tgmm), or the fused row-gather gmm
(`kernel="gather_gmm"`, forward, Triton only), on one backend: "pallas" (what the target gets:
on H100, Mosaic GPU for bf16 and Triton for fp32) or a named one ("pallas_triton").
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from pallas_kernels import config as config_lib
from pallas_kernels import introspect, shapes, targets

MODEL_SHAPES = ("mixtral_8x7b", "fine_grained")
MOSAIC_GPU_SHAPES = (*MODEL_SHAPES, "deepseek_v3")
FP8_BACKEND = "fp8_mosaic_gpu"  # a Case of `fp8_ops.fp8_grouped_matmul` on its Hopper kernels


@dataclasses.dataclass(frozen=True)
class Case:
    """One compiled program.

    Attributes:
      shape: a name in `shapes.SHAPES`.
      dtype: "float32" or "bfloat16".
      projection: "in" (lhs [M, D] times [E, D, F]) or "out" (lhs [M, F] times [E, F, D]).
      kernel: "vjp" (gmm forward with its VJP: gmm, gmm_t, tgmm) or "gather_gmm".
      backend: "pallas" (the target decides), a concrete backend of `config.BACKENDS`, or
        `FP8_BACKEND`: the fp8 recipe (`fp8_ops`, operands of `dtype` quantized to e4m3) on the
        fp8 Mosaic GPU kernels (fp8_gmm for the forward and the lhs gradient, fp8_tgmm).
      split: for `FP8_BACKEND`, how the kernels' consumers halve a tile
        (`fp8_mosaic_gpu.SPLITS`; None: the default).
      pipeline: for the Mosaic GPU kernels (bf16 and `FP8_BACKEND`), how they bring K blocks to
        shared memory (`mosaic_gpu.PIPELINES`; None: the default).
    """

    shape: str
    dtype: str
    projection: str = "in"
    kernel: str = "vjp"
    backend: str = "pallas"
    split: str | None = None
    pipeline: str | None = None

    def dims(self) -> tuple[int, int, int, int]:
        """(M, K, N, G) of the forward gmm."""
        spec = shapes.SHAPES[self.shape]
        k, n = (spec.k, spec.n) if self.projection == "in" else (spec.n, spec.k)
        return spec.m, k, n, spec.g

    def kernels(self) -> tuple[str, ...]:
        if self.backend == FP8_BACKEND:
            return ("fp8_gmm", "fp8_tgmm")
        return ("gather_gmm",) if self.kernel == "gather_gmm" else ("gmm", "gmm_t", "tgmm")

    def name(self) -> str:
        name = f"{self.kernel}_{self.shape}_{self.projection}_{self.dtype}_{self.backend}"
        return name + "".join(f"_{v}" for v in (self.split, self.pipeline) if v)

    def concrete_backend(self, platform: str) -> str:
        """The backend the kernels run on when compiled for `platform` ("cuda": an H100)."""
        if self.backend != "pallas":
            return self.backend
        if platform == "tpu":
            return "pallas_tpu"
        from pallas_kernels import ops

        with jax.sharding.use_abstract_mesh(targets.abstract_gpu_mesh()):
            return ops.gpu_backend(self.dtype)


def default_cases(platform: str) -> list[Case]:
    """Every kernel at both model shapes, fp32 and bf16, both projections. On GPU these are the
    Triton kernels (H100 runs them for fp32, older GPUs for every dtype), with the fused gather
    gmm, and then what H100 runs for bf16, the Mosaic GPU kernels, also at DeepSeek-V3's shape."""
    backend = "pallas_triton" if platform == "cuda" else "pallas"
    cases = [
        Case(shape, dtype, projection, backend=backend)
        for shape in MODEL_SHAPES
        for dtype in ("float32", "bfloat16")
        for projection in ("in", "out")
    ]
    if platform == "cuda":
        cases += [
            Case(s, d, "in", "gather_gmm", backend)
            for s in MODEL_SHAPES
            for d in ("float32", "bfloat16")
        ]
        cases += [Case(s, "bfloat16", p) for s in MOSAIC_GPU_SHAPES for p in ("in", "out")]
    return cases


def fp8_cases(
    shapes_: tuple[str, ...] = MOSAIC_GPU_SHAPES, split: str | None = None,
    pipeline: str | None = None,
) -> list[Case]:  # fmt: skip
    """The fp8 kernels (H100 only) at `shapes_`, both projections, from bf16 operands."""
    return [
        Case(s, "bfloat16", p, backend=FP8_BACKEND, split=split, pipeline=pipeline)
        for s in shapes_
        for p in ("in", "out")
    ]


def kernel_rows(case: Case, platform: str) -> dict[str, dict]:
    """Per kernel of `case`: the Config and tiles the ops pick and the modelled memory."""
    if case.backend == FP8_BACKEND:
        from pallas_kernels import fp8_mosaic_gpu as f

        t = f.TILE
        return {
            kernel: dict(
                config=dict(
                    num_stages=f.STAGES,
                    raster=f.RASTER,
                    split=case.split or f.DEFAULT_SPLIT[kernel],
                    pipeline=case.pipeline or f.DEFAULT_PIPELINE[kernel],
                ),
                tiles=[t, t, t],
                backend=FP8_BACKEND,
                smem_model=f.smem_bytes(kernel, case.dtype),
            )  # fmt: skip
            for kernel in case.kernels()
        }
    backend = case.concrete_backend(platform)
    m, k, n, g = case.dims()
    # (M, K, N) of each kernel as the VJP calls it: gmm_t multiplies dout [M, N] by rhs^T,
    # tgmm contracts lhs [M, K] with dout [M, N] over the rows.
    problems = {"gmm": (m, k, n), "gather_gmm": (m, k, n), "gmm_t": (m, n, k), "tgmm": (m, k, n)}
    rows = {}
    for kernel in case.kernels():
        pm, pk_, pn = problems[kernel]
        cfg = config_lib.default_config(kernel, backend, case.dtype, pm, pk_, pn, g)
        if case.pipeline is not None:
            cfg = dataclasses.replace(cfg, pipeline=case.pipeline)
        tiles = config_lib.effective_tiles(cfg, pm, pk_, pn, kernel=kernel, backend=backend)
        row = dict(config=dataclasses.asdict(cfg), tiles=list(tiles), backend=backend)
        if backend == "pallas_mosaic_gpu":
            row["smem_model"] = config_lib.mosaic_gpu_smem_bytes(
                kernel, tiles, cfg, case.dtype, case.dtype
            )
        elif platform == "cuda":
            row["smem_model"] = config_lib.triton_smem_bytes(kernel, tiles, cfg, case.dtype)
        else:
            row["vmem_model"] = config_lib.mosaic_vmem_bytes(kernel, tiles, case.dtype, case.dtype)
        rows[kernel] = row
    return rows


def _program(case: Case):
    """(function, abstract args) of one case on a one-device mesh."""
    import pallas_kernels as pk

    m, k, n, g = case.dims()
    dtype = jnp.dtype(case.dtype)
    if case.kernel == "gather_gmm":
        tokens = m // 2

        def fn(x, w, sizes, index, weight):
            return pk.gather_grouped_matmul(x, w, sizes, index, weight, backend=case.backend)

        args = (
            jax.ShapeDtypeStruct((tokens, k), dtype),
            jax.ShapeDtypeStruct((g, k, n), dtype),
            jax.ShapeDtypeStruct((g,), jnp.int32),
            jax.ShapeDtypeStruct((m,), jnp.int32),
            jax.ShapeDtypeStruct((m,), jnp.float32),
        )
        return fn, args

    def fn(x, w, sizes):
        # The named shapes' balanced groups are multiples of the alignment moejax pads to.
        def op(a, b):
            if case.backend == FP8_BACKEND:
                from pallas_kernels import fp8_ops

                return fp8_ops.fp8_grouped_matmul(
                    a, b, sizes, backend="pallas_mosaic_gpu", group_alignment=pk.GROUP_ALIGNMENT,
                    split=case.split, pipeline=case.pipeline,
                )  # fmt: skip
            backend, configs = case.backend, None
            if case.pipeline is not None:  # Mosaic GPU's default tiles on that pipeline
                backend = "pallas_mosaic_gpu"
                configs = config_lib.vjp_configs(backend, dtype, m, k, n, g, pipeline=case.pipeline)
            return pk.grouped_matmul(
                a, b, sizes, backend=backend, group_alignment=pk.GROUP_ALIGNMENT, config=configs
            )

        out, vjp = jax.vjp(op, x, w)
        return out, *vjp(out)

    args = (
        jax.ShapeDtypeStruct((m, k), dtype),
        jax.ShapeDtypeStruct((g, k, n), dtype),
        jax.ShapeDtypeStruct((g,), jnp.int32),
    )
    return fn, args


def _compile_all(platform: str, cases: list[Case], generation: str) -> list[dict]:
    """Compile every case (in this process); stderr gets a marker line before each."""
    kw = {"generation": generation} if platform == "tpu" else {}
    mesh = targets.mesh_for(platform, (1,), ("x",), **kw)
    out = []
    for i, case in enumerate(cases):
        fn, args = _program(case)
        fn.__name__ = f"case{i}"
        args = targets.shapes_on(args, mesh)
        os.write(2, f"\n@@case {i}\n".encode())
        start = time.perf_counter()
        with targets.lowering(mesh):
            lowered = jax.jit(fn).lower(*args)
        text = lowered.compile().as_text()
        seconds = time.perf_counter() - start
        calls = {kernel: _custom_calls(text, kernel) for kernel in case.kernels()}
        vmem = {k: v for k, lines in calls.items() if lines and (v := _scoped_vmem(lines[0]))}
        found = {kernel: len(lines) for kernel, lines in calls.items()}
        out.append(
            dict(case=dataclasses.asdict(case), compile_s=seconds, in_program=found, vmem=vmem)
        )
    return out


def _custom_calls(hlo_text: str, kernel: str) -> list[str]:
    """Lines of the compiled program that call `kernel`."""
    return [
        line
        for line in hlo_text.splitlines()
        if any(c.name == kernel for c in introspect.compiled_kernel_calls(line))
    ]


def _scoped_vmem(line: str) -> int | None:
    """Scoped VMEM bytes a compiled Mosaic call reserves (its backend config; blocks plus
    Mosaic's own scratch), or None on other targets."""
    m = re.search(r'"used_scoped_memory_configs":\[\{[^]]*?"size":"(\d+)"', line)
    return int(m.group(1)) if m else None


_PTXAS_FN = re.compile(r"Function properties for (\w+)")
_MOSAIC_GPU_SUFFIX = "_mosaic_gpu_kernel"  # a Mosaic GPU kernel's PTX function name
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_THUNK = re.compile(
    r"\] (\w+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+) bytes"
)


def _parse_ptxas(stderr: str) -> dict[int, dict[str, dict]]:
    """Per case index, per function name: registers and spill stores/loads."""
    result: dict[int, dict[str, dict]] = {}
    case, fn = None, None
    for line in stderr.splitlines():
        if line.startswith("@@case "):
            case = int(line.split()[1])
            result[case] = {}
        elif case is not None:
            if m := _PTXAS_FN.search(line):
                fn = m.group(1).removesuffix(_MOSAIC_GPU_SUFFIX)
            elif (m := _PTXAS_SPILL.search(line)) and fn:
                result[case].setdefault(fn, {}).update(
                    spill_stores=int(m.group(1)), spill_loads=int(m.group(2))
                )
            elif (m := _PTXAS_REGS.search(line)) and fn:
                result[case].setdefault(fn, {})["registers"] = int(m.group(1))
    return result


def _parse_thunks(dump: pathlib.Path, index: int) -> dict[str, dict]:
    """Launch grid, threads and shared memory of each kernel of case `index`."""
    rows = {}
    # XLA writes "thunk_sequence_after_thunk_passes" when its thunk passes changed the
    # sequence, else only "thunk_sequence": read the last one written.
    paths = sorted(dump.glob(f"*jit_case{index}.thunk_sequence*.txt"))
    for path in paths[-1:]:
        for m in _THUNK.finditer(path.read_text()):
            grid = [int(v) for v in m.group(2).split(",")]
            threads = [int(v) for v in m.group(3).split(",")]
            rows[m.group(1)] = dict(grid=grid, threads=threads[0], smem=int(m.group(4)))
    return rows


def report(
    platform: str, cases: list[Case] | None = None, *, generation: str = "v5e", timeout=900
) -> list[dict]:
    """Compile `cases` (default `default_cases`) for "cuda" (H100) or "tpu" (`generation`) in
    a subprocess; one row per kernel: the case, kernel, Config, tiles, modelled memory, compile
    seconds of its program, how many times it is in the compiled program, and the measured
    registers, spills, grid, threads and shared memory (GPU) or scoped VMEM (TPU)."""
    if (why := targets.missing(platform)) is not None:
        raise RuntimeError(why)
    cases = cases or default_cases(platform)
    with tempfile.TemporaryDirectory() as tmp:
        dump = pathlib.Path(tmp)
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "TF_CPP_MIN_LOG_LEVEL": "0",
            "TF_CPP_VMODULE": "subprocess_compilation=3",
            "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
            **targets.LIBTPU_ENV,
        }
        cases_json = [dataclasses.asdict(c) for c in cases]
        payload = json.dumps(dict(platform=platform, generation=generation, cases=cases_json))
        proc = subprocess.run(
            [sys.executable, "-m", "pallas_kernels.resources", payload],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=pathlib.Path(__file__).resolve().parents[1],
        )
        if proc.returncode != 0:
            raise RuntimeError(f"deviceless compile failed:\n{proc.stderr[-4000:]}")
        compiled = json.loads(proc.stdout.strip().splitlines()[-1])
        ptxas = _parse_ptxas(proc.stderr) if platform == "cuda" else {}
        rows = []
        for i, (case, result) in enumerate(zip(cases, compiled, strict=True)):
            thunks = _parse_thunks(dump, i) if platform == "cuda" else {}
            for kernel, row in kernel_rows(case, platform).items():
                row.update(
                    case=dataclasses.asdict(case),
                    kernel=kernel,
                    platform=platform if platform == "cuda" else f"tpu {generation}",
                    compile_s=result["compile_s"],
                    in_program=result["in_program"][kernel],
                )
                if kernel in result["vmem"]:
                    row["vmem"] = result["vmem"][kernel]
                row.update(ptxas.get(i, {}).get(kernel, {}))
                row.update(thunks.get(kernel, {}))
                rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a BENCHMARKS.md table."""
    gpu = rows and rows[0]["platform"] == "cuda"
    head = (
        "| shape | proj | dtype | kernel | backend | tm, tk, tn / warps, stages | grid | regs | "
        "spill stores | smem (model) | compile s |"
        if gpu
        else "| shape | proj | dtype | kernel | tm, tk, tn | VMEM (model) | compile s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        c, cfg = r["case"], r["config"]
        tiles = ", ".join(map(str, r["tiles"]))
        prefix = f"| {c['shape']} | {c['projection']} | {c['dtype']} | {r['kernel']} |"
        if gpu and r["backend"] in ("pallas_mosaic_gpu", FP8_BACKEND):
            # 3 warpgroups (TMA producer + 2 wgmma consumers), one CTA per SM (132 on H100).
            lines.append(
                f"{prefix} {r['backend'].removeprefix('pallas_')} | {tiles} / 3 WG, "
                f"{cfg['num_stages']} | 132 (persistent) "
                f"| {r.get('registers', '?')} | {r.get('spill_stores', '?')} | "
                f"({r['smem_model']}) | {r['compile_s']:.1f} |"
            )
        elif gpu:
            grid = "x".join(map(str, r.get("grid", [])))
            lines.append(
                f"{prefix} triton | {tiles} / {cfg['num_warps']}, {cfg['num_stages']} | {grid} | "
                f"{r.get('registers', '?')} | {r.get('spill_stores', '?')} | "
                f"{r.get('smem', '?')} ({r['smem_model']}) | {r['compile_s']:.1f} |"
            )
        else:
            vmem = f"{r['vmem'] / 2**20:.2f}" if r.get("vmem") else "?"
            lines.append(
                f"{prefix} {tiles} | {vmem} ({r['vmem_model'] / 2**20:.2f}) MiB | "
                f"{r['compile_s']:.1f} |"
            )
    return "\n".join(lines)


def _main() -> None:
    payload = json.loads(sys.argv[1])
    cases = [Case(**c) for c in payload["cases"]]
    print(json.dumps(_compile_all(payload["platform"], cases, payload["generation"])))


if __name__ == "__main__":
    _main()
