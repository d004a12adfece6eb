"""What `moejax.cli.train_lm` reads before it trains: the flags checked one by one, the model and
train configs from the preset and the flags, the mesh (simulated CPU devices set up before jax's
backends start), the strategy, the corpus, and the weights of `--upcycle-from`.

Every mistake raises `InputError` (a ValueError) naming the flag; `setup` reads only the flags,
the devices and the files named, and writes nothing.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import sys

from moejax.cli._errors import InputError as InputError


def check_flags(args) -> None:
    """The checks of single flags that need no jax: raises InputError naming the flag."""
    if args.stop_at is not None and args.stop_at < 1:
        raise InputError(
            f"--stop-at={args.stop_at}: must be a step >= 1 (omit it to train all of --steps)"
        )
    if args.max_bytes is not None and args.max_bytes < 1:
        raise InputError(
            f"--max-bytes={args.max_bytes}: must be >= 1 (omit it for the default corpus size)"
        )
    if args.expert_slots is not None and args.expert_slots < 1:
        raise InputError(
            f"--expert-slots={args.expert_slots}: must be >= 1 (omit it: no placement without "
            "--placement, the default slots with it)"
        )
    if args.num_processes < 1:
        raise InputError(f"--num-processes={args.num_processes}: must be >= 1")
    if getattr(args, "peer_timeout", 1) < 1:
        raise InputError(f"--peer-timeout={args.peer_timeout}: must be >= 1 (seconds)")
    if not 0 <= args.process_id < args.num_processes:
        raise InputError(
            f"--process-id={args.process_id}: must lie in 0..{args.num_processes - 1} "
            f"(--num-processes={args.num_processes})"
        )
    if args.jax_cache not in (None, "none") and os.path.isfile(args.jax_cache):
        raise InputError(f"--jax-cache={args.jax_cache}: is a file, need a directory or 'none'")
    check_out(args.out or os.path.join("runs", args.preset))


def check_out(path: str) -> None:
    """`--out` must be a directory, or creatable, and writable (checked without writing)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise InputError(f"--out={path}: exists and is not a directory; need a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError(f"--out={path}: {existing} is not a directory")
    if not _writable(existing):
        what = (
            "is"
            if existing == os.path.abspath(path)
            else f"would be created in {existing}, which is"
        )
        raise InputError(f"--out={path}: {what} not writable; need a writable directory")


def _writable(directory: str) -> bool:
    """Whether a file can be created in `directory`: an unnamed O_TMPFILE file where Linux
    offers one (true even for root, and nothing ever appears), else `os.access`."""
    if os.statvfs(directory).f_flag & os.ST_RDONLY:  # a read-only mount: even root cannot
        return False
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None:
        return os.access(directory, os.W_OK | os.X_OK)
    try:
        os.close(os.open(directory, flag | os.O_WRONLY, 0o600))
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):  # no O_TMPFILE here
            return os.access(directory, os.W_OK | os.X_OK)
        return False
    return True


def mesh_spec(text: str, axes: str | None) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """(shape, axis names or None for the default by rank) of `--mesh` (and `--mesh-axes`)."""
    parts = [p.strip() for p in text.split(",")]
    named = all("=" in p for p in parts)
    if named and axes:
        raise InputError(f"--mesh={text!r} names its axes: drop --mesh-axes")
    try:
        if named:
            names = tuple(p.split("=", 1)[0].strip() for p in parts)
            shape = tuple(int(p.split("=", 1)[1]) for p in parts)
        else:
            names = tuple(a.strip() for a in axes.split(",")) if axes else None
            shape = tuple(int(p) for p in parts)
    except ValueError:
        raise InputError(
            f"--mesh={text!r}: need comma-separated ints (2,4) or axis=size pairs (fsdp=2,expert=4)"
        ) from None
    if not shape or min(shape) < 1:
        raise InputError(f"--mesh={text!r}: need positive sizes")
    return shape, names


DEFAULT_MESH, DENSE_MESH = "2,4", "data=8"  # data x expert; all data for one-expert layers


def default_mesh(args) -> str:
    """`--mesh` when not given: 2,4 (data x expert), or data=8 for a dense preset (one expert
    per layer, as `micro_dense`), whose expert cannot be split over an expert axis."""
    from moejax.models import presets

    model = presets.PRESETS.get(args.preset)
    dense = model is not None and model.moe.num_experts == 1
    return DENSE_MESH if dense and not (args.init_from or args.upcycle_from) else DEFAULT_MESH


