"""Train an MoE language model (the README's main job).

Default: the `tiny` preset, byte-level, on Python's standard-library sources, on 8 simulated CPU
devices as a data x expert = 2 x 4 mesh; a progress bar while training, then plots, a summary
table and the paths of everything written under `--out` (default `runs/<preset>`):
`metrics.jsonl`, `tensorboard/`, `checkpoints/`, `routing_trace.npy`, `loss.png`,
`expert_load.png`, `tuning_events.jsonl`. The parallel strategy is chosen by timing train steps
within a budget (`--strategy auto`, `moejax.training.tuning`); the summary says which and why.
Rerunning with the same `--out` resumes from the newest intact checkpoint and says from which
step (checkpoints are checksummed; a corrupt one is reported in one line and skipped). A resume
with another model (--preset, --init-from), --batch-size, --seq-len or --seed is refused (they
decide which batches come next); other changed flags (--lr, --steps, ...) are applied from the
resumed step, listed in one line (`moejax.training.resume`). A run locks its --out
(`.moejax-run.lock`): a second run there exits 2 naming the first; the lock of a killed run is
taken over with a message. --out must be new, empty or a run directory.

  python experiments/train_lm.py                                   # tiny, 2x4 mesh
  python experiments/train_lm.py --preset small --steps 500 --mesh 2,4
  python experiments/train_lm.py --data my_text_dir --out runs/mine
  python experiments/train_lm.py --mesh fsdp=2,expert=2,model=2 --remat full --scan
  python experiments/train_lm.py --tune-budget inf             # time every candidate strategy
  python experiments/train_lm.py --strategy dropless,chunks=2,stagger,batch_split=2   # pinned
  python experiments/train_lm.py --init-from converted/olmoe --data my_text_dir  # HF weights
  # two processes x 4 simulated devices = one 8-device mesh:
  python experiments/train_lm.py --num-processes 2 --process-id 0 --coordinator 127.0.0.1:1234 &
  python experiments/train_lm.py --num-processes 2 --process-id 1 --coordinator 127.0.0.1:1234
  srun --ntasks 2 python experiments/train_lm.py       # SLURM, Cloud TPU, GKE: jax detects it

Several processes (jax.distributed: --coordinator, or a cluster jax detects, see --distributed)
first check that all were given the same run (versions, flags, data, configs; one line per
difference, exit 2, before anything compiles); SIGTERM to any one of them stops all after the
same step with one checkpoint; a process lost (killed, its host gone) makes the others exit 6
within --peer-timeout with one line naming it and the checkpoint to resume from
(docs/scaling.md#faults-and-how-to-resume).

`python -m moejax.cli.train_lm` is the same command (`experiments/train_lm.py` only calls `main`).

Exit codes: 0 done (or stopped by SIGTERM / Ctrl-C after saving a checkpoint); 2 an input error,
one line per mistake, before anything is written (processes given different runs, a bad flag
value, missing/empty corpus, unknown preset, a mesh that does not divide the batch, the experts,
the heads or the widths, an --out that is a file or not writable, in use by another run or
holding files moejax did not write, a foreign checkpoint directory or one with symlinked steps,
no intact checkpoint, a resume with another model, batch or seed, a checkpoint or --init-from
model failing its checksums or holding NaN/Inf without --allow-nonfinite); 3 the run failed
(more than --max-skipped-fraction of its steps skipped as non-finite); 6 another process of the
run was lost (jax.distributed); 130 a Ctrl-C outside a training step (a second one aborts the
save).
"""

from __future__ import annotations

import argparse
import os
import sys

from moejax.cli._parser import OneLineParser
from moejax.cli.train_inputs import FLAG_OF, SWITCHES, setup
from pallas_kernels.targets import use_cpu_unless_accelerator


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows every default: `(default: X)` where the help does not say it already."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.nargs == 0:  # store_true flags
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def _version(text: str) -> tuple[int, ...]:
    """(0, 12, 0) from '0.12.0.1' or '0.12.0.dev1'."""
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if not piece.isdigit() else piece
        parts.append(int(digits or 0))
    return tuple(parts)


