"""Outputs never destroy what moejax did not write (`moejax.interop.hf._outputs`):
`convert_hf.py` refuses every case of the probe that deleted a user's files, replaces only its
own earlier output and only with `--overwrite`, and a SIGKILL at any point of a replacement
leaves the old output or the new one complete."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import _hf_decoder_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.cli import convert_hf
from moejax.interop.hf import (
    CheckpointError,
    _outputs,
    load_converted_params,
    read_converted,
    save_converted,
)
from moejax.models import abstract_params, presets

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "_replace_worker.py")
MICRO = presets.get("micro")


def _snapshot(root) -> dict:
    """Every file under `root` (relative path -> bytes): what 'nothing changed' compares."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            full = os.path.join(d, f)
            if os.path.islink(full):
                out[os.path.relpath(full, root)] = os.readlink(full)
                continue
            with open(full, "rb") as fh:
                out[os.path.relpath(full, root)] = fh.read()
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A Mixtral and a Qwen3-MoE Hugging Face directory and their conversions."""
    root = tmp_path_factory.mktemp("outputs")
    for family in ("mixtral", "qwen3_moe"):
        config = ref.CONFIGS[family]
        ref.write_checkpoint(str(root / family), config, ref.random_state_dict(config), shards=2)
        args = ["to-orbax", str(root / family), str(root / f"conv-{family}"), "--no-progress"]
        assert convert_hf.main(args) == 0
    return root


def _refused(capsys, args, *, says: str, keep) -> None:
    """`convert_hf.py args` exits 2 with one line saying `says`, and `keep` is unchanged."""
    before = _snapshot(keep)
    assert convert_hf.main([*map(str, args), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert _snapshot(keep) == before


def test_a_directory_of_the_users_is_never_deleted(hf_dirs, tmp_path, capsys):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.tex").write_text("\\chapter{Results}")
    for extra in ([], ["--overwrite"]):
        args = ["to-orbax", hf_dirs / "mixtral", out, *extra]
        _refused(capsys, args, says="thesis.tex", keep=tmp_path)


def test_the_input_itself_is_never_the_output(hf_dirs, tmp_path, capsys):
    hf = hf_dirs / "mixtral"
    _refused(capsys, ["to-orbax", hf, hf, "--overwrite"], says="is the input", keep=hf)
    _refused(capsys, ["to-orbax", hf, hf / "sub"], says="lies inside the input", keep=hf)


def test_a_project_holding_the_input_is_never_the_output(hf_dirs, tmp_path, capsys, monkeypatch):
    """`cd proj && convert_hf.py to-orbax HF .` with HF inside proj."""
    proj = tmp_path / "proj"
    shutil.copytree(hf_dirs / "mixtral", proj / "hf")
    (proj / "main.py").write_text("print('mine')\n")
    monkeypatch.chdir(proj)
    _refused(capsys, ["to-orbax", "hf", ".", "--overwrite"], says="holds the input", keep=proj)


def test_a_training_run_is_never_the_output_of_its_own_checkpoint(hf_dirs, tmp_path, capsys):
    """`to-hf CONV RUN --checkpoint RUN/checkpoints/6`: RUN holds the checkpoint read."""
    run = tmp_path / "run"
    (run / "checkpoints" / "6").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    conv = hf_dirs / "conv-mixtral"
    args = ["to-hf", conv, run, "--checkpoint", run / "checkpoints" / "6", "--overwrite"]
    _refused(capsys, args, says="holds the input", keep=tmp_path)


def test_an_earlier_export_is_replaced_only_when_asked_and_only_if_all_ours(
    hf_dirs, tmp_path, capsys
):
    out = tmp_path / "export"
    assert convert_hf.main(["to-hf", str(hf_dirs / "conv-mixtral"), str(out), "--no-progress"]) == 0
    assert (out / _outputs.MARKER).exists()
    qwen = ["to-hf", hf_dirs / "conv-qwen3_moe", out]
    _refused(capsys, qwen, says="pass --overwrite", keep=tmp_path)
    (out / "README.md").write_text("# My Mixtral fine-tune\n")
    _refused(capsys, [*qwen, "--overwrite"], says="README.md", keep=tmp_path)
    os.remove(out / "README.md")
    assert convert_hf.main([*map(str, qwen), "--overwrite", "--no-progress"]) == 0
    assert '"qwen3_moe"' in (out / "config.json").read_text()
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no temporary or old copy left


def test_a_users_file_deep_inside_an_earlier_output_is_never_deleted(hf_dirs, tmp_path, capsys):
    """The probe's data loss: `to-orbax --overwrite` onto its own earlier output deleted a file
    the user had put inside `params/` (the marker listed only top-level entries). The marker
    lists every file now; one it does not list, at any depth, is refused, and so is one added
    below an older marker's top-level entries after it was written."""
    out = tmp_path / "conv"
    args = ["to-orbax", hf_dirs / "mixtral", out, "--overwrite"]
    assert convert_hf.main([*map(str, args), "--no-progress"]) == 0
    marker = json.loads((out / _outputs.MARKER).read_text())
    assert any(f.startswith("params/") and "/" in f[7:] for f in marker["files"]), marker
    sub = next(d for d, _, files in os.walk(out / "params") if files and d != str(out / "params"))
    notes = os.path.join(sub, "my_notes.txt")
    with open(notes, "w") as f:
        f.write("do not lose me\n")
    said = os.path.relpath(notes, out)
    _refused(capsys, args, says=said, keep=tmp_path)
    old = {k: v for k, v in marker.items() if k != "files"}  # as an older moejax wrote it
    (out / _outputs.MARKER).write_text(json.dumps(old))
    os.utime(notes)  # (the file is newer than the marker)
    with open(notes, "a") as f:
        f.write("still mine\n")
    _refused(capsys, args, says=said, keep=tmp_path)
    os.remove(notes)
    assert convert_hf.main([*map(str, args), "--no-progress"]) == 0  # all ours: replaced
    assert sorted(os.listdir(tmp_path)) == ["conv"]


