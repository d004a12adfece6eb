"""Convert a Hugging Face MoE decoder to an orbax checkpoint that training starts from, and back
(the command line of `moejax.interop.hf.convert_to_orbax` / `convert_to_hf`).

Families: Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE (`config.json` `model_type`). The directory holds
`config.json` and safetensors weights (one file, or shards with `model.safetensors.index.json`);
tensors are read one at a time, with a progress bar.

  # Hugging Face directory -> converted directory (orbax params + model.json + hf_config.json)
  python experiments/convert_hf.py to-orbax path/to/OLMoE-1B-7B converted/olmoe
  # continue training from it (the preset gives the training settings, not the model)
  python experiments/train_lm.py --init-from converted/olmoe --data tokens.npy --seq-len 512 \\
      --out runs/olmoe
  # back to a Hugging Face directory: the converted weights, or a checkpoint of a run started
  # from them (--init-from; its last step, 300 = the preset's --steps)
  python experiments/convert_hf.py to-hf converted/olmoe out/olmoe-hf
  python experiments/convert_hf.py to-hf converted/olmoe out/olmoe-tuned \\
      --checkpoint runs/olmoe/checkpoints/300

`python -m moejax.cli.convert_hf` is the same command (`experiments/convert_hf.py` only calls
`main`).

Round trip: `to-orbax` then `to-hf` writes every tensor bit-identical to the original (same
names, dtype from `config.json`'s `torch_dtype`).

Safety: OUT must be absent or empty; an earlier output of this script (it carries a
`.moejax-output.json` marker) is replaced only with `--overwrite`, and a directory holding
anything else is never touched. OUT may not be, lie inside, or contain an input. Outputs are
written to a temporary sibling and swapped into place in one atomic rename, so an error or a kill
leaves the old OUT or the new one, never half. Inputs are verified: safetensors headers and
indexes (`moejax.interop.hf.SafetensorsCheckpoint`), the checksums of a converted directory and
of a training checkpoint (`--checkpoint`), and weights holding NaN/Inf are refused (named, with
the count) unless `--allow-nonfinite`. Every input error prints one line naming the file (and the
tensor or field) and exits 2, with nothing written.
"""

from __future__ import annotations

import argparse
import math
import sys

from moejax.cli._parser import OneLineParser
from pallas_kernels.targets import use_cpu_unless_accelerator


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    to_orbax = sub.add_parser("to-orbax", help="Hugging Face directory -> converted directory")
    to_orbax.add_argument(
        "hf_dir", help="Hugging Face model directory: config.json and *.safetensors (or shards)"
    )
    to_orbax.add_argument(
        "out", help="converted directory to write (orbax params, model.json, hf_config.json)"
    )
    to_orbax.add_argument(
        "--param-dtype", default="float32", choices=("float32", "bfloat16"), help="stored params"
    )
    to_hf = sub.add_parser("to-hf", help="converted directory -> Hugging Face directory")
    to_hf.add_argument("converted", help="a directory written by to-orbax")
    to_hf.add_argument(
        "out", help="Hugging Face directory to write (config.json and safetensors shards)"
    )
    to_hf.add_argument("--checkpoint", help="a training checkpoint step dir to take params from")
    to_hf.add_argument(
        "--layout",
        default=None,
        choices=("per_expert", "fused"),
        help="expert tensors one per expert (as published) or fused (transformers 5); "
        "default: the family's published layout (per_expert; GPT-OSS: fused)",
    )
    to_hf.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="tensor dtype written (default: config.json's torch_dtype, else float32)",
    )
    to_hf.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="largest safetensors shard, > 0 (default 5)"
    )
    for q in (to_orbax, to_hf):
        q.add_argument(
            "--overwrite", action="store_true", help="replace an earlier output of this script"
        )
        q.add_argument(
            "--allow-nonfinite", action="store_true", help="convert weights holding NaN or Inf"
        )
        q.add_argument("--no-progress", action="store_true", help="no progress bar")
        q.add_argument("--debug", action="store_true", help="tracebacks for input errors")
    return p.parse_args(argv)


def to_orbax(args) -> str:
    from moejax.interop.hf import convert_to_orbax

    cfg, family = convert_to_orbax(
        args.hf_dir,
        args.out,
        param_dtype=args.param_dtype,
        overwrite=args.overwrite,
        allow_nonfinite=args.allow_nonfinite,
        progress=not args.no_progress,
    )
    return f"wrote {args.out}: {family}, {cfg.num_layers} layers, " \
        f"{cfg.moe.num_experts} experts (train with --init-from {args.out})"  # fmt: skip


def to_hf(args) -> str:
    from moejax.interop.hf import CheckpointError, convert_to_hf

    if not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):
        raise CheckpointError(f"--max-shard-gb={args.max_shard_gb}: need a number > 0")
    convert_to_hf(
        args.converted,
        args.out,
        checkpoint=args.checkpoint,
        layout=args.layout,
        dtype=args.dtype,
        max_shard_bytes=int(args.max_shard_gb * 2**30),
        overwrite=args.overwrite,
        allow_nonfinite=args.allow_nonfinite,
        progress=not args.no_progress,
    )
    return f"wrote {args.out}"


def main(argv=None) -> int:
    args = parse_args(argv)
    use_cpu_unless_accelerator()  # no GPU/TPU here: no plugin tracebacks (pallas_kernels.targets)
    from moejax.interop.hf import CheckpointError, NonFiniteError
    from moejax.training import CheckpointError as TrainCheckpointError
    from moejax.training.checkpoint import NonFiniteState

    try:
        message = (to_orbax if args.command == "to-orbax" else to_hf)(args)
    except (CheckpointError, TrainCheckpointError, OSError) as err:  # names the file (+ tensor)
        if args.debug:
            raise
        nonfinite = isinstance(err, NonFiniteError | NonFiniteState)
        hint = "; pass --allow-nonfinite to convert it anyway" if nonfinite else ""
        print(f"error: {err}{hint}", file=sys.stderr)
        from moejax._disk import disk_error

        if disk_error(err) is not None:
            _DISK_FAILED.append(err)
        return 2
    print(message)
    return 0


_DISK_FAILED = []  # a disk error was reported (`script` then exits without the shutdown)


def script() -> int:
    """`main()` as the command runs it: after a full disk reported in one line, the process
    ends without the interpreter's shutdown (`moejax._disk.exit_quietly`: orbax's background
    writers would print tracebacks of the same error)."""
    code = main()
    if _DISK_FAILED:
        from moejax._disk import exit_quietly

        exit_quietly(code)
    return code


if __name__ == "__main__":
    sys.exit(script())