def build_parser() -> argparse.ArgumentParser:
    """The flags; `--help` shows every default."""
    p = OneLineParser(description=__doc__, formatter_class=_HelpFormatter)
    preset = "the preset's"
    p.add_argument(
        "--preset",
        default="tiny",
        help="model preset: micro, tiny, small, ... (small and larger take hours on a CPU)",
    )
    p.add_argument("--out", help="run directory (default: runs/<preset>)")
    p.add_argument("--steps", type=int, help=f"training steps (default: {preset})")
    p.add_argument(
        "--stop-at",
        type=int,
        help="stop after this step, a step in 1..--steps; the schedule spans --steps (default: "
        "--steps)",
    )
    p.add_argument("--batch-size", type=int, help=f"global batch in sequences (default: {preset})")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default: {preset})")
    p.add_argument("--seed", type=int, help=f"init and shuffling seed (default: {preset})")
    p.add_argument("--bf16", action="store_true", help="bf16 compute (fp32 parameters)")
    p.add_argument(
        "--bf16-moments",
        action="store_true",
        help="store Adam's two moments in bfloat16 (TrainConfig.moment_dtype; DeepSeek-V3's "
        "recipe): 8 bytes of state per fp32 parameter instead of 12",
    )
    p.add_argument(
        "--expert-precision",
        choices=("bf16", "fp8"),
        help="routed experts' matmuls: fp8 = DeepSeek-V3 block-scaled e4m3, emulated where no "
        "fp8 kernel runs (MoEConfig.expert_precision; default: the model's)",
    )
    p.add_argument(
        "--fp8-grad-format",
        choices=("e4m3", "e5m2"),
        help="fp8 format of the expert output gradients (default: the model's, e4m3)",
    )
    p.add_argument(
        "--mesh",
        help="mesh: sizes (2,4 = data,expert by rank; see --mesh-axes) or named axes, e.g. "
        "fsdp=2,expert=4 or data=2,fsdp=2,expert=2 (axes: data, fsdp, expert, model) "
        "(default: 2,4; data=8 for a dense preset, whose one expert does not split: micro_dense)",
    )
    p.add_argument(
        "--mesh-axes",
        help="axis names for a sizes-only --mesh, e.g. fsdp,expert (default: by rank)",
    )
    p.add_argument(
        "--remat",
        choices=("none", "dots_saveable", "full"),
        help=f"rematerialise each block in the backward (default: {preset})",
    )
    p.add_argument("--scan", action="store_true", help="scan the layers (compile once per unit)")
    p.add_argument(
        "--delay-wgrad",
        choices=("auto", "on", "off"),
        default="auto",
        help="attention weight gradients inside the previous MoE layer's backward all-to-all "
        "(default auto: on where the mesh has an expert axis, without --scan)",
    )
    p.add_argument(
        "--microbatches", type=int, help=f"gradient-accumulation micro-batches (default: {preset})"
    )
    p.add_argument(
        "--strategy",
        default="auto",
        help="auto: chosen by timing train steps (moejax.training.tuning: at the start and when "
        "the routing load moves the dropless bucket, within --tune-budget); default: the "
        "layer's default for the whole run; or pinned, e.g. data, allgather, "
        "dropless,chunks=2,stagger,batch_split=2 (default: auto)",
    )
    p.add_argument(
        "--tune-budget",
        type=float,
        default=0.1,
        help="with --strategy auto: fraction of the projected run time tuning may cost "
        "(compiles, slower candidates' steps); inf: no limit, 0: keep the default",
    )
    p.add_argument(
        "--tune-candidates",
        help="with --strategy auto: ';'-separated candidates in priority order (default: the "
        "default dispatcher, data, allgather on CPU; on GPU/TPU also the default with "
        "chunks=2,stagger and with batch_split=2)",
    )
    p.add_argument("--tune-steps", type=int, default=3, help="timed steps per candidate")
    p.add_argument(
        "--dispatcher",
        default="auto",
        help="pin the dispatcher (dropless, allgather, capacity): --strategy <dispatcher>",
    )
    p.add_argument(
        "--implementation",
        default="auto",
        help="grouped matmul: one of moejax.IMPLEMENTATIONS (auto, blocked, ...)",
    )
    p.add_argument(
        "--data",
        nargs="+",
        help="text files/dirs or .npy token files (default: Python's standard-library sources)",
    )
    p.add_argument(
        "--max-bytes",
        type=int,
        help="cap on corpus tokens, >= 1 (default: all of --data; 2 MiB of the default corpus)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        help=f"steps between checkpoints, 0: only at the end and on a signal (default: {preset})",
    )
    p.add_argument("--keep", type=int, help=f"checkpoints to keep, >= 1 (default: {preset})")
    p.add_argument(
        "--eval-batches",
        type=int,
        help=f"held-out batches evaluated at the end (default: {preset})",
    )
    p.add_argument(
        "--max-skipped-fraction",
        type=float,
        help="fail (exit 3) when more than this fraction of the steps are skipped as non-finite, "
        "in [0, 1] (default: 0.1)",
    )
    p.add_argument(
        "--placement",
        action="store_true",
        help="dynamic expert placement: a host controller re-places and replicates hot experts "
        "when routing drifts (events in placement_events.jsonl, marked in loss.png)",
    )
    p.add_argument(
        "--expert-slots",
        type=int,
        help="expert slots per device of the expert axis, >= 1 (default: none without "
        "--placement, E/N + max(1, E/N // 2) with it)",
    )
    p.add_argument(
        "--placement-hardware",
        default="auto",
        choices=("auto", "measured", "h100-nvlink", "h100-ib", "tpu-v5p-ici"),
        help="hardware figures the placement controller's cost model decides with (and prices "
        "migrations at): 'measured' on this mesh at start (a matmul and an all-to-all), or "
        "datasheet figures; 'auto': measured on CPU, the platform's datasheet figures on GPU "
        "(h100-nvlink) and TPU (tpu-v5p-ici); the summary names the figures used",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-outputs", action="store_true", help="skip plots and summary")
    p.add_argument(
        "--coordinator", help="jax.distributed coordinator address host:port (default: none)"
    )
    p.add_argument("--num-processes", type=int, default=1, help="processes in the run")
    p.add_argument("--process-id", type=int, default=0, help="this process, 0..--num-processes-1")
    p.add_argument(
        "--distributed",
        choices=("auto", "on", "off"),
        default="auto",
        help="jax.distributed: 'auto' initialises it with --coordinator/--num-processes/"
        "--process-id when --coordinator is given, else with no arguments (jax detects the "
        "cluster) when the environment is a multi-process SLURM step, Open MPI job, Cloud TPU "
        "pod slice (TPU_WORKER_HOSTNAMES, MEGASCALE_*) or Kubernetes indexed job, else not at "
        "all (one process); 'on': always (jax detects what the flags do not give); 'off': never",
    )
    p.add_argument(
        "--peer-timeout",
        type=int,
        default=30,
        help="under jax.distributed: seconds without a heartbeat after which a process counts "
        "as gone; every other process then exits (code 6) naming it and the checkpoint to "
        "resume from",
    )
    p.add_argument(
        "--jax-cache",
        help="persistent XLA compilation cache dir, or 'none' (default: $JAX_COMPILATION_CACHE_DIR "
        "if set, else <out>/jax_cache for single-process runs; none on CPU with jax >= 0.12, "
        "whose cache served multi-device CPU programs with mismatched collectives)",
    )
    p.add_argument(
        "--init-from",
        help="start from a converted Hugging Face model (experiments/convert_hf.py to-orbax): "
        "its architecture replaces the preset's model, the preset gives the training settings",
    )
    p.add_argument(
        "--upcycle-from",
        help="start from a dense model: a moejax training run directory or its checkpoints/<n> "
        "(dense MLP or one-expert layers, moejax.models.dense_lm_config), or a Hugging Face "
        "Llama, Qwen2 or Qwen3 checkpoint directory (config.json and safetensors; every layer "
        "becomes MoE): its MLPs are copied "
        "into the experts (moejax.models.upcycle); the preset's MoE layer gives the routing "
        "and experts (d_ff: the dense width / --upcycle-granularity; no shared experts), its "
        "training settings the rest",
    )
    p.add_argument(
        "--upcycle-granularity", type=int, default=1, help="split each dense MLP this many ways"
    )
    p.add_argument(
        "--upcycle-noise", type=float, default=0.0, help="relative noise on the expert weights"
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="start or resume from weights holding NaN/Inf (--init-from, checkpoints)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def controller_of(args, model_cfg, train_cfg, mesh):
    if not args.placement:
        return None
    from moejax import placement
    from moejax.training import placed

    seq_len = train_cfg.seq_len or model_cfg.max_seq_len
    named = {"h100-nvlink": placement.H100_NVLINK, "h100-ib": placement.H100_IB}
    named["tpu-v5p-ici"] = placement.TPU_V5P_ICI
    hardware = named.get(args.placement_hardware, args.placement_hardware)
    return placed.controller_factory(model_cfg, train_cfg, mesh, seq_len, hardware=hardware)


def run(args, model_cfg, train_cfg, mesh, strategy, corpus) -> int:
    import jax

    from moejax.training import loop, report

    run_dir = args.out or os.path.join("runs", args.preset)
    # Default cache only for single-process runs: processes sharing one cache directory were
    # seen to hang at shutdown in the 2-process test, so multi-process runs opt in explicitly.
    default_cache = args.num_processes == 1 and not jax.config.jax_compilation_cache_dir
    # jaxlib 0.12.0.1 was seen to load multi-device CPU programs back from the cache with their
    # collectives mismatched (NaN rows, or a rendezvous hang; 0 of 90 on 0.10.2): on CPU with
    # jax >= 0.12 the cache is used only when asked for (--jax-cache DIR).
    if jax.default_backend() == "cpu" and _version(jax.__version__) >= (0, 12):
        default_cache = False
    cache = None
    if args.jax_cache != "none" and (args.jax_cache or default_cache):
        cache = args.jax_cache or os.path.join(run_dir, "jax_cache")
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(cache))
    primary = jax.process_index() == 0
    if primary:
        print(
            f"moejax: training preset {args.preset!r} on {corpus.name}; mesh "
            f"{dict(mesh.shape)} over {jax.device_count()} {jax.default_backend()} devices "
            f"({jax.process_count()} process(es)); run dir {run_dir}",
            flush=True,
        )
    result = loop.train(
        model_cfg,
        train_cfg,
        corpus,
        run_dir=run_dir,
        mesh=mesh,
        strategy=strategy,
        implementation=args.implementation,
        stop_at=args.stop_at,
        progress=not args.no_progress,
        outputs=not args.no_outputs,
        controller=controller_of(args, model_cfg, train_cfg, mesh),
        init_params=init_params_of(args, model_cfg),
        allow_nonfinite=args.allow_nonfinite,
    )
    if primary and result.interrupted:
        print(
            f"stopped by {result.stop_signal}: checkpoint of step {result.step} saved; rerun "
            f"with the same --out to resume",
            flush=True,
        )
    if getattr(args, "upcycled", None) is not None:
        result.recipes = (
            f"upcycled from {args.upcycle_from} (granularity {args.upcycle_granularity}, "
            f"noise {args.upcycle_noise:g})",
            *result.recipes,
        )
    if primary and not args.no_outputs:
        print(report.summary_table(result))
        print(outputs_line(run_dir, args, result, cache))
    if args.num_processes > 1:
        jax.distributed.shutdown()
    if result.failure:
        if primary:
            print(f"error: run failed: {result.failure}", file=sys.stderr, flush=True)
        return 3
    return 0


def outputs_line(run_dir, args, result, cache) -> str:
    """The `outputs:` line: every file and directory the run wrote under `run_dir`."""
    names = ["metrics.jsonl", "tensorboard/", "checkpoints/", "routing_trace.npy", "loss.png"]
    names.append("expert_load.png")
    if args.placement:
        names += ["placement_events.jsonl", "placement_decisions.jsonl"]
        names.append("placement_controller.json")
    if result.placement and result.placement["replacements"]:
        names.append("placement_forecast.png")
    if result.tuning and result.tuning["kind"] != "fixed":
        names.append("tuning_events.jsonl")
    names = [n for n in names if os.path.exists(os.path.join(run_dir, n))]
    line = f"outputs: {run_dir}/{{{', '.join(names)}}}"
    if cache is not None:
        inside = os.path.abspath(cache).startswith(os.path.abspath(run_dir) + os.sep)
        line += f"; compilation cache: {cache}" + (" (reused by reruns)" if inside else "")
    return line


def init_params_of(args, model_cfg):
    """`mesh -> params` of `--init-from` or `--upcycle-from` (None without them)."""
    if getattr(args, "upcycled", None) is not None:
        import jax

        from moejax.models import lm_partition_specs

        def place(mesh):
            if mesh is None:
                return args.upcycled
            shardings = jax.tree.map(
                lambda s: jax.sharding.NamedSharding(mesh, s), lm_partition_specs(model_cfg, mesh)
            )
            return jax.device_put(args.upcycled, shardings)

        return place
    if not args.init_from:
        return None
    from moejax.interop.hf import load_converted_params

    return lambda mesh: load_converted_params(
        args.init_from, model_cfg, mesh, allow_nonfinite=args.allow_nonfinite
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    use_cpu_unless_accelerator()  # no GPU/TPU here: no plugin tracebacks (pallas_kernels.targets)
    try:
        try:  # reads only flags, devices and the corpus: every ValueError is an input error
            inputs = setup(args)
        except ValueError as err:
            return _fail(err, args)
        from moejax.interop.hf import CheckpointError as HFCheckpointError
        from moejax.training import INPUT_ERRORS

        # Inside training only the library's input errors are one line; bugs keep tracebacks.
        # `--init-from`'s converted model is read inside `train`: its errors are input errors.
        input_errors = (*INPUT_ERRORS, HFCheckpointError)
        try:
            with _run_lock(args):  # around the outputs too
                return run(args, *inputs)
        except input_errors as err:
            return _fail(err, args)
        except Exception:
            if args.num_processes > 1:  # a collective that failed because a peer died?
                from moejax.cli import _distributed

                _distributed.await_peer_loss(args.peer_timeout)  # exits 6 if so
            raise
    except KeyboardInterrupt:  # before the training loop, or a second Ctrl-C inside it
        if args.debug:
            raise
        print(
            "interrupted (Ctrl-C) outside a training step: nothing more saved; rerun with the "
            "same --out to resume from the last checkpoint",
            file=sys.stderr,
        )
        return 130


def _run_lock(args):
    """The run directory's lock on process 0 (`moejax.training.rundir`): taken by `train` once
    its inputs are checked, held until the outputs here are written."""
    import contextlib

    import jax

    from moejax.training import rundir

    if jax.process_index():
        return contextlib.nullcontext()
    run_dir = args.out or os.path.join("runs", args.preset)
    return rundir.run_lock(run_dir, lazy=True)


_DISK_FAILED = []  # a disk error was reported (`script` then exits without the shutdown)


def _fail(err: ValueError, args) -> int:
    from moejax.cli._distributed import Disagree

    if args.debug:
        raise err
    from moejax._disk import OutputWriteError
    from moejax.training.checkpoint import CheckpointWriteError

    if isinstance(err, OutputWriteError | CheckpointWriteError):
        _DISK_FAILED.append(err)
    if isinstance(err, Disagree):  # one line per difference
        for line in err.lines:
            print(f"error: processes disagree: {line}", file=sys.stderr)
        return 2
    print(f"error: {_flag_prefix(err, args)}{err}{_hint(err)}", file=sys.stderr)
    return 2


def script() -> int:
    """`main()` as the command runs it: after a full disk (or a read-only output) reported in
    one line, the process ends without the interpreter's shutdown (`moejax._disk.exit_quietly`:
    the background writers would print tracebacks of the same error)."""
    code = main()
    if _DISK_FAILED:
        from moejax._disk import exit_quietly

        exit_quietly(code)
    return code


def _flag_prefix(err, args) -> str:
    """`--seed: ` for a resume refused over a flag's value, `--out: ` for a busy run dir."""
    from moejax.training import ResumeMismatch, RunDirError

    if isinstance(err, RunDirError):
        return "--out: "
    if not isinstance(err, ResumeMismatch):
        return ""
    if err.field.startswith("model."):
        return "--init-from: " if args.init_from else f"--preset={args.preset}: "
    flag = FLAG_OF.get(err.field)
    if flag is None:
        return ""
    return f"{flag}: " if flag in SWITCHES else f"{flag}={err.current}: "


def _hint(err) -> str:
    from moejax.interop.hf import NonFiniteError
    from moejax.training.checkpoint import NonFiniteState

    nonfinite = isinstance(err, NonFiniteError | NonFiniteState)
    return "; pass --allow-nonfinite to accept it" if nonfinite else ""


if __name__ == "__main__":
    sys.exit(script())