def test_files_symlinks_and_empty_directories_in_the_outputs_place(hf_dirs, tmp_path, capsys):
    hf = hf_dirs / "mixtral"
    (tmp_path / "file").write_text("x")
    _refused(capsys, ["to-orbax", hf, tmp_path / "file", "--overwrite"], says="not a directory",
             keep=tmp_path)  # fmt: skip
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    _refused(capsys, ["to-orbax", hf, tmp_path / "link"], says="symlink", keep=tmp_path)
    (tmp_path / "empty").mkdir()
    assert convert_hf.main(["to-orbax", str(hf), str(tmp_path / "empty"), "--no-progress"]) == 0
    assert (tmp_path / "empty" / "model.json").exists()


# ---------------------------------------------------------------------------------------------
# Kills during a replacement


def _params(value: float):
    return jax.tree.map(lambda a: jnp.full(a.shape, value, a.dtype), abstract_params(MICRO))


def _write(out, value: float) -> None:
    save_converted(str(out), MICRO, _params(value), {"model_type": "micro"}, "micro",
                    overwrite=True)  # fmt: skip


def _value(out) -> float:
    """The one value every parameter of the converted directory `out` holds, read verified
    (its checksums): the directory is complete."""
    cfg, _, _ = read_converted(str(out))
    leaves = [np.asarray(x) for x in jax.tree.leaves(load_converted_params(str(out), cfg))]
    values = {float(v) for leaf in leaves for v in np.unique(leaf)}
    assert len(values) == 1, values
    return values.pop()


def _kill_during_replace(tmp_path, point: str) -> float:
    """Replace an output holding 1.0 by one holding 2.0, killed at `point`; returns what the
    output holds afterwards (checked complete), then shows the next write cleans up."""
    out = tmp_path / "out"
    _write(out, 1.0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, WORKER, str(out), "2.0", point],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    if point == "none":
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert proc.returncode == -9 or "done" in proc.stdout, proc.stderr[-3000:]
    held = _value(out)
    _write(out, 3.0)  # the next write removes the killed writer's leftovers
    assert _value(out) == 3.0 and sorted(os.listdir(tmp_path)) == ["out"]
    return held


def test_kill_while_deleting_the_old_output_leaves_the_new_one_complete(tmp_path):
    """The probe's case (to-orbax over an existing output, killed while the old one was being
    deleted, left 8361 of 20016 files): now the old one is deleted only after the swap, from
    the temporary name, so the output is the new one, complete."""
    assert _kill_during_replace(tmp_path, "mid-remove") == 2.0


@pytest.mark.slow  # ~4 s a kill: a subprocess importing jax and orbax
@pytest.mark.parametrize(
    "point,held",
    [("none", 2.0), ("mid-write", 1.0), ("before-swap", 1.0), ("after-swap", 2.0)],
)
def test_kill_at_each_point_leaves_old_or_new(tmp_path, point, held):
    assert _kill_during_replace(tmp_path, point) == held


@pytest.mark.slow
def test_kills_at_random_times_leave_old_or_new(tmp_path):
    """Kills spread over the whole write (0 to 3 s after it starts; the write takes ~1-2 s
    here): each leaves the old or the new output complete."""
    held = []
    for i, delay in enumerate(np.linspace(0.0, 3.0, 10)):
        (tmp_path / str(i)).mkdir()
        held.append(_kill_during_replace(tmp_path / str(i), f"timer:{delay:.2f}"))
    assert set(held) <= {1.0, 2.0} and held[0] == 1.0 and held[-1] == 2.0, held


