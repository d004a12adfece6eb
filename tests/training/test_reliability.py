"""Issue 19: checksummed checkpoints and their fallback (fault injection into real micro
checkpoints), guarded rotation, torn run files, SIGINT, skipped steps, and train_lm's flags.

Checkpoints here are written by `Checkpointer` from real micro `TrainState`s (no training);
the three runs through `train_lm.main` (in-process) reuse the micro step program of the other
training tests, so the compilation cache serves them."""

import dataclasses
import glob
import json
import os
import shutil
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from _helpers import MODEL, TRAIN, assert_trees_equal, corpus, finished_steps, host_tree, mesh

from moejax.cli import train_inputs, train_lm
from moejax.data import BatchIterator
from moejax.models import presets
from moejax.training import (
    Checkpointer,
    CheckpointError,
    abstract_state,
    init_train_state,
    loop,
    state_shardings,
)
from moejax.training import presets as train_presets
from moejax.training.checkpoint import CorruptCheckpoint, leaf_name, restore_target
from moejax.training.metrics import MetricsFileError, MetricsWriter, read_records

# Failing orbax restores leave tensorstore callbacks on a closed event loop (harmless).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

CORPUS_BYTES = "200000"  # _helpers.CORPUS_BYTES: the data state below is for that corpus


def _data_state(steps: int) -> dict:
    tokens, _ = corpus().split(TRAIN.eval_fraction)
    it = BatchIterator(tokens, TRAIN.batch_size, MODEL.max_seq_len, seed=TRAIN.seed)
    for _ in range(steps):
        it.next()
    return it.state()


def _at(state, step: int, shift: float = 0.0):
    """`state` at `step`, its parameters shifted (so that every checkpoint differs)."""
    params = jax.tree.map(lambda x: x + shift, state.params)
    return dataclasses.replace(state, step=jnp.asarray(step, jnp.int32), params=params)


def _save(directory, state, steps, *, keep=3, shift=True):
    ck = Checkpointer(str(directory), MODEL, TRAIN, keep=keep)
    for step in steps:
        ck.save(
            _at(state, step, float(step) if shift else 0.0),
            data_state=_data_state(step),
            placements=[],
            mesh=mesh(),
        )
    ck.close()


def _target():
    return restore_target(abstract_state(MODEL, TRAIN), state_shardings(MODEL, TRAIN, mesh()))


def _restore_latest(directory, lines=None):
    ck = Checkpointer(str(directory), MODEL, TRAIN)
    try:
        return ck.restore_latest(_target(), log=(lines if lines is not None else []).append)
    finally:
        ck.close()


@pytest.fixture(scope="module")
def mesh_state():
    return init_train_state(MODEL, TRAIN, mesh())


@pytest.fixture(scope="module")
def saved(tmp_path_factory, mesh_state):
    """Micro checkpoints 2, 4, 6, 8 written with keep=3: rotation left 4, 6, 8."""
    directory = tmp_path_factory.mktemp("saved") / "checkpoints"
    _save(directory, mesh_state, (2, 4, 6, 8))
    return directory


@pytest.fixture
def ckpts(saved, tmp_path):
    copy = tmp_path / "run" / "checkpoints"
    shutil.copytree(saved, copy)
    return copy


def _data_files(step_dir):
    return sorted(glob.glob(f"{step_dir}/state/**/d/*", recursive=True), key=os.path.getsize)


def _flip(path, count=64):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        chunk = f.read(count)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


def _truncate(path, size=3):
    with open(path, "r+b") as f:
        f.truncate(size)


def test_rotation_kept_the_newest_three(saved):
    assert sorted(os.listdir(saved)) == ["4", "6", "8"]


def _changed_arrays(ckpts, step, want) -> list[str] | None:
    """Names of the arrays of checkpoint `step` that differ from `want`, read straight from
    orbax without any check (None: orbax itself cannot read them)."""
    raw = ocp.CheckpointManager(str(ckpts), item_names=("state",))
    target = dataclasses.asdict(_target())
    try:
        got = raw.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    except Exception:
        return None
    finally:
        raw.close()
    flat = jax.tree_util.tree_flatten_with_path(host_tree(got["state"]))[0]
    wanted = jax.tree.leaves(host_tree(dataclasses.asdict(want)))
    return [
        leaf_name(p) for (p, a), b in zip(flat, wanted, strict=True) if not np.array_equal(a, b)
    ]