def mesh_text(args) -> str:
    """`--mesh` (with `--mesh-axes`) as one string, the same however it was written: `2,4`
    (axes by rank) or `fsdp=2,expert=4`; as given when it does not parse."""
    try:
        shape, axes = mesh_spec(args.mesh, args.mesh_axes)
    except InputError:
        return args.mesh
    named = axes and [f"{a}={n}" for a, n in zip(axes, shape, strict=True)]
    return ",".join(named or map(str, shape))


def config_record(model_cfg, train_cfg) -> dict:
    """The model and train configs a process derived, by the flag (or field) that sets each:
    what processes of one run compare once their flags agree (`moejax.cli._distributed`)."""
    from moejax.records import flatten, record_to_json

    record = {f"the model's {k}": v for k, v in flatten(record_to_json(model_cfg)).items()}
    for field in dataclasses.fields(train_cfg):
        value = getattr(train_cfg, field.name)
        flag = FLAG_OF.get(field.name) or {"remat": "--remat", "scan_layers": "--scan"}.get(
            field.name, f"TrainConfig.{field.name}"
        )
        record[flag] = value if isinstance(value, str | int | float | bool | None) else repr(value)
    return record


def setup_devices(args) -> tuple[int, ...]:
    """Simulated CPU devices for this process's share of the mesh, set before jax's backends
    start (XLA reads `XLA_FLAGS` when it creates the CPU backend, not when jax is imported)."""
    if args.mesh is None:
        args.mesh = default_mesh(args)
    shape, _ = mesh_spec(args.mesh, args.mesh_axes)
    total = math.prod(shape)
    if total % args.num_processes:
        raise InputError(
            f"--mesh={args.mesh}: {total} devices do not split over {args.num_processes} processes"
        )
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        local = total // args.num_processes
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local}".strip()
    return shape


def configs(args):
    """Model and train configs from the preset and flags (config validation errors included)."""
    from moejax.models import presets
    from moejax.training import presets as train_presets

    model_cfg = presets.get(args.preset)
    if args.init_from:
        from moejax.interop.hf import read_converted

        model_cfg = read_converted(args.init_from)[0]
    if args.upcycle_from:
        if args.init_from:
            raise InputError("--upcycle-from: not with --init-from (both give the weights)")
        args.upcycled, model_cfg = upcycled(args, model_cfg)
    if args.bf16:
        model_cfg = model_cfg.replace(dtype="bfloat16")
    fp8 = {"expert_precision": args.expert_precision, "fp8_grad_format": args.fp8_grad_format}
    fp8 = {k: v for k, v in fp8.items() if v is not None}
    if fp8:
        model_cfg = model_cfg.replace(moe=model_cfg.moe.replace(**fp8))
    overrides = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "learning_rate": args.lr,
        "seed": args.seed,
        "checkpoint_every": args.checkpoint_every,
        "keep_checkpoints": args.keep,
        "eval_batches": args.eval_batches,
        "expert_slots_per_device": args.expert_slots,
        "remat": args.remat,
        "scan_layers": args.scan or None,
        "delay_wgrad": {"on": True, "off": False}.get(args.delay_wgrad),
        "microbatches": args.microbatches,
        "max_skipped_fraction": args.max_skipped_fraction,
        "moment_dtype": "bfloat16" if args.bf16_moments else None,
    }
    train_cfg = train_presets.get(args.preset)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "steps" in overrides and train_cfg.warmup_steps >= overrides["steps"]:
        overrides["warmup_steps"] = overrides["steps"] // 10
    try:
        train_cfg = train_cfg.replace(**overrides)
    except ValueError as err:  # "TrainConfig.<field>=...": name the flag that set it
        field = str(err).split("TrainConfig.", 1)[-1].split("=", 1)[0]
        flag = FLAG_OF.get(field)
        raise InputError(f"{flag}: {err}" if flag and field in overrides else str(err)) from None
    if args.stop_at is not None and args.stop_at > train_cfg.steps:
        raise InputError(
            f"--stop-at={args.stop_at}: beyond the schedule's {train_cfg.steps} steps (--steps); "
            f"need a step in 1..{train_cfg.steps}"
        )
    return model_cfg, train_cfg


SWITCHES = frozenset({"--bf16-moments"})  # flags of FLAG_OF that take no value
FLAG_OF = {  # TrainConfig field -> the flag that sets it
    "steps": "--steps",
    "batch_size": "--batch-size",
    "seq_len": "--seq-len",
    "learning_rate": "--lr",
    "seed": "--seed",
    "checkpoint_every": "--checkpoint-every",
    "keep_checkpoints": "--keep",
    "eval_batches": "--eval-batches",
    "expert_slots_per_device": "--expert-slots",
    "microbatches": "--microbatches",
    "max_skipped_fraction": "--max-skipped-fraction",
    "moment_dtype": "--bf16-moments",
}
# Estimated seconds per train step on CPU per GFLOP of the step: the tiny preset's README job on
# the 2-core development VM (see _cpu_warning).
_CPU_S_PER_GFLOP = 0.028


