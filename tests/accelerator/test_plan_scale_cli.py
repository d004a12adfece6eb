"""`experiments/plan_scale.py --hf-config`, run as a user runs it (a subprocess): a Hugging Face
`config.json` sized without compiling (`--state-only`), and a config field it cannot read named
before anything else runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moejax import models
from moejax.interop.hf import lm_config_from_hf

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def _minimax_m2(monkeypatch) -> dict:
    """MiniMax-M2's published config, as `tests/interop/test_hf_minimax.py` holds it."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "interop"))
    from test_hf_minimax import MINIMAX_M2

    return MINIMAX_M2


def _plan_scale(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it
    return subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "plan_scale.py"), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


def test_plan_scale_sizes_a_hugging_face_config_without_compiling(tmp_path, monkeypatch):
    """MiniMax-M2 (228.7 B parameters) from its config.json alone, bf16 moments: 8 bytes a
    parameter over 64 H100s is 26.6 GiB a device, which fits; on one node of 8 it does not."""
    config = _minimax_m2(monkeypatch)
    path = tmp_path / "MiniMax-M2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    run = _plan_scale(
        "--hf-config", str(path), "--target", "h100x8", "h100x64", "--state-only",
        "--bf16-moments",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("minimax_m2:MiniMax-M2 ")]
    assert len(lines) == 2, run.stdout
    params = models.param_counts(lm_config_from_hf(config)[0]).total
    by_hand = params * 8 / 64 / GIB  # what FSDP x expert splits evenly; norms are whole
    assert "(62 moe): 213.0/79.1 GiB does not fit" in lines[0]
    total = float(lines[1].split("(62 moe): ")[1].split("/")[0])
    assert total == pytest.approx(by_hand, rel=0.01) and lines[1].endswith(" fits")


def test_plan_scale_names_the_config_field_it_cannot_read(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "minimax_m2", "attn_type_list": [0, 1], "hidden_size": 8}')
    run = _plan_scale("--hf-config", str(path), "--state-only")
    assert run.returncode != 0 and "attn_type_list" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize(
    "flag, value",
    [("--seq-len", "0"), ("--batch", "0"), ("--batch", "-3"), ("--microbatches", "0")],
)
def test_non_positive_sizes_are_one_line_not_unset(flag, value):
    """`--seq-len 0` and `--batch 0` were read as unset (the preset's value, silently) and
    negative values a traceback: each is refused in one line, exit 2."""
    run = _plan_scale("--state-only", flag, value)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: argument {flag}: {value}: need an integer >= 1 (see --help)"
    )
    assert "Traceback" not in run.stderr