def _tamper(ckpts, step, mutate):
    """Rewrite checkpoint `step`'s state through orbax as `mutate(state dict)`, keeping its
    metadata and checksums: corruption that orbax itself reads back without complaint."""
    args = ocp.args
    raw = ocp.CheckpointManager(str(ckpts), item_names=("state", "meta", "checksums"))
    items = raw.restore(
        step,
        args=args.Composite(
            state=args.StandardRestore(dataclasses.asdict(_target())),
            meta=args.JsonRestore(),
            checksums=args.JsonRestore(),
        ),
    )
    shutil.rmtree(ckpts / str(step))
    raw.reload()
    raw.save(
        step,
        args=args.Composite(
            state=args.StandardSave(mutate(items["state"])),
            meta=args.JsonSave(items["meta"]),
            checksums=args.JsonSave(items["checksums"]),
        ),
        force=True,
    )
    raw.wait_until_finished()
    raw.close()


def _one_wrong_weight(state: dict) -> dict:  # the issue's -1.9e30 in layers[1] w_up
    experts = state["params"]["layers"][1]["moe"]["experts"]
    experts["w_up"] = experts["w_up"].at[3, 5, 7].set(-1.9e30)
    return state


def test_fault_injection_flipped_and_truncated_fall_back_to_the_newest_intact(ckpts, mesh_state):
    _flip(_data_files(ckpts / "8")[-1])  # 64 bytes inside the (compressed) tensor data
    for path in _data_files(ckpts / "6"):
        _truncate(path)
    # What the flip did depends on where it lands in the compressed stream: wrong values that
    # orbax reads without complaint, or a stream it cannot decode. Both must be caught.
    changed = _changed_arrays(ckpts, 8, _at(mesh_state, 8, 8.0))
    assert changed != [], "the flip must change some array"
    ck = Checkpointer(str(ckpts), MODEL, TRAIN)
    with pytest.raises(CorruptCheckpoint) as err:
        ck.restore(8, _target())
    ck.close()
    if changed is None:
        assert f"checkpoint {ckpts}/8: array data cannot be read (" in str(err.value)
    else:
        assert f"checkpoint {ckpts}/8: array {changed[0]} fails its checksum" in str(err.value)

    lines = []
    restored = _restore_latest(ckpts, lines)
    assert restored.step == 4 and restored.verified
    assert_trees_equal(restored.state, _at(mesh_state, 4, 4.0))
    assert restored.meta["data"] == _data_state(4)
    assert lines == list(restored.skipped) and len(lines) == 2
    assert str(err.value) in lines[0] and lines[0].endswith("moved aside to 8.corrupt")
    assert "/6: array data cannot be read (" in lines[1] and "<bound method" not in lines[1]
    assert sorted(os.listdir(ckpts)) == ["4", "6.corrupt", "8.corrupt"]  # skipped, not deleted


def test_one_wrong_weight_that_orbax_reads_fine_is_named(ckpts, mesh_state):
    _tamper(ckpts, 8, _one_wrong_weight)
    assert _changed_arrays(ckpts, 8, _at(mesh_state, 8, 8.0)) == [
        "params.layers[1].moe.experts.w_up"
    ]
    lines = []
    assert _restore_latest(ckpts, lines).step == 6
    assert lines == [
        f"skipped checkpoint {ckpts}/8: array params.layers[1].moe.experts.w_up fails its "
        "checksum; moved aside to 8.corrupt"
    ]


def _meta_without(key):
    def corrupt(step_dir):
        path = step_dir / "meta" / "metadata"
        meta = json.loads(path.read_text())
        del meta[key]
        path.write_text(json.dumps(meta))

    return corrupt


def _old_format_without(key):  # written before checksums: the keys are checked instead
    def corrupt(step_dir):
        shutil.rmtree(step_dir / "checksums")
        _meta_without(key)(step_dir)

    return corrupt