def cpu_warning(model_cfg, train_cfg, args) -> str | None:
    """A warning when the run would take over half an hour on this CPU (e.g. --preset small)."""
    from moejax.training import flops_per_token

    seq_len = train_cfg.seq_len or model_cfg.max_seq_len
    gflop = flops_per_token(model_cfg, seq_len) * train_cfg.batch_size * seq_len / 1e9
    steps = args.stop_at or train_cfg.steps
    hours = steps * gflop * _CPU_S_PER_GFLOP / 3600
    if hours < 0.5:
        return None
    return (
        f"warning: --preset {args.preset} on CPU: {steps} steps of {train_cfg.batch_size} x "
        f"{seq_len} tokens, about {gflop * _CPU_S_PER_GFLOP:.0f} s a step on a 2-core machine, "
        f"{hours:.0f} h in all (estimated from its FLOPs); try fewer --steps, or a GPU/TPU"
    )


def setup(args):
    """Everything that only reads the flags, the devices and the corpus (before training).

    Under jax.distributed (`moejax.cli._distributed`) every process first checks that all were
    given the same run, then that none refused its inputs, before anything compiles."""
    from moejax.cli import _distributed

    check_flags(args)
    decision = _distributed.decide(args)
    if decision.how is not None:
        _distributed.initialize(args, decision)
    several = decision.how is not None and args.num_processes > 1
    shape = setup_devices(args)
    import jax

    import moejax
    from moejax import data, parallel
    from moejax.training import checkpoint, loop

    if several:  # after initialize, which installs jax's preemption notifier over SIGTERM
        loop.record_early_sigterm()

    try:
        if args.implementation not in moejax.IMPLEMENTATIONS:
            raise InputError(
                f"--implementation={args.implementation!r}: must be one of "
                f"{', '.join(moejax.IMPLEMENTATIONS)}"
            )
        model_cfg, train_cfg = configs(args)
    except ValueError as err:
        if several:  # the flags that differ, if any, say more than this process's error
            _distributed.check_same_run(args, mesh=mesh_text(args), error=str(err))
        raise
    if several:
        record = config_record(model_cfg, train_cfg)
        _distributed.check_same_run(args, mesh=mesh_text(args), configs=record)
    try:
        out = _setup_rest(args, shape, model_cfg, train_cfg, jax, data, parallel, checkpoint)
    except ValueError as err:
        if several:
            _distributed.check_ready(str(err))
        raise
    if several:
        _distributed.check_ready(None)
    return out


