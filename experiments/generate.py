"""Sample text from a trained or converted model: does it still talk?

  python experiments/generate.py runs/tiny --prompt "def "             # a training run's newest
  python experiments/generate.py runs/tiny/checkpoints/300 --ids 1,2,3  # checkpoint, or one step
  python experiments/generate.py converted/olmoe --ids 1,2,3 --max-new-tokens 20  # convert_hf.py

`MODEL` is a training run directory (`train_lm.py --out`; its newest checkpoint), one checkpoint
step directory (`<run>/checkpoints/<step>`), or a directory written by `convert_hf.py to-orbax`.
The prompt is a string through the byte tokenizer (`--prompt`, printed back decoded) or token
ids (`--ids`, printed as ids). Greedy by default (`--temperature 0`); `--temperature` and
`--top-p` sample (`--seed`). `moejax.models.generate` does the work (a KV cache, two compiled
programs per shape); `--mesh 2,4` runs it on a `data x expert` mesh of simulated devices.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", help="a training run dir, a checkpoint step dir, or a converted dir")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, through the byte tokenizer")
    prompt.add_argument("--ids", help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default=None, help="data,expert sizes, e.g. 2,4 (default: 1 device)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _train_checkpoint(step_dir: str):
    """`(LMConfig, params)` of a training checkpoint step directory (the model config is the
    one its metadata records)."""
    from moejax.interop.hf import params_of_train_checkpoint
    from moejax.training.checkpoint import read_model_config

    cfg = read_model_config(step_dir)
    return cfg, params_of_train_checkpoint(step_dir, cfg)


def load(path: str):
    """`(LMConfig, params)` from any of the three kinds of `MODEL` directory."""
    from moejax.interop.hf import load_converted_params, read_converted

    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):  # a run: its newest finished step
        steps = [int(s) for s in os.listdir(os.path.join(path, "checkpoints")) if s.isdigit()]
        if not steps:
            raise SystemExit(f"{path}: the run has no checkpoint yet")
        path = os.path.join(path, "checkpoints", str(max(steps)))
    if os.path.isdir(os.path.join(path, "meta")) and os.path.isdir(os.path.join(path, "state")):
        return _train_checkpoint(path)
    cfg = read_converted(path)[0]
    return cfg, load_converted_params(path, cfg)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mesh:
        n = 1
        for size in args.mesh.split(","):
            n *= int(size)
        flags = os.environ.get("XLA_FLAGS", "")
        if "device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"
    import numpy as np
    from tqdm import tqdm

    from moejax import data, models, parallel

    cfg, params = load(args.model)
    ids = data.encode(args.prompt) if args.prompt is not None else [
        int(i) for i in args.ids.split(",")
    ]  # fmt: skip
    prompt = np.asarray(ids, np.int32)
    new = min(args.max_new_tokens, cfg.max_seq_len - len(prompt))
    mesh = None
    if args.mesh:
        shape = tuple(int(s) for s in args.mesh.split(","))
        mesh = parallel.make_mesh(shape, ("data", "expert")[: len(shape)])
    bar = tqdm(total=new, unit="tok", disable=args.no_progress, file=sys.stderr)
    out = models.generate(
        params, cfg, prompt, new, temperature=args.temperature, top_p=args.top_p,
        seed=args.seed, mesh=mesh, on_token=lambda i, t: bar.update(1),
    )  # fmt: skip
    bar.close()
    if args.prompt is not None:
        print(data.decode(out))
    else:
        print(",".join(str(int(i)) for i in out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
