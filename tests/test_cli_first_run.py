"""What a first run of the commands prints on a CPU machine, as a newcomer following README.md
meets it: no accelerator plugin's tracebacks with the deviceless compilers installed and
`JAX_PLATFORMS` unset; a missing compiler, or a missing path, is one line saying what to do."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pallas_kernels import targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra) -> dict:
    """The environment of a user's shell: no JAX_PLATFORMS (conftest.py sets it), this tree on
    the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return {**env, **extra}


def _script(name: str) -> str:
    return os.path.join(ROOT, "experiments", name)


def test_a_cpu_training_run_prints_no_plugin_tracebacks(tmp_path):
    # With `python -m pallas_kernels.targets --install` done (CI and the docs do it) and
    # JAX_PLATFORMS unset, jax would start the CUDA plugin (no cuFFT: a traceback) and libtpu
    # (no TPU worker: a page of errors) before training on the CPU; the command asks for the CPU
    # itself when the machine shows no GPU or TPU.
    if targets.accelerator_visible():
        pytest.skip("this machine shows a GPU or TPU: jax is left to pick it")
    argv = [sys.executable, _script("train_lm.py"), "--preset", "micro", "--steps", "2"]
    argv += ["--out", str(tmp_path / "run"), "--no-progress", "--strategy", "default"]
    argv += ["--max-bytes", "100000", "--eval-batches", "1"]
    proc = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "over 8 cpu devices" in proc.stdout, proc.stdout[-2000:]
    for noise in ("Traceback", "plugin", "libtpu", "TPU_WORKER_HOSTNAMES"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


def test_the_platform_chosen_by_the_user_or_the_machine_is_kept():
    # JAX_PLATFORMS set, or a GPU/TPU on the machine: jax's platforms are left as they are.
    code = (
        "import jax; from pallas_kernels import targets; first = "
        "targets.use_cpu_unless_accelerator(); targets.accelerator_visible = lambda: True; "
        "print(first, targets.use_cpu_unless_accelerator(), jax.config.jax_platforms)"
    )
    run = [sys.executable, "-c", code]
    chosen = subprocess.run(run, env=_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    assert chosen.stdout.split() == ["False", "False", "cpu"], chosen.stderr
    code = code.replace("first = targets.use_cpu_unless_accelerator(); ", "first = None; ")
    gpu = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True)
    assert gpu.stdout.split() == ["None", "False", "None"], gpu.stderr


# --- A missing compiler: one line saying how to install it -------------------------------------

# The deviceless compile commands of README.md and docs/ (and BENCHMARKS.md's), each run with the
# CUDA plugin or libtpu made unimportable as on a machine without `--install`.
_HIDE = "import runpy, sys; sys.modules[{module!r}] = None; sys.argv = {argv!r}; "
_HIDE += "runpy.run_path(sys.argv[0], run_name='__main__')"
NEEDS_COMPILERS = {
    "plan_scale h100": ("jax_plugins.xla_cuda13", "plan_scale.py", "--preset", "mixtral_8x7b",
                        "--target", "h100x64"),
    "plan_scale v5p": ("libtpu", "plan_scale.py", "--preset", "mixtral_8x7b", "--target",
                       "v5p-64"),
    "bench_overlap": ("jax_plugins.xla_cuda13", "bench_overlap.py", "--preset", "tiny"),
    "step_breakdown": ("jax_plugins.xla_cuda13", "step_breakdown.py"),
    "compile_report": ("jax_plugins.xla_cuda13", "compile_report.py"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(NEEDS_COMPILERS))
def test_a_missing_compiler_is_one_line_with_the_install_command(case, tmp_path):
    module, script, *args = NEEDS_COMPILERS[case]
    code = _HIDE.format(module=module, argv=[_script(script), *args])
    env = _env(JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: cannot compile for "), lines
    assert f"install the deviceless compilers: {targets.INSTALL_HINT} (= pip install" in lines[0]
    assert not os.listdir(tmp_path)


# --- A missing path: one line saying so ---------------------------------------------------------


@pytest.mark.parametrize(
    "flag,says",
    [
        ("--data", "--data: corpus path {p}: no such file or directory"),
        ("--init-from", "{p}: no such directory (a converted model directory"),
        ("--upcycle-from", "--upcycle-from={p}: no such directory (a dense run directory"),
    ],
)
def test_train_lm_names_a_missing_path(flag, says, tmp_path, capsys):
    from moejax.cli import train_lm

    missing = tmp_path / "nowhere"
    out = tmp_path / "run"
    code = train_lm.main(["--preset", "micro", "--out", str(out), flag, str(missing)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {says.format(p=missing)}"), err
    assert not out.exists()


def test_convert_hf_names_a_missing_path(tmp_path, capsys):
    from moejax.cli import convert_hf

    missing = tmp_path / "nowhere"
    for argv, says in (
        (["to-orbax", str(missing), str(tmp_path / "a")], f"in '{missing}': no such directory"),
        (["to-hf", str(missing), str(tmp_path / "b")], f"{missing}: no such directory"),
    ):
        assert convert_hf.main([*argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"error: {says}") and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == []


def test_the_placement_commands_name_a_missing_path(tmp_path, capsys):
    from moejax.cli import replay_placement, simulate_placement

    missing = tmp_path / "nowhere"
    with pytest.raises(SystemExit) as exit_:
        replay_placement.main([str(missing)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {missing}: no such directory (a run directory of train_lm.py")
    code = simulate_placement.main(["--trace", f"{missing}.npy", "--out", str(tmp_path / "o")])
    printed = capsys.readouterr()
    assert code == 2 and printed.err == f"error: --trace {missing}.npy: no such file\n"
    assert printed.out == "" and sorted(os.listdir(tmp_path)) == []


def test_plan_scale_names_a_missing_hf_config(tmp_path):
    missing = tmp_path / "GLM-4.7-Flash"
    argv = [sys.executable, _script("plan_scale.py"), "--hf-config", str(missing)]
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(
        f"error: --hf-config {missing}: in '{missing}': no such file or directory"
    ), proc.stderr


def test_the_compilers_command_prints_no_warning():
    # `python -m pallas_kernels.targets` (`--install` when something is missing) imports the
    # package, which imports `targets`, before running it: no runpy RuntimeWarning about it.
    argv = [sys.executable, "-m", "pallas_kernels.targets"]
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("cuda: ") and "\ntpu: " in proc.stdout