def _all_data_truncated(step_dir):
    for path in _data_files(step_dir):
        _truncate(path)


def _checksums_torn(step_dir):
    _truncate(step_dir / "checksums" / "metadata", 10)


@pytest.mark.parametrize(
    "corrupt,reason",
    [
        (_meta_without("data"), "/8: metadata fails its checksum"),
        (_old_format_without("data"), "/8: metadata lacks ['data']"),
        (_all_data_truncated, "/8: array data cannot be read"),
        (_checksums_torn, "/8: checksums unreadable"),
    ],
)
def test_each_kind_of_damage_to_the_newest_is_skipped(ckpts, corrupt, reason):
    corrupt(ckpts / "8")
    lines = []
    restored = _restore_latest(ckpts, lines)
    assert restored.step == 6 and len(lines) == 1 and reason in lines[0], lines


def test_an_empty_newer_step_directory_is_skipped(ckpts):
    (ckpts / "12").mkdir()
    lines = []
    restored = _restore_latest(ckpts, lines)
    assert restored.step == 8 and "/12: no readable metadata" in lines[0]
    assert sorted(os.listdir(ckpts)) == ["12.corrupt", "4", "6", "8"]


def test_no_intact_checkpoint_names_every_step_and_touches_nothing(ckpts):
    for step in ("4", "6", "8"):
        _all_data_truncated(ckpts / step)
    before = sorted(os.listdir(ckpts))
    with pytest.raises(CheckpointError) as err:
        _restore_latest(ckpts)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"no intact checkpoint in {ckpts}")
    assert "tried steps 8, 6, 4:" in message and "remove those step directories" in message
    assert sorted(os.listdir(ckpts)) == before


def test_rotation_never_deletes_older_checkpoints_while_the_newest_fails(
    tmp_path, mesh_state, capsys
):
    ck = Checkpointer(str(tmp_path / "c"), MODEL, TRAIN, keep=2)
    kw = dict(placements=[], mesh=mesh(), wait=True)
    for step in (2, 4, 6):
        ck.save(_at(mesh_state, step), data_state=_data_state(step), **kw)
    for path in _data_files(tmp_path / "c" / "6"):  # step 6 goes bad on disk after its save
        _truncate(path)
    ck.save(_at(mesh_state, 8), data_state=_data_state(8), **kw)  # rotation reads 6 back first
    assert ck.all_steps() == [2, 4, 6, 8]  # nothing deleted: 6 did not verify
    assert "keeping older checkpoints: the newest fails verification" in capsys.readouterr().err
    ck.close()  # 8 verifies: now the older ones may go
    assert sorted(os.listdir(tmp_path / "c")) == ["6", "8"]


def test_rotation_keeps_a_step_holding_a_users_file(tmp_path, mesh_state, capsys):
    """A file a user put into an old step directory (beside orbax's items) went with it at
    rotation; now the step is kept past --keep, said once, and rotates once the file is gone."""
    ck = Checkpointer(str(tmp_path / "c"), MODEL, TRAIN, keep=1)
    kw = dict(placements=[], mesh=mesh(), wait=True)
    ck.save(_at(mesh_state, 2), data_state=_data_state(2), **kw)
    notes = tmp_path / "c" / "2" / "notes.txt"
    notes.write_text("the run diverged after this one\n")
    for step in (4, 6):
        ck.save(_at(mesh_state, step), data_state=_data_state(step), **kw)
    assert ck.all_steps() == [2, 4, 6]
    assert notes.read_text() == "the run diverged after this one\n"
    err = capsys.readouterr().err
    assert err.count("keeping checkpoint") == 1 and "c/2 past --keep" in err, err
    os.remove(notes)
    ck.close()
    assert sorted(os.listdir(tmp_path / "c")) == ["6"]