@pytest.mark.slow
def test_without_an_atomic_exchange_a_kill_between_renames_is_recovered(tmp_path):
    """Where `renameat2(RENAME_EXCHANGE)` is missing the old output is renamed aside first; a
    kill between the two renames leaves it aside, and the next write puts it back first."""
    out = tmp_path / "out"
    _write(out, 1.0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, WORKER, str(out), "2.0", "fallback"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert not out.exists() and [n for n in os.listdir(tmp_path) if ".old-" in n]
    _outputs.recover(str(out))
    assert _value(out) == 1.0
    _write(out, 3.0)
    assert _value(out) == 3.0 and sorted(os.listdir(tmp_path)) == ["out"]


def test_an_output_left_aside_is_put_back_before_the_next_write(tmp_path, monkeypatch):
    """What a kill between the fallback's two renames leaves (the old output at
    `.out.old-*`, nothing at `out`, the new one half-written at `.out.tmp-*` by a dead
    process) is repaired by the next write: the old one is put back, the leftover removed,
    and the write then replaces the old one as asked."""
    out = tmp_path / "out"
    _write(out, 1.0)
    os.rename(out, tmp_path / ".out.old-abc")
    (tmp_path / ".out.tmp-def").mkdir()
    _outputs._write_marker(str(tmp_path / ".out.tmp-def"), "converted")
    marker = tmp_path / ".out.tmp-def" / _outputs.MARKER
    marker.write_text(marker.read_text().replace(f'"pid": {os.getpid()}', '"pid": 999999999'))
    _outputs.recover(str(out))
    assert _value(out) == 1.0 and sorted(os.listdir(tmp_path)) == ["out"]
    monkeypatch.setattr(_outputs, "_exchange", lambda a, b: False)  # the fallback path
    _write(out, 2.0)
    assert _value(out) == 2.0 and sorted(os.listdir(tmp_path)) == ["out"]


def test_library_writers_refuse_foreign_directories(tmp_path):
    from moejax.interop import hf

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    tensors = {"a": np.ones(2, np.float32)}
    with pytest.raises(CheckpointError, match="notes.txt"):
        hf.save_safetensors(tmp_path / "mine", tensors, overwrite=True)
    with pytest.raises(CheckpointError, match="notes.txt"):
        save_converted(str(tmp_path / "mine"), MICRO, _params(1.0), {}, "micro", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["mine"]
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


def test_a_full_disk_during_a_conversion_is_one_line_and_keeps_the_earlier_output(
    hf_dirs, tmp_path, capsys, monkeypatch
):
    """The probe's full disk during `to-orbax` (105 lines of orbax tracebacks before the
    message): orbax's save failing with tensorstore's RESOURCE_EXHAUSTED (errno 28) is one
    line, exit 2; the earlier output is unchanged and no temporary copy is left."""
    import orbax.checkpoint as ocp

    out = tmp_path / "conv"
    args = ["to-orbax", str(hf_dirs / "mixtral"), str(out), "--no-progress", "--overwrite"]
    assert convert_hf.main(args) == 0
    capsys.readouterr()

    def full_disk(self, *args, **kwargs):
        raise ValueError(
            'RESOURCE_EXHAUSTED: Error writing "final_norm.scale/0" in OCDBT database: Failed '
            "to write 759 bytes to file 16: No space left on device [os_error_code='28']"
        )

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", full_disk)
    before = _snapshot(tmp_path)
    assert convert_hf.main(args) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: in {str(out)!r}: no space left on device writing the converted model; the "
        "earlier output is unchanged (free space and rerun)\n"
    )
    assert _snapshot(tmp_path) == before
    assert sorted(os.listdir(tmp_path)) == ["conv"]


def test_a_read_only_earlier_output_is_refused_before_the_swap(hf_dirs, tmp_path, capsys,
                                                               monkeypatch):  # fmt: skip
    """`--overwrite` onto a read-only earlier output swapped the new one in, then failed
    deleting the old one (Permission denied), and on every later write to the path. Now refused
    before anything is written, naming the read-only directory. As root (CI containers) chmod
    does not stop root's writes, so `os.access` answers as a non-root user would."""
    out = tmp_path / "conv"
    args = ["to-orbax", hf_dirs / "mixtral", out, "--overwrite"]
    assert convert_hf.main([*map(str, args), "--no-progress"]) == 0
    os.chmod(out / "params", 0o555)
    try:
        if os.geteuid() == 0:
            real_access = os.access

            def access(path, mode):
                if mode & os.W_OK and not os.stat(path).st_mode & 0o200:
                    return False
                return real_access(path, mode)

            monkeypatch.setattr(_outputs.os, "access", access)
        _refused(capsys, args, says="params read-only; make it writable", keep=tmp_path)
    finally:
        os.chmod(out / "params", 0o755)
    assert sorted(os.listdir(tmp_path)) == ["conv"]


def test_an_output_directory_takes_the_umask_default_not_0700(hf_dirs, tmp_path):
    """The output was written through `tempfile.mkdtemp` (mode 0700) and swapped in: the
    converted directory was private while every file inside followed the umask (0644). Now the
    directory has the umask's default too (0755 under umask 022, 0750 under 027)."""
    for mask in (0o022, 0o027):
        old = os.umask(mask)
        try:
            out = tmp_path / f"conv-{mask:o}"
            args = ["to-orbax", str(hf_dirs / "mixtral"), str(out), "--no-progress"]
            assert convert_hf.main(args) == 0
        finally:
            os.umask(old)
        assert os.stat(out).st_mode & 0o777 == 0o777 & ~mask
        assert os.stat(out / "model.json").st_mode & 0o777 == 0o666 & ~mask
