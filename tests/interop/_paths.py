"""The user's path through a Hugging Face model, door by door, as subprocesses of the CLIs
(`test_paths.py` runs it per family; run this file to rewrite the table in docs/hf.md from the
results):

1. `convert`: `convert_hf.py to-orbax HF CONVERTED`;
2. `generate`: `generate.py CONVERTED --ids ...`, greedy: the tokens of transformers' `generate`
   (the fixtures') for the same checkpoint;
3. `fine-tune`: `train_lm.py --init-from CONVERTED` for 2 steps on 1 device, losses finite;
4. `export`: `convert_hf.py to-hf CONVERTED EXPORTED --checkpoint <step 2> --dtype float32`;
5. `read back`: the exported directory loads in moejax's reader (`load_hf_model`) and its logits
   equal the trained checkpoint's, bit for bit.

    python tests/interop/_paths.py     # every family, ~8 min on one core; rewrites the table
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import _hf_decoder_reference as ref  # noqa: E402
import make_hf_model_fixtures as fixtures  # noqa: E402

DOORS = ("convert", "generate", "fine-tune", "export", "read back")
# row -> (fixture family, config.json overrides): every whole family moejax reads, and Kimi K2
# (DeepSeek-V3's architecture under its own model_type)
FAMILIES = {f: (f, {}) for f in (*fixtures.FAMILIES, *fixtures.FAMILIES_2026)}
FAMILIES["kimi_k2"] = ("deepseek_v3", {"model_type": "kimi_k2"})
NAMES = {
    "mixtral": "Mixtral",
    "qwen3_moe": "Qwen3-MoE",
    "olmoe": "OLMoE",
    "qwen2_moe": "Qwen2-MoE",
    "deepseek_v3": "DeepSeek-V3",
    "kimi_k2": "Kimi K2",
    "gpt_oss": "GPT-OSS",
    "glm4_moe": "GLM-4.5",
    "deepseek_v2": "DeepSeek-V2",
    "minimax_m2": "MiniMax-M2",
    "glm4_moe_lite": "GLM-4.7-Flash",
}
TABLE_START, TABLE_END = "<!-- paths table: start -->", "<!-- paths table: end -->"
DOCS = ROOT / "docs" / "hf.md"


class DoorFailed(AssertionError):
    def __init__(self, door: str, message: str):
        super().__init__(f"{door}: {message}")
        self.door = door


def _cli(door: str, script: str, *args: str) -> str:
    """Run `experiments/<script>` with `args` as a user does (a fresh interpreter, 1 CPU
    device); its stdout, or `DoorFailed` with the last lines of its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
        raise DoorFailed(door, f"{script} exited {proc.returncode}:\n{tail}")
    return proc.stdout


def expected_generate(family: str) -> np.ndarray:
    """transformers' greedy tokens `[B, PROMPT + NEW_TOKENS]` for the fixture `family`."""
    with np.load(fixtures.OUT_2026) as f:
        return f[f"generate/{family}"]


def walk(row: str, root: pathlib.Path) -> None:
    """Every door in order for `row` of `FAMILIES`, in the empty directory `root`.

    Raises:
      DoorFailed: the first door that fails (its `.door`), with what went wrong.
    """
    import jax
    import jax.numpy as jnp

    from moejax import models
    from moejax.interop.hf import load_hf_model, params_of_train_checkpoint, read_converted

    family, overrides = FAMILIES[row]
    config = ref.CONFIGS[family] if family in ref.CONFIGS else ref.CONFIGS_2026[family]
    config = {**config, **overrides}
    hf, conv, run, out = (str(root / n) for n in ("hf", "converted", "run", "exported"))
    ref.write_checkpoint(hf, config, ref.random_state_dict(config, seed=fixtures.SEED[family]))

    _cli("convert", "convert_hf.py", "to-orbax", hf, conv, "--no-progress")

    want = expected_generate(family)[0]
    prompt = ",".join(str(int(t)) for t in want[: fixtures.PROMPT])
    got = _cli("generate", "generate.py", conv, "--ids", prompt, "--no-progress",
               "--max-new-tokens", str(fixtures.NEW_TOKENS))  # fmt: skip
    tokens = [int(t) for t in got.strip().splitlines()[-1].split(",")]
    if tokens != [int(t) for t in want]:
        raise DoorFailed("generate", f"greedy tokens {tokens}, transformers' {want.tolist()}")

    cfg = read_converted(conv)[0]
    data = np.random.default_rng(0).integers(0, cfg.vocab_size, 4096).astype(np.int32)
    np.save(root / "tokens.npy", data)
    _cli("fine-tune", "train_lm.py", "--init-from", conv, "--data", str(root / "tokens.npy"),
         "--out", run, "--mesh", "1", "--steps", "2", "--batch-size", "2", "--seq-len", "8",
         "--checkpoint-every", "2", "--eval-batches", "1", "--strategy", "default",
         "--no-progress", "--no-outputs", "--jax-cache", "none")  # fmt: skip
    with open(os.path.join(run, "metrics.jsonl")) as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    if len(losses) != 2 or not np.all(np.isfinite(losses)):
        raise DoorFailed("fine-tune", f"losses {losses}: need 2 finite ones")

    step = os.path.join(run, "checkpoints", "2")
    _cli("export", "convert_hf.py", "to-hf", conv, out, "--checkpoint", step,
         "--dtype", "float32", "--no-progress")  # fmt: skip

    trained = params_of_train_checkpoint(step, cfg)
    back_cfg, back, _ = load_hf_model(out)
    if back_cfg != cfg:
        raise DoorFailed("read back", "the exported config reads as another model")
    ids = jnp.asarray(data[: 2 * 8].reshape(2, 8))
    forward = jax.jit(lambda p: models.lm_forward(p, ids, cfg)[0])
    a, b = np.asarray(forward(trained)), np.asarray(forward(back))
    if not np.array_equal(a, b):
        raise DoorFailed("read back", f"logits differ by {np.abs(a - b).max():.3g}")


def table(results: dict[str, str | None]) -> str:
    """The docs table: one row per family, ✓ per door passed, ✗ at the door that failed
    (`results[row]`: None when every door passed, else the failing door)."""
    lines = ["| family | " + " | ".join(DOORS) + " |", "|---|" + "---|" * len(DOORS)]
    for row, failed in results.items():
        at = DOORS.index(failed) if failed else len(DOORS)
        marks = ["✓"] * at + (["✗"] + ["–"] * (len(DOORS) - at - 1) if failed else [])
        lines.append(f"| {NAMES[row]} (`{row}`) | " + " | ".join(marks) + " |")
    return "\n".join(lines)


def docs_table() -> str:
    """The table between the markers of docs/hf.md."""
    text = DOCS.read_text()
    return text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()


def main() -> int:
    results = {}
    for row in FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                walk(row, pathlib.Path(tmp))
                results[row] = None
            except DoorFailed as err:
                results[row] = err.door
                print(f"{row}: {err}", file=sys.stderr)
        print(f"{row}: {'every door' if results[row] is None else 'fails at ' + results[row]}")
    text = DOCS.read_text()
    head, rest = text.split(TABLE_START, 1)
    tail = rest.split(TABLE_END, 1)[1]
    DOCS.write_text(f"{head}{TABLE_START}\n{table(results)}\n{TABLE_END}{tail}")
    return 0 if all(v is None for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
