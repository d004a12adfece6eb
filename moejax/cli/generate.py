"""Sample text from a trained or converted model: does it still talk?

  python experiments/generate.py runs/tiny --prompt "def "             # a training run's newest
  python experiments/generate.py runs/tiny/checkpoints/300 --ids 1,2,3  # checkpoint, or one step
  python experiments/generate.py converted/olmoe --ids 1,2,3 --max-new-tokens 20  # convert_hf.py

`MODEL` is a training run directory (`train_lm.py --out`; its newest checkpoint), one checkpoint
step directory (`<run>/checkpoints/<step>`), or a directory written by `convert_hf.py to-orbax`.
The prompt is a string through the byte tokenizer (`--prompt`, printed back decoded) or token
ids (`--ids`, printed as ids, the prompt's first). Greedy by default (`--temperature 0`);
`--temperature` and `--top-p` sample (`--seed`). At most the model's `max_seq_len` positions:
a longer `--max-new-tokens` is cut there, with a notice. `moejax.models.generate` does the work
(a KV cache, two compiled programs per shape); `--mesh 2,4` runs it on a `data x expert` mesh of
simulated devices.

Exit codes: 0 done; 2 an input error, one line naming what to fix (a path that does not exist
or is not a model, a model failing its checksums, a prompt outside the vocabulary or as long as
the model's context, a bad flag value); `--debug` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys

from moejax.cli._parser import OneLineParser
from pallas_kernels.targets import use_cpu_unless_accelerator


class InputError(ValueError):
    """A mistake in the command line or its `MODEL`, reported in one line."""


def build_parser() -> OneLineParser:
    import argparse

    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", help="a training run dir, a checkpoint step dir, or a converted dir")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, through the byte tokenizer")
    prompt.add_argument("--ids", help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (sampling)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default=None, help="data,expert sizes, e.g. 2,4 (default: 1 device)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    return p


def _mesh_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise InputError(f"--mesh={text!r}: need comma-separated sizes, e.g. 2,4") from None
    if not 1 <= len(shape) <= 2 or min(shape) < 1:
        raise InputError(f"--mesh={text!r}: need one or two positive sizes (data,expert)")
    return shape


def _prompt(args) -> list[int]:
    from moejax import data

    if args.prompt is not None:
        if not args.prompt:
            raise InputError("--prompt: empty; give at least one character")
        return list(data.encode(args.prompt))
    try:
        ids = [int(i) for i in args.ids.split(",")]
    except ValueError:
        raise InputError(f"--ids={args.ids!r}: need comma-separated integer ids") from None
    return ids


def check_flags(args) -> None:
    """The flags that need no model (raises InputError naming the flag)."""
    import math

    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens={args.max_new_tokens}: need >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise InputError(f"--temperature={args.temperature}: need a finite number >= 0")
    if not 0 < args.top_p <= 1:
        raise InputError(f"--top-p={args.top_p}: need a mass in (0, 1]")
    if args.temperature == 0 and args.top_p != 1:
        raise InputError(
            f"--top-p={args.top_p} with --temperature 0: greedy decoding ignores it; "
            "give a --temperature > 0 to sample"
        )


def _train_checkpoint(step_dir: str):
    """`(LMConfig, params)` of a training checkpoint step directory (the model config is the
    one its metadata records)."""
    from moejax.interop.hf import params_of_train_checkpoint
    from moejax.training.checkpoint import read_model_config

    cfg = read_model_config(step_dir)
    return cfg, params_of_train_checkpoint(step_dir, cfg)


def load(path: str):
    """`(LMConfig, params)` from any of the three kinds of `MODEL` directory.

    Raises:
      InputError: `path` does not exist, is not a directory or a run without a checkpoint.
      moejax.interop.hf.CheckpointError / moejax.training.CheckpointError: not a model, or one
        failing its checksums (each names the file).
    """
    from moejax.interop.hf import load_converted_params, read_converted

    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise InputError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise InputError(f"{path}: not a directory (need a run, a checkpoint step or a converted "
                         "model directory)")  # fmt: skip
    if os.path.isdir(os.path.join(path, "checkpoints")):  # a run: its newest finished step
        steps = [int(s) for s in os.listdir(os.path.join(path, "checkpoints")) if s.isdigit()]
        if not steps:
            raise InputError(f"{path}: the run has no checkpoint yet")
        path = os.path.join(path, "checkpoints", str(max(steps)))
    if os.path.isdir(os.path.join(path, "meta")) and os.path.isdir(os.path.join(path, "state")):
        return _train_checkpoint(path)
    cfg = read_converted(path)[0]
    return cfg, load_converted_params(path, cfg)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    use_cpu_unless_accelerator()  # no GPU/TPU here: no plugin tracebacks (pallas_kernels.targets)
    from moejax.interop.hf import CheckpointError
    from moejax.training import CheckpointError as TrainCheckpointError

    try:
        return _run(args)
    except (InputError, CheckpointError, TrainCheckpointError, OSError) as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    check_flags(args)
    shape = _mesh_shape(args.mesh)
    if shape is not None:
        import math

        flags = os.environ.get("XLA_FLAGS", "")
        if "device_count" not in flags:
            n = math.prod(shape)
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"
    prompt_ids = _prompt(args)
    import numpy as np
    from tqdm import tqdm

    from moejax import data, models, parallel

    cfg, params = load(args.model)
    bad = [i for i in prompt_ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise InputError(
            f"prompt id {bad[0]}: outside the model's vocabulary [0, {cfg.vocab_size})"
        )
    room = cfg.max_seq_len - len(prompt_ids)
    if room < 1:
        raise InputError(
            f"the prompt is {len(prompt_ids)} tokens: the model reads at most max_seq_len="
            f"{cfg.max_seq_len}, leaving no room for a new token; shorten it"
        )
    new = args.max_new_tokens
    if new > room:
        print(
            f"moejax: --max-new-tokens={new}: {room} fit after the {len(prompt_ids)}-token "
            f"prompt in max_seq_len={cfg.max_seq_len}; generating {room}",
            file=sys.stderr,
        )
        new = room
    mesh = None
    if shape is not None:
        mesh = parallel.make_mesh(shape, ("data", "expert")[: len(shape)])
    bar = tqdm(total=new, unit="tok", disable=args.no_progress, file=sys.stderr)
    out = models.generate(
        params, cfg, np.asarray(prompt_ids, np.int32), new, temperature=args.temperature,
        top_p=args.top_p, seed=args.seed, mesh=mesh, on_token=lambda i, t: bar.update(1),
    )  # fmt: skip
    bar.close()
    if args.prompt is not None:
        print(data.decode(out))
    else:
        print(",".join(str(int(i)) for i in out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
