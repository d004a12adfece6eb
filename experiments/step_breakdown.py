"""Where a train step's time goes on one H100, by kernel class, bf16 vs fp8 expert matmuls: the
step compiled on this CPU machine for a deviceless H100 and replayed on the schedule model
(`moejax.aot.schedule`, roofline plus launch per kernel), no GPU needed.

It answers how much fp8 experts can buy before anything is measured: the expert matmuls' share
of the bf16 step bounds the speedup (Amdahl). `ceiling` is the bf16 step over the step with
those matmuls at the fp8 rate (2x bf16 on Hopper) and the quantization free; `fp8 / bf16` is
the model's ratio for the compiled fp8 step (quantization, transposes and all).

Run: python -m pallas_kernels.targets --install      (once: the compilers)
     python experiments/step_breakdown.py            (gpu_check's ~1B OLMoE-shaped step,
                                                       8 x 2048 tokens: ~4 min on 2 cores)
     python experiments/step_breakdown.py --model mixtral_8x7b --layers 2 --batch 4 --seq 4096
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from moejax.aot import hlo, programs, schedule
from moejax.models import presets
from moejax.training import TrainConfig
from pallas_kernels import introspect, targets

EXPERT_KERNELS = frozenset({"gmm", "gmm_t", "tgmm", "gather_gmm", "fp8_gmm", "fp8_tgmm"})
CLASSES = ("expert matmuls", "rest of the MoE layer", "attention", "everything else")


def classify(line: str) -> str:
    """The class (`CLASSES`) of a compiled instruction's line."""
    if any(c.name in EXPERT_KERNELS for c in introspect.compiled_kernel_calls(line)):
        return "expert matmuls"
    scope = hlo.op_name(line)
    if "attention" in scope:
        return "attention"
    return "rest of the MoE layer" if "/moe" in scope or scope.startswith("moe") else (
        "everything else"
    )  # fmt: skip


def _flat(ops, hardware):
    """COMPUTE ops as the step runs them: loop bodies times their trip count (0 if XLA cannot
    prove it: the dropless dispatcher's leftover rounds, which the steady state does not run),
    the longest branch of a conditional (as the schedule model replays it)."""
    for op in ops:
        if op.kind == schedule.LOOP:
            for _ in range(op.trip_count or 0):
                yield from _flat(op.body, hardware)
        elif op.kind == schedule.BRANCH:
            costs = [sum(schedule.op_seconds(o, hardware) for o in _flat(b, hardware))
                     for b in op.branches]  # fmt: skip
            yield from _flat(op.branches[costs.index(max(costs))], hardware)
        elif op.kind == schedule.COMPUTE:
            yield op


def instruction_lines(text: str) -> dict[str, str]:
    """Every instruction's line of a compiled program, by name (all computations)."""
    comps, _, _ = hlo.computations(text)
    return {i.name: i.line for body in comps.values() for i in hlo.parsed(body)}


def modelled_ops(text: str, hardware) -> dict[str, tuple[float, float]]:
    """`{instruction: (seconds, bytes)}` of one step on the schedule model, repeats summed."""
    out: dict[str, tuple[float, float]] = {}
    for op in _flat(schedule.parse(text), hardware):
        seconds, nbytes = out.get(op.name, (0.0, 0.0))
        out[op.name] = (seconds + schedule.op_seconds(op, hardware), nbytes + op.bytes)
    return out


def breakdown(text: str, hardware=schedule.H100_SXM, top: int = 0):
    """`(seconds, costliest)`: modelled seconds per class of `CLASSES` (and "step": the
    replayed step) of a compiled train step, and its `top` costliest kernels as
    `(seconds, GB moved, class, scope)`, repeats of one instruction summed."""
    lines = instruction_lines(text)
    out = dict.fromkeys(CLASSES, 0.0)
    rows = []
    for name, (seconds, nbytes) in modelled_ops(text, hardware).items():
        line = lines.get(name, "")
        out[classify(line)] += seconds
        rows.append((seconds, nbytes / 1e9, classify(line), hlo.op_name(line)))
    out["step"] = schedule.estimate(text, hardware, default_trip_count=0).step_s
    return out, sorted(rows, key=lambda r: -r[0])[:top]


def model_config(name: str, layers: int | None, seq: int):
    if name == "olmoe_2l":
        from gpu_check import olmoe_hf_config

        from moejax.interop.hf import lm_config_from_hf

        cfg, _ = lm_config_from_hf(olmoe_hf_config(False))
    else:
        cfg = presets.get(name)
    cfg = cfg.replace(dtype="bfloat16", max_seq_len=seq)
    if layers:
        kinds = cfg.mlp_layer_types[:layers] if cfg.mlp_layer_types else None
        cfg = cfg.replace(num_layers=layers, mlp_layer_types=kinds)
    return cfg


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="olmoe_2l",
                        help="olmoe_2l (gpu_check's step) or a preset name")  # fmt: skip
    parser.add_argument("--layers", type=int, default=None, help="cut the preset to this depth")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--top", type=int, default=0, help="list the fp8 step's costliest kernels")
    args = parser.parse_args(argv)
    if (why := targets.missing("cuda")) is not None:
        print(f"error: cannot compile for H100: {why}", file=sys.stderr)
        return 2
    # Deviceless: compiled for H100 from the CPU backend, whatever JAX_PLATFORMS says.
    jax.config.update("jax_platforms", "cpu")
    base = model_config(args.model, args.layers, args.seq)
    train_cfg = TrainConfig(steps=100, batch_size=args.batch, seq_len=args.seq, warmup_steps=1)
    mesh = programs.mesh("cuda", (1,), ("data",))
    rows, costliest = {}, []
    for precision in ("bf16", "fp8"):
        cfg = base.replace(moe=base.moe.replace(expert_precision=precision))
        print(f"compiling the {precision} step for one H100 ...", file=sys.stderr, flush=True)
        fn, fn_args = programs.train_step_program(cfg, train_cfg, mesh)
        text = programs.compile_program(fn, fn_args, donate_argnums=(0,)).text
        rows[precision], costliest = breakdown(text, top=args.top)
    bf16, fp8 = rows["bf16"], rows["fp8"]
    print(f"\n{args.model}, {args.batch} x {args.seq} tokens, one H100 (schedule model, ms)\n")
    print("| kernels | bf16 experts | fp8 experts |\n|---|---|---|")
    for key in (*CLASSES, "step"):
        print(f"| {key} | {bf16[key] * 1e3:.1f} | {fp8[key] * 1e3:.1f} |")
    share = bf16["expert matmuls"] / bf16["step"]
    ceiling = bf16["step"] / (bf16["step"] - bf16["expert matmuls"] / 2)
    print(f"\nexpert matmuls: {share:.0%} of the bf16 step; ceiling (fp8 matmuls at 2x, "
          f"quantization free): {ceiling:.2f}x; modelled fp8 / bf16: "
          f"{bf16['step'] / fp8['step']:.2f}x")  # fmt: skip
    if costliest:
        print("\nthe fp8 step's costliest kernels: ms, GB moved, class, jax scope")
        for seconds, gb, kind, scope in costliest:
            print(f"{seconds * 1e3:7.2f} {gb:7.2f}  {kind:22s} {scope[-110:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