def _setup_rest(args, shape, model_cfg, train_cfg, jax, data, parallel, checkpoint):
    """`setup` after the configs: the run directory, mesh, strategy and corpus."""
    from moejax.training import metrics

    run_dir = args.out or os.path.join("runs", args.preset)
    checkpoint.check_directory(os.path.join(run_dir, "checkpoints"))  # symlinks, foreign files
    metrics.read_records(os.path.join(run_dir, "metrics.jsonl"), on_torn=lambda _: None)
    if math.prod(shape) != jax.device_count():
        raise InputError(
            f"--mesh={args.mesh}: needs {math.prod(shape)} devices, "
            f"{jax.device_count()} are available"
        )
    _, axes = mesh_spec(args.mesh, args.mesh_axes)
    try:
        mesh = parallel.make_mesh(shape, axes)
    except ValueError as err:
        flag = f"--mesh-axes={args.mesh_axes}" if args.mesh_axes else f"--mesh={args.mesh}"
        raise InputError(f"{flag}: {err}") from None
    strategy = strategy_of(args, model_cfg, train_cfg, mesh)
    if args.data:
        try:
            corpus = data.load_corpus(
                args.data, vocab_size=model_cfg.vocab_size, max_bytes=args.max_bytes
            )
        except data.DataError as err:
            raise InputError(f"--data: {err}") from None
    else:
        corpus = data.default_corpus(args.max_bytes or data.DEFAULT_MAX_BYTES)
    if args.placement and not train_cfg.expert_slots_per_device:
        g = model_cfg.moe.num_experts // max(1, dict(mesh.shape).get("expert", 1))
        train_cfg = train_cfg.replace(expert_slots_per_device=g + max(1, g // 2))
    from moejax.training import check_setup

    check_setup(model_cfg, train_cfg, mesh)  # before the banner: one line per mistake
    if jax.default_backend() == "cpu" and jax.process_index() == 0:
        warning = cpu_warning(model_cfg, train_cfg, args)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    return model_cfg, train_cfg, mesh, strategy, corpus


def strategy_of(args, model_cfg, train_cfg, mesh):
    """What `train(strategy=)` gets from --strategy, --tune-* and --dispatcher."""
    from moejax.training import tuning

    if args.dispatcher != "auto":
        if args.strategy != "auto":
            raise InputError("--dispatcher pins a strategy, so does --strategy: give one")
        args.strategy = args.dispatcher
    if args.strategy == "default":
        return "auto"
    if args.strategy == "auto":
        candidates = args.tune_candidates and tuning.parse_candidates(args.tune_candidates)
        try:
            return tuning.TuningConfig(
                candidates=candidates or None, budget=args.tune_budget, repeats=args.tune_steps
            )
        except ValueError as err:  # "TuningConfig.<field>=...": name the flag that set it
            field = str(err).split("TuningConfig.", 1)[-1].split("=", 1)[0]
            flag = {"budget": "--tune-budget", "repeats": "--tune-steps"}.get(field)
            raise InputError(f"{flag}: {err}" if flag else str(err)) from None
    candidate = tuning.parse_candidate(args.strategy)
    problems = tuning.candidate_problems(candidate, model_cfg, train_cfg, mesh)
    if problems:
        raise InputError(f"--strategy={args.strategy}: {'; '.join(problems)}")
    return candidate


def checkpoint_step(path: str) -> str:
    """The newest finished step directory of a run directory (or `path`, a step directory)."""
    if not os.path.isdir(path):
        what = "not a directory" if os.path.exists(path) else "no such directory"
        raise InputError(f"--upcycle-from={path}: {what} (a dense run directory, or a Hugging "
                         "Face dense checkpoint directory)")  # fmt: skip
    for ckpts in (os.path.join(path, "checkpoints"), path):
        steps = [n for n in os.listdir(ckpts) if n.isdigit()] if os.path.isdir(ckpts) else []
        steps = [n for n in steps if os.path.isdir(os.path.join(ckpts, n, "state"))]
        if steps:
            return os.path.join(ckpts, max(steps, key=int))
    if os.path.isdir(os.path.join(path, "state")):
        return path
    raise InputError(f"--upcycle-from={path}: no moejax training checkpoint there")


def _hf_dense(args):
    """`(LMConfig, params)` of a Hugging Face dense checkpoint directory (`--upcycle-from`):
    Llama, Qwen2 or Qwen3, every layer dense."""
    from moejax.interop.hf import FAMILIES, load_hf_model

    try:
        cfg, params, hf_config = load_hf_model(
            args.upcycle_from, allow_nonfinite=args.allow_nonfinite
        )
    except ValueError as err:
        raise InputError(f"--upcycle-from={args.upcycle_from}: {err}") from None
    if cfg.moe_layers:
        dense = sorted(name for name, fam in FAMILIES.items() if fam.dense)
        raise InputError(
            f"--upcycle-from={args.upcycle_from}: model_type={hf_config.get('model_type')!r} "
            f"has MoE layers; upcycling starts from a dense model ({dense})"
        )
    return cfg, params


def upcycled(args, preset_cfg):
    """`(params on the host, model config)` of `--upcycle-from`: the dense run's newest
    checkpoint (verified) or a Hugging Face dense checkpoint directory, its MLPs copied into the
    experts of the preset's MoE layer (every layer's, for a Hugging Face model)."""
    from moejax.interop.hf import params_of_train_checkpoint
    from moejax.models import upcycle
    from moejax.training.checkpoint import CheckpointError, read_model_config

    if os.path.isfile(os.path.join(args.upcycle_from, "config.json")):
        dense_cfg, params = _hf_dense(args)
    else:
        step_dir = checkpoint_step(args.upcycle_from)
        try:
            dense_cfg = read_model_config(step_dir)
        except CheckpointError as err:
            raise InputError(f"--upcycle-from={err}") from None
        params = params_of_train_checkpoint(
            step_dir, dense_cfg, allow_nonfinite=args.allow_nonfinite
        )
    g = args.upcycle_granularity
    width = dense_cfg.moe.d_ff if dense_cfg.moe.num_experts == 1 else dense_cfg.mlp_d_ff
    if width % max(g, 1):
        raise InputError(f"--upcycle-granularity={g}: does not divide the dense width {width}")
    moe = preset_cfg.moe.replace(
        d_model=dense_cfg.d_model, d_ff=width // max(g, 1), num_shared_experts=0,
        shared_gate=False, shared_d_ff=None,
    )  # fmt: skip
    try:
        return upcycle(params, dense_cfg, moe, g, args.upcycle_noise, args.seed or 0)
    except ValueError as err:
        raise InputError(f"--upcycle-from: {err}") from None
