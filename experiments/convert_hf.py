"""Convert a Hugging Face MoE decoder to an orbax checkpoint that training starts from, and back.

Families: Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE (`config.json` `model_type`). The directory holds
`config.json` and safetensors weights (one file, or shards with `model.safetensors.index.json`);
tensors are read one at a time, with a progress bar.

  # Hugging Face directory -> converted directory (orbax params + model.json + hf_config.json)
  python experiments/convert_hf.py to-orbax path/to/OLMoE-1B-7B converted/olmoe
  # continue training from it (the preset gives the training settings, not the model)
  python experiments/train_lm.py --init-from converted/olmoe --data tokens.npy --seq-len 512
  # back to a Hugging Face directory: the converted weights, or a training checkpoint's
  python experiments/convert_hf.py to-hf converted/olmoe out/olmoe-hf
  python experiments/convert_hf.py to-hf converted/olmoe out/olmoe-tuned \\
      --checkpoint runs/tiny/checkpoints/200

Round trip: `to-orbax` then `to-hf` writes every tensor bit-identical to the original (same
names, dtype from `config.json`'s `torch_dtype`). Errors in the input (a missing shard, a tensor
of the wrong shape or dtype, an unsupported architecture) print one line naming the file and the
tensor and exit 2; nothing is left half-written (outputs are written to a temporary directory
and renamed).
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
        default="per_expert",
        choices=("per_expert", "fused"),
        help="expert tensors one per expert (as published) or fused (transformers 5); "
        "default per_expert",
    )
    to_hf.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="tensor dtype written (default: config.json's torch_dtype, else float32)",
    )
    to_hf.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (default 5)"
    )
    for q in (to_orbax, to_hf):
        q.add_argument("--no-progress", action="store_true", help="no progress bar")
        q.add_argument("--debug", action="store_true", help="tracebacks for input errors")
    return p.parse_args(argv)


def to_orbax(args) -> str:
    from moejax.interop.hf._converted import write_converted
    from moejax.interop.hf._model import load_hf_model
    from moejax.interop.hf._model_config import family_of

    cfg, params, hf_config = load_hf_model(
        args.hf_dir, param_dtype=args.param_dtype, progress=not args.no_progress
    )
    write_converted(args.out, cfg, params, hf_config, family_of(hf_config))
    return f"wrote {args.out}: {family_of(hf_config)}, {cfg.num_layers} layers, " \
        f"{cfg.moe.num_experts} experts (train with --init-from {args.out})"  # fmt: skip


def to_hf(args) -> str:
    from moejax.interop.hf._converted import (
        params_of_train_checkpoint,
        read_converted,
        restore_params,
    )
    from moejax.interop.hf._model import save_hf_model

    cfg, hf_config, _ = read_converted(args.converted)
    if args.checkpoint:
        params = params_of_train_checkpoint(args.checkpoint, cfg)
    else:
        params = restore_params(args.converted, cfg)
    save_hf_model(
        args.out,
        params,
        cfg,
        hf_config,
        layout=args.layout,
        dtype=args.dtype,
        max_shard_bytes=int(args.max_shard_gb * 2**30),
        progress=not args.no_progress,
    )
    return f"wrote {args.out}"


def main(argv=None) -> int:
    args = parse_args(argv)
    from moejax.interop.hf._converted import ConvertedDirError
    from moejax.interop.hf._files import CheckpointFormatError

    try:
        message = (to_orbax if args.command == "to-orbax" else to_hf)(args)
    except (CheckpointFormatError, ConvertedDirError) as err:  # name the file and the tensor
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
