"""Exposed all-to-all and modeled step time of the LM train step on a deviceless H100 mesh.

Compiles the train step for 8 (or 64) H100s on this CPU host (`moejax.aot`, needs the CUDA
plugin wheels: `python -m pallas_kernels.targets --install`) for every combination asked of
batch split, dispatcher, pipeline chunks and stagger, and replays each compiled schedule on the
H100 model of `moejax.aot.schedule`: compute, all-to-all time, the part of it left exposed,
the exposed time of every collective (FSDP gathers and reductions too), and the estimated
step (all-to-all: plain and ragged together; the dropless dispatcher's
leftover rounds, a data-dependent loop, replayed zero times: the steady state, where the bucket
covers the load), and how many of the weight-gradient GEMMs (experts' and attention's,
`moejax.aot.windows.weight_gradient_kernels`) sit inside an all-to-all window. Prints one
Markdown row per program (the BENCHMARKS.md table).

    python experiments/bench_overlap.py --preset tiny --batch 256 \\
        --batch-split 1 2 4 --dispatcher capacity dropless --chunks 1 2

Each row is one deviceless compile of the train step (its seconds in the last column).
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import sys
import time

# Deviceless: compiled for H100 from the CPU backend, whatever JAX_PLATFORMS says (with the CUDA
# plugin installed and no GPU, jax fails to start it: "Unable to load cuDNN", then "topology not
# implemented for cuda").
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from moejax import aot, parallel, training
from moejax.aot import schedule, windows
from moejax.models import presets
from moejax.training import presets as train_presets
from pallas_kernels import targets


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    p.add_argument(
        "--mesh",
        default="expert=8",
        help="named axes of the H100 mesh, e.g. fsdp=8,expert=8 (default expert=8)",
    )
    p.add_argument(
        "--train-preset",
        default=None,
        help="training preset whose remat, scan and micro-batches to use (default: none of them)",
    )
    p.add_argument("--batch", type=int, default=256, help="global batch, sequences (default 256)")
    p.add_argument("--batch-split", type=int, nargs="+", default=[1, 2], help="default: 1 2")
    p.add_argument(
        "--dispatcher", nargs="+", default=["dropless"], help="capacity, dropless, allgather"
    )
    p.add_argument("--chunks", type=int, nargs="+", default=[1], help="default: 1")
    p.add_argument("--stagger", action="store_true", help="stagger the chunks")
    p.add_argument(
        "--delay-wgrad",
        choices=("auto", "on", "off"),
        default="auto",
        help="delayed attention weight gradients (default auto: as lm_forward's delay_wgrad)",
    )
    return p.parse_args(argv)


def row(model, args, k, dispatcher, chunks) -> str:
    if dispatcher == "capacity":
        model = model.replace(moe=model.moe.replace(drop_policy="capacity"))
    if args.train_preset:
        train_cfg = train_presets.get(args.train_preset).replace(batch_size=args.batch)
    else:
        train_cfg = training.TrainConfig(batch_size=args.batch, steps=10, warmup_steps=1)
    train_cfg = train_cfg.replace(delay_wgrad={"on": True, "off": False}.get(args.delay_wgrad))
    axes = dict(part.split("=") for part in args.mesh.split(","))
    mesh = aot.mesh("cuda", tuple(int(v) for v in axes.values()), tuple(axes))
    strategy = parallel.Strategy(
        dispatcher=dispatcher, chunks=chunks, stagger=args.stagger and chunks > 1
    )
    fn, fargs = aot.train_step_program(model, train_cfg, mesh, strategy=strategy, batch_split=k)
    start = time.perf_counter()
    compiled = aot.compile_program(fn, fargs, donate_argnums=(0,))
    # Data-dependent loops are the dropless leftover rounds: none in the steady state.
    est = schedule.estimate(compiled.text, default_trip_count=0)
    kinds = ("all-to-all", "ragged-all-to-all")  # the dropless rows go ragged on GPU
    a2a = sum(est.comm(kind) for kind in kinds)
    exposed = sum(est.exposed(kind) for kind in kinds)
    share = exposed / a2a if a2a else 0.0
    shards = parallel.mesh.token_shards(mesh)
    rows = args.batch * model.max_seq_len // shards // k // train_cfg.microbatches
    kinds = ("all-to-all", "ragged-all-to-all")
    wgrad = {c: windows.weight_gradient_kernels(compiled.text, rows, c) for c in kinds}
    inside = {kind: 0 for kind in ("experts", "attention")}
    totals = dict(inside)
    for kind, _, _ in wgrad["all-to-all"]:
        totals[kind] += 1
    for found in zip(*wgrad.values(), strict=True):
        inside[found[0][0]] += any(i for _, _, i in found)
    return (
        f"| {args.preset} | {args.mesh} | {args.batch} | {k} | {dispatcher} | {chunks}"
        f"{' staggered' if strategy.stagger else ''} | {est.compute_s * 1e3:.3f} "
        f"| {a2a * 1e3:.3f} | {exposed * 1e3:.3f} ({share:.0%}) | {est.exposed_s * 1e3:.3f} "
        f"| {est.step_s * 1e3:.3f} "
        f"| {inside['experts']}/{totals['experts']} | {inside['attention']}/{totals['attention']} "
        f"| {time.perf_counter() - start:.0f} |"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if (why := targets.missing("cuda")) is not None:
        print(f"error: cannot compile for H100: {why}", file=sys.stderr)
        return 2
    model = presets.get(args.preset)
    print(
        "| preset | H100 mesh | batch | batch split | dispatcher | chunks | compute ms "
        "| all-to-all ms | exposed ms | all exposed ms | step ms | expert dW in windows "
        "| attention dW in windows | compile s |"
    )
    print("|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, dispatcher, chunks in itertools.product(args.batch_split, args.dispatcher, args.chunks):
        print(row(model, args, k, dispatcher, chunks), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