def test_symlinked_step_directory_is_refused(ckpts, tmp_path):
    shutil.move(ckpts / "8", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", ckpts / "8")
    with pytest.raises(CheckpointError, match=r"checkpoints/8 is a symlink: rotation would"):
        Checkpointer(str(ckpts), MODEL, TRAIN)


def _records(steps):
    return "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)


def test_torn_metrics_line_is_dropped_by_replacing_the_file(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_records([1, 2, 3]) + '{"step": 4, "lo')
    with pytest.warns(UserWarning, match="dropped a torn last record"):
        assert [r["step"] for r in read_records(path)] == [1, 2, 3]
    inode = os.stat(path).st_ino
    writer = MetricsWriter(str(tmp_path), keep_up_to=3, tensorboard=False)
    writer.write({"step": 4, "loss": 0.5})
    writer.close()
    assert "dropped a torn last record (line 4" in capsys.readouterr().err
    assert os.stat(path).st_ino != inode  # a new file renamed over it, not rewritten in place
    assert path.read_text() == _records([1, 2, 3]) + json.dumps({"step": 4, "loss": 0.5}) + "\n"
    inode = os.stat(path).st_ino  # nothing to drop: appended to, in place
    MetricsWriter(str(tmp_path), keep_up_to=4, tensorboard=False).close()
    assert os.stat(path).st_ino == inode


def test_metrics_damaged_before_the_last_line_is_an_input_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_records([1]) + "garbage\n" + _records([3]))
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl line 2 is not a metrics record"):
        read_records(path)
    assert issubclass(MetricsFileError, CheckpointError)  # train_lm: one line, exit 2


# --- train_lm.py ------------------------------------------------------------------------------


def _main(capsys, out, *args):
    base = ["--preset", "micro", "--out", str(out), "--no-progress", "--max-bytes", CORPUS_BYTES]
    code = train_lm.main([*base, *args])
    printed = capsys.readouterr()
    return code, printed.out, printed.err.strip()


def _symlinked_step(out):
    (out / "checkpoints").mkdir(parents=True)
    (out.parent / "elsewhere").mkdir()
    os.symlink(out.parent / "elsewhere", out / "checkpoints" / "4")


def _torn_metrics_mid_file(out):
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "lo\n' + _records([2]))


def _foreign_out(out):
    out.mkdir(parents=True)
    (out / "thesis.tex").write_text("\\chapter{Results}")


BAD_FLAGS = [  # (args, setup of the out directory, expected in the one line)
    (["--implementation", "foo"], None, "--implementation='foo': must be one of auto, "),
    (["--stop-at", "-1"], None, "--stop-at=-1: must be a step >= 1 (omit it to train all"),
    (["--stop-at", "0"], None, "--stop-at=0: must be a step >= 1"),
    (["--stop-at", "9"], None, "--stop-at=9: beyond the schedule's 8 steps (--steps); need a"),
    (["--max-bytes", "0"], None, "--max-bytes=0: must be >= 1"),
    (["--keep", "0"], None, "--keep: TrainConfig.keep_checkpoints=0: must be a positive int"),
    (["--checkpoint-every", "-1"], None, "--checkpoint-every: TrainConfig.checkpoint_every=-1"),
    (["--lr", "nan"], None, "--lr: TrainConfig.learning_rate=nan: must be a finite number > 0"),
    (["--max-skipped-fraction", "2"], None, "--max-skipped-fraction: TrainConfig.max_skipped"),
    (["--eval-batches", "-2"], None, "--eval-batches: TrainConfig.eval_batches=-2"),
    (["--process-id", "1"], None, "--process-id=1: must lie in 0..0 (--num-processes=1)"),
    (["--num-processes", "0"], None, "--num-processes=0: must be >= 1"),
    (["--tune-steps", "0"], None, "--tune-steps: TuningConfig.repeats=0: must be a positive int"),
    (["--mesh-axes", "data,bogus"], None, "--mesh-axes=data,bogus: axis_names=('data', 'bogus')"),
    ([], _symlinked_step, "checkpoints/4 is a symlink: rotation would delete what it points to"),
    ([], _torn_metrics_mid_file, "metrics.jsonl line 1 is not a metrics record"),
    (["--expert-slots", "0"], None, "--expert-slots=0: must be >= 1 (omit it: no placement"),
    (["--placement", "--expert-slots", "0"], None, "--expert-slots=0: must be >= 1"),
    ([], _foreign_out, "--out: run directory"),  # ... holds files moejax did not write
]


