"""Every ```python block of README.md runs as written, each in a fresh process, as a user pasting
it would run it: without the 8 simulated devices of conftest.py (a block that needs them asks for
them itself) and from an empty directory.

A block that cannot run on a CPU (or takes minutes) is marked by a `<!-- norun: why -->` line
right above it; it is reported as skipped with its reason, never dropped silently. Commands that
train for long belong in ```bash blocks.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
_BLOCK = re.compile(
    r"^(?:<!--\s*norun:?(?P<why>[^>]*?)\s*-->\n)?```python\n(?P<code>.*?)^```", re.M | re.S
)
_DEVICES_FLAG = re.compile(r"--xla_force_host_platform_device_count=\d+")


@dataclasses.dataclass(frozen=True)
class Block:
    line: int  # README line of the opening fence
    code: str
    norun: str | None  # why it is not run (None: it runs)


def readme_blocks(text: str) -> list[Block]:
    """The ```python blocks of `text`, in order."""
    blocks = []
    for m in _BLOCK.finditer(text):
        fence = m.start("code") - len("```python\n")
        why = m.group("why")
        norun = None if why is None else (why.strip() or "no reason given")
        blocks.append(Block(text.count("\n", 0, fence) + 1, m.group("code"), norun))
    return blocks


with open(README) as _f:
    BLOCKS = readme_blocks(_f.read())


def _user_env() -> dict:
    """This process's environment less what conftest.py added (the simulated device count)."""
    env = dict(os.environ)
    flags = _DEVICES_FLAG.sub("", env.pop("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_readme_has_python_blocks_and_the_parser_finds_markers():
    assert len([b for b in BLOCKS if b.norun is None]) >= 2
    text = "a\n```python\nx = 1\n```\n<!-- norun: needs a GPU -->\n```python\ny = 2\n```\n"
    assert readme_blocks(text) == [Block(2, "x = 1\n", None), Block(6, "y = 2\n", "needs a GPU")]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_readme_python_block_runs(block, tmp_path):
    if block.norun is not None:
        pytest.skip(f"README.md line {block.line} is marked norun: {block.norun}")
    proc = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=tmp_path,
        env=_user_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"README.md line {block.line}:\n{block.code}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )
