"""Every ```python block of README.md and of the pages under docs/ runs as written, each in a fresh
process, as a user pasting it would run it: without the 8 simulated devices of conftest.py (a
block that needs them asks for them itself) and from an empty directory.

A block that cannot run on a CPU (or takes minutes) is marked by a `<!-- norun: why -->` line
right above it; it is reported as skipped with its reason, never dropped silently. Commands that
train for long belong in ```bash blocks, whose command lines are tested too (below `COMMANDS`):
run as written where that takes seconds, their flags checked where the run takes minutes (the
run itself, shortened, in the slow suite), each skip with its reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from moejax.cli import train_inputs, train_lm
from moejax.placement import H100_NVLINK as H100

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
# The pages checked: the README and every page under docs/ (paths relative to ROOT).
PAGES = ["README.md"] + sorted(
    f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")
)
_BLOCK = re.compile(
    r"^(?:<!--\s*norun:?(?P<why>[^>]*?)\s*-->\n)?```python\n(?P<code>.*?)^```", re.M | re.S
)
_DEVICES_FLAG = re.compile(r"--xla_force_host_platform_device_count=\d+")


@dataclasses.dataclass(frozen=True)
class Block:
    line: int  # line of the opening fence
    code: str
    norun: str | None  # why it is not run (None: it runs)
    page: str = "README.md"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The ```python blocks of `text` (the page `page`), in order."""
    blocks = []
    for m in _BLOCK.finditer(text):
        fence = m.start("code") - len("```python\n")
        why = m.group("why")
        norun = None if why is None else (why.strip() or "no reason given")
        blocks.append(Block(text.count("\n", 0, fence) + 1, m.group("code"), norun, page))
    return blocks


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def _id(page: str, line: int) -> str:
    """`README.md`, 12 -> `line12`; `docs/hf.md`, 30 -> `hf-line30`."""
    stem = os.path.splitext(os.path.basename(page))[0]
    return f"line{line}" if page == "README.md" else f"{stem}-line{line}"


BLOCKS = [b for page in PAGES for b in readme_blocks(_read(page), page)]


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
    assert len([b for b in BLOCKS if b.norun is None and b.page == "README.md"]) >= 2
    assert {"README.md", "docs/layer.md", "docs/hf.md"} <= set(PAGES)
    text = "a\n```python\nx = 1\n```\n<!-- norun: needs a GPU -->\n```python\ny = 2\n```\n"
    assert readme_blocks(text) == [Block(2, "x = 1\n", None), Block(6, "y = 2\n", "needs a GPU")]


@pytest.mark.parametrize("block", BLOCKS, ids=[_id(b.page, b.line) for b in BLOCKS])
def test_readme_python_block_runs(block, tmp_path):
    if block.norun is not None:
        pytest.skip(f"{block.page} line {block.line} is marked norun: {block.norun}")
    proc = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=tmp_path,
        env=_user_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"{block.page} line {block.line}:\n{block.code}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )


# --- Shell commands -------------------------------------------------------------------------
#
# Every command line of the ```bash blocks of the README and docs/ pages (continuations joined,
# comments dropped) has a plan below, and a test fails on a command without one (or a plan
# without its command), so a new command is classified, never dropped silently. A command that
# appears on several pages is run (or checked) once, where it first appears:
#
# - "run": run as written, from a scratch directory that stands for the repository root
#   (`experiments/` and `tests/` linked in), with the interpreter (and `jupyter`) of this venv.
#   `extra` flags make long ones short; `slow` ones are off by default (`-m slow`).
# - "flags": a `train_lm.py` command whose run takes minutes: the default suite checks that its
#   flags, mesh and corpus are accepted (`moejax.cli.train_inputs.setup`, nothing trained);
#   the slow suite also runs it with `extra` flags (a few steps).
# - "skip": reported as skipped with the reason.
_FENCE = re.compile(r"^```(\S*)\s*$")
_QUICK = ("--steps", "3", "--max-bytes", "200000", "--no-progress", "--eval-batches", "1")


@dataclasses.dataclass(frozen=True)
class Plan:
    how: str  # "run", "flags" or "skip"
    why: str = ""  # "skip": why it is not run here
    extra: tuple = ()  # flags appended for a short run
    slow: bool = False
    setup: tuple = ()  # preparations of the scratch directory (`_prepare`)
    needs: str | None = None  # "jupyter" or "cuda": skipped without it
    together: str | None = None  # "run": started at once with the group's other commands


_INSTALL = "installs packages; the suite runs in an environment that has them"
_HOSTS = "needs several hosts (tests/training/test_multihost.py runs two processes on one)"
_HF = "needs a downloaded Hugging Face model (tests/interop/test_convert_hf.py runs the script)"
COMMANDS: dict[str, Plan] = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python "
    "experiments/train_lm.py": Plan(
        "skip", "the install, then the main job: tests/training/test_readme_job.py (slow)"
    ),
    "pip install -e .[dev] && python -m pytest -n 2 -q": Plan("skip", "the test suite itself"),
    "pip install -e .[notebook]": Plan("skip", _INSTALL),
    "jupyter lab experiments/notebooks/quickstart.ipynb": Plan("skip", "interactive"),
    "jupyter nbconvert --to notebook --execute experiments/notebooks/quickstart.ipynb "
    "--output-dir runs/quickstart": Plan("run", slow=True, needs="jupyter", setup=("notebook",)),
    "python experiments/train_lm.py": Plan("flags", extra=_QUICK),
    "python experiments/train_lm.py --preset small --mesh 2,4": Plan("flags", extra=_QUICK),
    "python experiments/train_lm.py --data notes/ book.txt --out runs/mine": Plan(
        "flags", extra=_QUICK, setup=("text",)
    ),
    "python experiments/train_lm.py --bf16 --steps 1000 --lr 2e-3 --checkpoint-every 200": Plan(
        "flags", extra=(*_QUICK, "--checkpoint-every", "2")
    ),
    "python experiments/train_lm.py --coordinator 10.0.0.1:1234 --num-processes 2 "
    "--process-id 0": Plan("skip", _HOSTS),
    "python experiments/train_lm.py --coordinator 10.0.0.1:1234 --num-processes 2 "
    "--process-id 1": Plan("skip", _HOSTS),
    # Both processes at once, as the shell runs them (`&`), on a free port instead of 1234.
    "python experiments/train_lm.py --preset micro --steps 8 --out runs/two --num-processes 2 "
    "--process-id 0 --coordinator 127.0.0.1:1234 &": Plan(
        "run", slow=True, together="two", extra=("--no-progress",)
    ),
    "python experiments/train_lm.py --preset micro --steps 8 --out runs/two --num-processes 2 "
    "--process-id 1 --coordinator 127.0.0.1:1234": Plan(
        "run", slow=True, together="two", extra=("--no-progress",)
    ),
    "python experiments/train_lm.py --strategy auto --tune-budget inf": Plan(
        "flags", extra=(*_QUICK, "--tune-candidates", "dropless;allgather")
    ),
    "python experiments/bench_overlap.py --preset tiny --batch-split 1 2 4 --dispatcher capacity "
    "dropless": Plan("run", slow=True, needs="cuda"),
    "python experiments/train_lm.py --mesh fsdp=2,expert=4 --remat full --scan": Plan(
        "flags", extra=_QUICK
    ),
    "python experiments/train_lm.py --mesh data=2,fsdp=2,expert=2 --microbatches 2": Plan(
        "flags", extra=_QUICK
    ),
    "python experiments/train_lm.py --preset mixtral_8x7b --mesh fsdp=8,expert=8 --coordinator "
    "HOST:PORT --num-processes 8 --process-id I --data corpus/": Plan(
        "skip", "64 accelerators (tests/accelerator compiles its train step deviceless)"
    ),
    "python experiments/plan_scale.py --hf-config path/to/GLM-4.7-Flash --target h100x64": Plan(
        "skip",
        "a downloaded config and ~10 min of 64-device compiles; tests/accelerator/"
        "test_plan_state.py runs --hf-config --state-only on MiniMax-M2's published config",
    ),
    "python -m pallas_kernels.targets --install": Plan("skip", _INSTALL),
    "python experiments/compile_report.py > compile_report.md": Plan(
        "skip", "about 15 to 30 min of compiles on 2 cores; tests/accelerator compiles the same"
    ),
    "python -m pytest -q tests/accelerator tests/parallel/test_gpu_overlap.py": Plan(
        "skip", "part of the test suite"
    ),
    "python experiments/train_lm.py --placement --out runs/tiny_placed": Plan(
        "flags", extra=_QUICK
    ),
    "python experiments/train_lm.py --out runs/tiny": Plan("flags", extra=_QUICK),
    "python experiments/generate.py runs/tiny --prompt def ": Plan(
        "run", slow=True, setup=("tiny_run",), extra=("--max-new-tokens", "4", "--no-progress")
    ),
    "python experiments/simulate_placement.py --trace runs/tiny/routing_trace.npy --devices 4 8": (
        Plan("run", setup=("tiny_trace",))
    ),
    "python experiments/replay_placement.py runs/tiny_placed --set react_steps=1": Plan(
        "run", setup=("placed_run",)
    ),
    "python experiments/convert_hf.py to-orbax path/to/OLMoE-1B-7B converted/olmoe": Plan(
        "skip", _HF
    ),
    "python experiments/train_lm.py --init-from converted/olmoe --data tokens.npy --seq-len 512 "
    "--out runs/olmoe": Plan("skip", _HF),
    "python experiments/train_lm.py --preset micro_dense --out runs/dense": Plan(
        "flags", extra=_QUICK
    ),
    "python experiments/train_lm.py --preset micro --upcycle-from runs/dense "
    "--upcycle-granularity 2 --out runs/upcycled": Plan("run", slow=True, setup=("dense_run",)),
    "python experiments/convert_hf.py to-hf converted/olmoe out/olmoe-tuned --checkpoint "
    "runs/olmoe/checkpoints/300": Plan("skip", _HF),
}


@dataclasses.dataclass(frozen=True)
class Command:
    line: int  # line where the command starts
    text: str  # tokens joined by single spaces (the key of COMMANDS)
    page: str = "README.md"


def shell_commands(text: str, page: str = "README.md") -> list[Command]:
    """The command lines of the ```bash blocks of `text` (the page `page`), in order."""
    out, lang, start, lines = [], None, 0, []
    for i, raw in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(raw)
        if lang is None and fence:
            lang, start, lines = fence.group(1), i, []
        elif lang is not None and raw.strip() == "```":
            if lang in ("bash", "sh"):
                out += _logical_lines(start, lines, page)
            lang = None
        elif lang is not None:
            lines.append(raw)
    return out


def _logical_lines(fence_line: int, lines: list[str], page: str) -> list[Command]:
    out, pending, first = [], "", None
    for offset, raw in enumerate(lines, 1):
        first = first or fence_line + offset
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        tokens = shlex.split(pending + raw, comments=True)
        if tokens:
            out.append(Command(first, " ".join(tokens), page))
        pending, first = "", None
    return out


COMMAND_LINES = [c for page in PAGES for c in shell_commands(_read(page), page)]


def test_the_shell_command_parser():
    text = "```bash\na --x 1 \\\n  --y 2   # note\n\n# only a comment\nb 'q r'\n```\n"
    text += "```python\nc\n```\n"
    assert shell_commands(text) == [Command(2, "a --x 1 --y 2"), Command(6, "b q r")]


def test_every_readme_command_has_a_plan():
    found = [c.text for c in COMMAND_LINES]
    missing = [f"{c.page} line {c.line}: {c.text}" for c in COMMAND_LINES if c.text not in COMMANDS]
    assert not missing, "classify in COMMANDS:\n" + "\n".join(missing)
    stale = [k for k in COMMANDS if k not in found]
    assert not stale, f"no longer in README.md or docs/: {stale}"


def _params(kind: str):
    out, seen = [], set()
    for c in COMMAND_LINES:
        if c.text in seen:  # the same command on another page: checked once
            continue
        seen.add(c.text)
        plan = COMMANDS.get(c.text)
        if plan is None or (kind == "run" and plan.how == "flags" and not plan.extra):
            continue
        if plan.together is not None and plan.together in seen:  # run with its group's first
            continue
        seen.add(plan.together)
        if kind == "flags" and plan.how != "flags":
            continue
        slow = plan.slow or (kind == "run" and plan.how == "flags")
        marks = [pytest.mark.slow] if slow else []
        out.append(pytest.param(c, id=f"{_id(c.page, c.line)}-{_slug(c.text)}", marks=marks))
    return out


def _slug(command: str) -> str:
    """`python experiments/train_lm.py ...` -> `train_lm`, `jupyter nbconvert ...` -> `jupyter`."""
    tokens = command.split()
    script = tokens[1] if tokens[0].startswith("python") and len(tokens) > 1 else tokens[0]
    return os.path.splitext(os.path.basename(script))[0]


def _prepare(tmp_path, setups) -> None:
    """The scratch directory stands for the repository root: its scripts, and what a command
    expects to find (a run it reads, your text files)."""
    for name in ("tests", "pallas_kernels", "moejax"):
        (tmp_path / name).symlink_to(os.path.join(ROOT, name))
    # experiments/ itself a directory: Jupyter runs a notebook in its own folder, which must
    # lie under the scratch root for the notebook to write to the scratch runs/ (os.getcwd()
    # resolves links).
    (tmp_path / "experiments").mkdir()
    for entry in os.scandir(os.path.join(ROOT, "experiments")):
        if entry.name == "notebooks":
            shutil.copytree(entry.path, tmp_path / "experiments" / entry.name)
        elif entry.name != "__pycache__":
            (tmp_path / "experiments" / entry.name).symlink_to(entry.path)
    fixture = os.path.join(ROOT, "tests", "placement", "fixtures", "tiny_lm_routing_100.npy")
    if "tiny_trace" in setups:
        (tmp_path / "runs" / "tiny").mkdir(parents=True)
        shutil.copy(fixture, tmp_path / "runs" / "tiny" / "routing_trace.npy")
    if "placed_run" in setups:  # what train_lm.py --placement leaves for the replay
        from moejax.placement import Placement, PlacementController, Workload
        from moejax.placement.controller import SPEC_FILE
        from moejax.training.placed import TRAINING_CONTROLLER

        run = tmp_path / "runs" / "tiny_placed"
        run.mkdir(parents=True)
        shutil.copy(fixture, run / "routing_trace.npy")
        wl = Workload(tokens_per_device=256, top_k=2, d_model=128, d_ff=256, replica_sync="packed")
        ctl = PlacementController([Placement.identity(8, 4, 3)] * 4, H100, wl, TRAINING_CONTROLLER)
        (run / SPEC_FILE).write_text(json.dumps(ctl.spec()))
    if "dense_run" in setups:  # what the README's dense run leaves: runs/dense (2 steps)
        train = [sys.executable, os.path.join(ROOT, "experiments", "train_lm.py"), *_QUICK]
        train[train.index("3")] = "2"
        subprocess.run(
            [*train, "--preset", "micro_dense", "--out", str(tmp_path / "runs" / "dense")],
            cwd=tmp_path, env=_user_env(), check=True, capture_output=True, timeout=1800,
        )  # fmt: skip
    if "tiny_run" in setups:  # what the main job leaves: a checkpoint in runs/tiny (2 steps)
        train = [sys.executable, os.path.join(ROOT, "experiments", "train_lm.py"), *_QUICK]
        train[train.index("3")] = "2"
        subprocess.run(
            [*train, "--out", str(tmp_path / "runs" / "tiny")], cwd=tmp_path, env=_user_env(),
            check=True, capture_output=True, timeout=1800,
        )  # fmt: skip
    if "text" in setups:
        (tmp_path / "notes").mkdir()
        for i in range(3):
            (tmp_path / "notes" / f"{i}.txt").write_text(_TEXT * 40)
        (tmp_path / "book.txt").write_text(_TEXT * 400)


_TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom.\n"


@pytest.mark.parametrize("command", _params("flags"))
def test_readme_train_command_is_accepted(command, tmp_path, monkeypatch):
    # Flags, mesh, corpus: what train_lm.py checks before it compiles anything.
    plan = COMMANDS[command.text]
    _prepare(tmp_path, plan.setup)
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(command.text)[2:]  # after "python experiments/train_lm.py"
    args = train_lm.parse_args(argv)
    model_cfg, train_cfg, mesh, _, corpus = train_inputs.setup(args)
    assert math.prod(mesh.devices.shape) == 8 and len(corpus.tokens) > 0
    if "text" in plan.setup:  # your text, not the built-in corpus
        assert sorted(os.path.basename(s) for s in corpus.sources) == [
            "0.txt", "1.txt", "2.txt", "book.txt"
        ]  # fmt: skip
    assert not os.path.exists(tmp_path / "runs"), "checking the flags writes nothing"