@pytest.mark.parametrize("args,setup,message", BAD_FLAGS)
def test_bad_flags_are_one_line_errors_before_anything_is_written(
    capsys, tmp_path, args, setup, message
):
    out = tmp_path / "run"
    if setup is not None:
        setup(out)
    before = sorted(os.listdir(out)) if out.exists() else None
    code, _, err = _main(capsys, out, *args)
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert message in err
    assert (sorted(os.listdir(out)) if out.exists() else None) == before


def test_out_that_is_a_file(capsys, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    code, _, err = _main(capsys, target)
    assert (code, err) == (
        2,
        f"error: --out={target}: exists and is not a directory; need a directory",
    )
    assert target.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_out_in_a_read_only_directory(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    code, _, err = _main(capsys, locked / "run")
    assert code == 2 and f"--out={locked}/run: would be created in {locked}, which is not" in err
    code, _, err = _main(capsys, locked)
    assert code == 2 and f"--out={locked}: is not writable; need a writable directory" in err
    assert os.listdir(locked) == []


@pytest.mark.parametrize(
    "args,message",
    [
        (["--steps", "abc"], "error: argument --steps: invalid int value: 'abc' (see --help)"),
        (["--remat", "some"], "error: argument --remat: invalid choice: 'some'"),
    ],
)
def test_argparse_errors_are_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        train_lm.parse_args(args)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err and err.startswith(message)


def test_help_shows_every_default():
    parser = train_lm.build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert "(default" in formatter._expand_help(action), action.option_strings
    text = parser.format_help()
    assert (
        "(default: 2,4; data=8 for a dense preset" in text
        and "(default: tiny)" in text
        and "(default: off)" in text
    )


def test_small_preset_warns_of_its_cpu_run_time():
    def warning(name):
        args = train_lm.parse_args(["--preset", name])
        return train_inputs.cpu_warning(presets.get(name), train_presets.get(name), args)

    small = warning("small")
    assert small.startswith("warning: --preset small on CPU: 2000 steps of 32 x 256 tokens")
    assert "about 13 s a step on a 2-core machine, 7 h in all (estimated" in small
    assert warning("tiny") is None and warning("micro") is None


def test_resume_falls_back_past_a_corrupt_checkpoint_and_says_so(capsys, tmp_path, mesh_state):
    out = tmp_path / "run"
    _save(out / "checkpoints", mesh_state, (4, 6), shift=False)
    _tamper(out / "checkpoints", 6, _one_wrong_weight)
    (out / "metrics.jsonl").write_text('{"step": 1, "lo')  # torn by the "crash"
    code, _, err = _main(capsys, out, "--no-outputs", "--eval-batches", "0")
    assert code == 0, err
    assert "/6: array params.layers[1].moe.experts.w_up fails its checksum; moved aside" in err
    assert "dropped a torn last record (line 1" in err
    assert f"resumed from checkpoint step 4 ({out}/checkpoints/4)" in err
    assert [r["step"] for r in read_records(out / "metrics.jsonl")] == [5, 6, 7, 8]
    assert sorted(os.listdir(out / "checkpoints")) == ["4", "6.corrupt", "8"]


def test_skipped_steps_are_reported_and_too_many_fail_the_run(capsys, tmp_path, mesh_state):
    out = tmp_path / "run"
    state = _at(mesh_state, 4)
    layer = state.params["layers"][1]["moe"]["experts"]
    broken = {**layer, "w_up": layer["w_up"].at[0, 0, 0].set(jnp.inf)}  # every loss: non-finite
    params = {
        **state.params,
        "layers": [
            *state.params["layers"][:1],
            {
                **state.params["layers"][1],
                "moe": {**state.params["layers"][1]["moe"], "experts": broken},
            },
        ],
    }
    ck = Checkpointer(str(out / "checkpoints"), MODEL, TRAIN)
    ck.save(
        dataclasses.replace(state, params=params),
        data_state=_data_state(4),
        placements=[],
        mesh=mesh(),
    )
    ck.close()
    code, _, err = _main(capsys, out, "--no-outputs", "--eval-batches", "0")
    assert code == 2 and err.splitlines()[-1] == (  # resuming from an Inf weight: refused
        f"error: checkpoint {out}/checkpoints/4: array params.layers[1].moe.experts.w_up: 1 of "
        "8192 values are NaN or Inf; pass --allow-nonfinite to accept it"
    )
    code, _, err = _main(capsys, out, "--no-outputs", "--eval-batches", "0", "--allow-nonfinite")
    assert code == 3
    assert "step 5 skipped: loss nan, grad norm nan not finite, update dropped (1 skipped" in err
    assert err.splitlines()[-1] == (
        "error: run failed: 2 of 6 steps skipped (non-finite loss or gradient), more than "
        "TrainConfig.max_skipped_fraction=0.1"
    )
    records = read_records(out / "metrics.jsonl")
    assert [(r["step"], r["skipped"]) for r in records] == [(5, True), (6, True)]
    assert sorted(os.listdir(out / "checkpoints")) == ["4", "6"]  # stopped early, saved


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_saves_writes_outputs_and_exits_cleanly(capfd, tmp_path, monkeypatch):
    real = loop.step_record

    def record_then_interrupt(step, *args, **kwargs):  # Ctrl-C while step 3 is recorded
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(step, *args, **kwargs)

    monkeypatch.setattr(loop, "step_record", record_then_interrupt)
    out = tmp_path / "run"
    code, printed, err = _main(capfd, out, "--eval-batches", "0")  # the handler writes to fd 2
    assert code == 0, err
    assert "SIGINT: finishing the step in flight, then saving a checkpoint" in err
    assert "stopped by SIGINT: checkpoint of step 4 saved" in printed
    assert "Traceback" not in err
    assert [r["step"] for r in read_records(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert os.listdir(out / "checkpoints") == ["4"]
    assert (out / "loss.png").exists() and np.load(out / "routing_trace.npy").shape[0] == 4


def test_a_full_disk_writing_a_checkpoint_is_one_line_and_the_older_ones_stay(
    capsys, tmp_path, monkeypatch
):
    """The probe's full disk during training: orbax's save of step 8 fails with tensorstore's
    RESOURCE_EXHAUSTED (errno 28), which printed 458 lines of tracebacks. Now one line naming
    the directory, the step and the newest intact checkpoint, exit 2; step 4 is intact and a
    rerun with the same --out resumes from it."""
    import orbax.checkpoint as ocp

    real_save = ocp.CheckpointManager.save

    def full_disk(self, step, *args, **kwargs):
        if step == 8:
            raise ValueError(
                'RESOURCE_EXHAUSTED: Error writing "params.final_norm.scale/0" in OCDBT database: '
                "Failed to write 759 bytes to file 16: No space left on device "
                "[os_error_code='28']"
            )
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    out = tmp_path / "run"
    code, _, err = _main(capsys, out, "--steps", "12", "--checkpoint-every", "4", "--no-outputs")
    assert code == 2, err
    ckpts = out / "checkpoints"
    assert err.splitlines()[-1] == (
        f"error: {ckpts}: no space left on device writing checkpoint step 8; the newest intact "
        "checkpoint is step 4 (free space and rerun with the same --out to resume)"
    ), err
    assert "Traceback" not in err
    assert sorted(os.listdir(ckpts)) == ["4"]
    monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
    code, _, err = _main(capsys, out, "--steps", "12", "--checkpoint-every", "4", "--no-outputs")
    assert code == 0, err
    assert "resumed from checkpoint step 4" in err
    assert finished_steps(ckpts)[-1] == 12


def test_a_full_disk_writing_the_records_is_one_line(tmp_path, monkeypatch):
    """metrics.jsonl's append failing with ENOSPC: `OutputWriteError` naming the file and step
    (train_lm prints it in one line, exit 2), not an OSError traceback."""
    import errno

    from moejax._disk import OutputWriteError
    from moejax.training.metrics import MetricsWriter

    writer = MetricsWriter(str(tmp_path), tensorboard=False)

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            pass

    writer._file = Full()
    with pytest.raises(OutputWriteError, match="metrics.jsonl: no space left on device writing "
                       "the record of step 3"):  # fmt: skip
        writer.write({"step": 3, "loss": 1.0})