@pytest.mark.parametrize("command", _params("run"))
def test_readme_command_runs(command, tmp_path):
    plan = COMMANDS[command.text]
    if plan.how == "skip":
        pytest.skip(f"{command.page} line {command.line}: {plan.why}")
    bin_dir = os.path.dirname(sys.executable)
    if plan.needs == "jupyter" and not os.path.exists(os.path.join(bin_dir, "jupyter")):
        pytest.skip("jupyter is not installed: pip install -e '.[notebook]'")
    if plan.needs == "cuda":
        from pallas_kernels import targets

        if (why := targets.missing("cuda")) is not None:
            pytest.skip(why)
    _prepare(tmp_path, plan.setup)
    if plan.together is not None:
        return _run_together(command, plan, tmp_path)
    argv = _argv(command.text, plan)
    proc = subprocess.run(
        argv, cwd=tmp_path, env=_user_env(), capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, (
        f"{command.page} line {command.line}: {command.text}\n--- stdout ---\n{proc.stdout[-3000:]}"
        f"\n--- stderr ---\n{proc.stderr[-3000:]}"
    )
    _check_outputs(command, tmp_path, proc.stdout)


def _argv(text: str, plan: Plan) -> list[str]:
    argv = shlex.split(text)
    if ">" in argv:
        argv = argv[: argv.index(">")]
    if argv[-1] == "&":
        argv = argv[:-1]
    bin_dir = os.path.dirname(sys.executable)
    head = {"python": sys.executable, "python3": sys.executable}
    argv[0] = head.get(argv[0], os.path.join(bin_dir, argv[0]))
    return argv + list(plan.extra)


def _run_together(command, plan, tmp_path) -> None:
    """The commands of `plan.together`'s group started at once (the first one's output is
    checked), the coordinator's port 1234 replaced by a free one."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = [c for c in COMMAND_LINES if COMMANDS.get(c.text, Plan("")).together == plan.together]
    procs, logs = [], [tmp_path / f"together{i}.log" for i in range(len(group))]
    for c, path in zip(group, logs, strict=True):
        argv = [a.replace("127.0.0.1:1234", f"127.0.0.1:{port}") for a in _argv(c.text, plan)]
        with open(path, "w") as log:  # a file: a pipe left full would block the whole group
            procs.append(subprocess.Popen(argv, cwd=tmp_path, env=_user_env(), stdout=log,
                                          stderr=subprocess.STDOUT))  # fmt: skip
    try:
        for p in procs:
            p.wait(timeout=1800)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [path.read_text() for path in logs]
    shown = "\n".join(f"--- {c.text}:\n{o[-3000:]}" for c, o in zip(group, outs, strict=True))
    assert all(p.returncode == 0 for p in procs), f"{command.page} line {command.line}:{shown}"
    _check_outputs(command, tmp_path, outs[0])


def _check_outputs(command, tmp_path, stdout: str) -> None:
    """What the page says each command leaves behind."""
    if "simulate_placement.py --trace" in command.text:
        out = tmp_path / "runs" / "placement" / "tiny"
        assert (out / "placement.png").exists() and (out / "placement.json").exists()
    if "replay_placement.py" in command.text:
        assert "mean device imbalance: placed " in stdout and "\nchecks: " in stdout
    if "nbconvert" in command.text:
        out = tmp_path / "runs" / "quickstart"
        for name in ("quickstart.ipynb", "routing.png", "training.png", "run/loss.png"):
            assert (out / name).exists(), name
        with open(out / "quickstart.ipynb") as f:
            cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
        outputs = [o for c in cells for o in c.get("outputs", [])]
        assert sum("image/png" in o.get("data", {}) for o in outputs) == 2
    if "train_lm.py" in command.text:
        assert "outputs: " in stdout
    if "--upcycle-from runs/dense" in command.text:  # the dense run's MLPs, split in two
        assert "| upcycled from runs/dense (granularity 2, noise 0)" in stdout
