"""Hostile and damaged checkpoint files: each is refused with one clear `CheckpointError` by the
library (`load_hf_model`, `SafetensorsCheckpoint`) and one line plus exit 2 by
`moejax.cli.convert_hf`, before anything is written or sized from the file.

The files are built here byte by byte: safetensors headers with overlapping, negative or
out-of-range `data_offsets`, wrong types, unknown dtypes; indexes naming shards outside the
directory; config.json files of the wrong types or with counts that no file holds."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import time

import _hf_decoder_reference as ref
import numpy as np
import pytest

from moejax.cli import convert_hf
from moejax.interop import hf
from moejax.interop.hf import _model, load_hf_model

CONFIG = ref.CONFIGS["mixtral"]


def _raw(header, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file: 8-byte header length, the header (JSON of `header`, or bytes), data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def _f32(offsets, shape=(2,)) -> dict:
    return {"dtype": "F32", "shape": list(shape), "data_offsets": list(offsets)}


_DATA = np.arange(4, dtype=np.float32).tobytes()  # 16 bytes: two [2] float32 tensors
_GOOD = {"a": _f32([0, 8]), "b": _f32([8, 16])}


def _single(header, data=_DATA, **kw):
    """A checkpoint directory whose one `model.safetensors` is `_raw(header, data)`."""

    def build(path):
        (path / "model.safetensors").write_bytes(_raw(header, data, **kw))

    return build


def _indexed(index, shards=None):
    """A directory with `index` as model.safetensors.index.json (text or JSON) and shards."""

    def build(path):
        text = index if isinstance(index, str) else json.dumps(index)
        (path / "model.safetensors.index.json").write_text(text)
        shards_ = {"s1.safetensors": _raw(_GOOD, _DATA)} if shards is None else shards
        for name, content in shards_.items():
            (path / name).write_bytes(content)

    return build


def _outside_shard(path):
    """The index names an intact safetensors file outside the checkpoint, by absolute path."""
    outside = path.parent / f"{path.name}-outside.safetensors"
    outside.write_bytes(_raw(_GOOD, _DATA))
    _indexed({"weight_map": {"a": str(outside)}})(path)


def _dotdot_shard(path):
    outside = path.parent / f"{path.name}-outside.safetensors"
    outside.write_bytes(_raw(_GOOD, _DATA))
    _indexed({"weight_map": {"a": f"../{outside.name}"}})(path)


def _symlinked_shard(path):
    outside = path.parent / f"{path.name}-outside.safetensors"
    outside.write_bytes(_raw(_GOOD, _DATA))
    _indexed({"weight_map": {"a": "s1.safetensors"}}, shards={})(path)
    os.symlink(outside, path / "s1.safetensors")


def _directory_shard(path):
    _indexed({"weight_map": {"a": "s1.safetensors"}}, shards={})(path)
    (path / "s1.safetensors").mkdir()


def _fifo_shard(path):
    _indexed({"weight_map": {"a": "s1.safetensors"}}, shards={})(path)
    os.mkfifo(path / "s1.safetensors")  # opening it blocking would hang the reader


_NAN = np.array([1.0, np.nan], np.float32).tobytes() + np.ones(2, np.float32).tobytes()

# (case id, builder, what the one line must say)
WEIGHT_CASES = [
    ("under 8 bytes", lambda p: (p / "model.safetensors").write_bytes(b"\x01\x02"),
     "under 8 bytes"),
    ("header length past the end", _single(_GOOD, length=10**6), "past the end of the file"),
    ("header not JSON", _single(b"{not json"), "header is not valid JSON"),
    ("header a list", _single([1, 2]), "header is a JSON list"),
    ("header nested too deeply", _single(b"[" * 100_000), "not valid JSON"),
    ("header with NaN", _single(b'{"a": NaN}'), "NaN is not JSON"),
    ("duplicate tensor name", _single(b'{"a": 1, "a": 2}'), "'a' appears twice"),
    ("entry not an object", _single({"a": 5}), "tensor 'a'.*JSON int, need an object"),
    ("missing data_offsets", _single({"a": {"dtype": "F32", "shape": [2]}}), "lacks"),
    ("unknown dtype", _single({"a": {**_f32([0, 8]), "dtype": "Q7"}}), "dtype 'Q7' unknown"),
    ("negative dim", _single({"a": _f32([0, 8], shape=(-2,))}), "need a list of ints >= 0"),
    ("bool dim", _single({"a": _f32([0, 8], shape=(True, 2))}), "need a list of ints"),
    ("float offsets", _single({"a": _f32([0.0, 8.0])}), "need \\[begin, end\\], two ints"),
    ("three offsets", _single({"a": _f32([0, 8, 16])}), "need \\[begin, end\\]"),
    ("negative offsets", _single({"a": _f32([-8, 0]), "b": _f32([8, 16])}), "outside the"),
    ("offsets past the data", _single({"a": _f32([8, 16]), "b": _f32([16, 24])}), "outside"),
    ("offsets cover the wrong size", _single({"a": _f32([0, 12]), "b": _f32([12, 16])}), "span"),
    ("overlapping offsets", _single({"a": _f32([0, 8]), "b": _f32([0, 8])}, _DATA[:8]),
     "tensor 'b'.*overlaps"),
    ("gap between tensors", _single({"a": _f32([0, 8]), "b": _f32([12, 20])}, _DATA + b"\0" * 4),
     "leaves 4 bytes"),
    ("bytes after the last tensor", _single(_GOOD, _DATA + b"\0" * 8), "8 bytes after"),
    ("metadata not strings", _single({**_GOOD, "__metadata__": {"format": 1}}), "__metadata__"),
    ("index not JSON", _indexed("{weight_map"), "index is not valid JSON"),
    ("index a list", _indexed([1]), "weight_map"),
    ("index without weight_map", _indexed({"metadata": {}}), "weight_map"),
    ("weight_map a list", _indexed({"weight_map": ["s1.safetensors"]}), "weight_map"),
    ("shard name not a string", _indexed({"weight_map": {"a": 5}}), "plain file name"),
    ("shard outside by ..", _dotdot_shard, "plain file name"),
    ("shard outside by absolute path", _outside_shard, "plain file name"),
    ("shard a symlink leaving the directory", _symlinked_shard, "outside the checkpoint"),
    ("shard a directory", _directory_shard, "is a directory"),
    ("shard a FIFO", _fifo_shard, "not a regular file"),
    ("shard missing", _indexed({"weight_map": {"a": "s9.safetensors"}}), "s9.*missing"),
    ("tensor not in its shard", _indexed({"weight_map": {"c": "s1.safetensors"}}),
     "tensor 'c'.*not in the file"),
]  # fmt: skip


def _config(change=None, drop=()):
    def build(path):
        config = {k: v for k, v in {**CONFIG, **(change or {})}.items() if k not in drop}
        (path / "config.json").write_text(json.dumps(config))

    return build


CONFIG_CASES = [
    ("config a list", lambda p: (p / "config.json").write_text("[1, 2]"), "JSON list"),
    ("config not JSON", lambda p: (p / "config.json").write_text("{"), "not valid JSON"),
    ("config a directory", lambda p: (p / "config.json").mkdir(), "is a directory"),
    ("config missing", lambda p: None, "config.json.*missing"),
    ("num_attention_heads 0", _config({"num_attention_heads": 0}), "num_attention_heads=0"),
    ("hidden_size a string", _config({"hidden_size": "32"}), "hidden_size='32'"),
    ("num_experts 10**8", _config({"num_local_experts": 10**8}), "over moejax's cap"),
    ("num_hidden_layers 10**7", _config({"num_hidden_layers": 10**7}), "over moejax's cap"),
    ("rope_scaling a list", _config({"rope_scaling": [2.0]}), "rope_scaling=.*need an object"),
    ("rms_norm_eps a word", _config({"rms_norm_eps": "tiny"}), "config.json"),
    ("more layers than the files hold", _config({"num_hidden_layers": 4000}),
     "num_hidden_layers=4000.*name 2 layers"),
    ("more experts than the files hold", _config({"num_local_experts": 60000}),
     "60000 experts.*holds 4"),
    ("heads that do not divide", _config({"num_key_value_heads": 3}), "config.json"),
    ("vocab_size missing", _config(drop=("vocab_size",)), "'vocab_size' missing"),
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A valid tiny Mixtral checkpoint (config.json + 2 shards) that config cases start from."""
    path = tmp_path_factory.mktemp("mixtral")
    ref.write_checkpoint(str(path), CONFIG, ref.random_state_dict(CONFIG), shards=2)
    return path


def _build(tmp_path, model_dir, build, config_case: bool):
    path = tmp_path / "ck"
    if config_case:
        shutil.copytree(model_dir, path)
        os.remove(path / "config.json")
    else:
        path.mkdir()
        (path / "config.json").write_text(json.dumps(CONFIG))
    build(path)
    return path


CASES = [(*c, False) for c in WEIGHT_CASES] + [(*c, True) for c in CONFIG_CASES]


@pytest.mark.parametrize(
    "build,message,config_case", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_hostile_file_is_one_clear_error(build, message, config_case, tmp_path, model_dir, capsys):
    path = _build(tmp_path, model_dir, build, config_case)
    with pytest.raises(hf.CheckpointError, match=message):
        load_hf_model(str(path))
    out = tmp_path / "out"
    code = convert_hf.main(["to-orbax", str(path), str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not out.exists()


def test_an_overlap_would_have_loaded_another_experts_bytes(tmp_path, model_dir):
    """The probe's finding: expert 1's offsets pointed at expert 0's bytes. Built from a real
    checkpoint, the reader now names the tensor instead of loading expert 0 twice."""
    path = tmp_path / "ck"
    shutil.copytree(model_dir, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    e0 = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    e1 = e0.replace("experts.0", "experts.1")
    assert index[e0] == index[e1]
    shard = path / index[e0]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header[e1]["data_offsets"] = header[e0]["data_offsets"]  # relative to the data: unmoved
    shard.write_bytes(_raw(header, raw[8 + n :]))
    with pytest.raises(hf.CheckpointError, match=rf"tensor '{e1}'.*overlaps"):
        hf.SafetensorsCheckpoint(path)


def test_counts_are_checked_before_any_name_list_is_built(tmp_path, model_dir, monkeypatch):
    """A config asking for more experts or layers than the files hold fails before the loader
    sizes anything from it (`model_recipes` would build `layers x experts` names), fast."""

    def never(*args, **kw):
        raise AssertionError("model_recipes called before the counts were checked")

    monkeypatch.setattr(_model, "model_recipes", never)
    for i, change in enumerate(({"num_local_experts": 60000}, {"num_hidden_layers": 4000})):
        (tmp_path / str(i)).mkdir()
        path = _build(tmp_path / str(i), model_dir, _config(change), True)
        start = time.perf_counter()
        with pytest.raises(hf.CheckpointError, match="the checkpoint"):
            load_hf_model(str(path))
        assert time.perf_counter() - start < 5.0


def test_nonfinite_weight_is_named_and_refused_unless_allowed(tmp_path, capsys, model_dir):
    path = tmp_path / "ck"
    shutil.copytree(model_dir, path)
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    sd = ref.random_state_dict(CONFIG)
    sd[name] = sd[name].copy()
    sd[name][0, :3] = [np.nan, np.inf, -np.inf]
    shutil.rmtree(path)
    ref.write_checkpoint(str(path), CONFIG, sd, shards=2)
    with pytest.raises(hf.NonFiniteError, match=rf"tensor '{name}'.*3 of 1536 values"):
        load_hf_model(str(path))
    out = tmp_path / "out"
    assert convert_hf.main(["to-orbax", str(path), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err and "--allow-nonfinite" in err
    args = ["to-orbax", str(path), str(out), "--no-progress", "--allow-nonfinite"]
    assert convert_hf.main(args) == 0
    _, params, _ = load_hf_model(str(path), allow_nonfinite=True)
    w_up = np.asarray(params["layers"][1]["moe"]["experts"]["w_up"])
    assert np.isnan(w_up[2, 0, 0]) and np.isinf(w_up[2, 1, 0])


def test_hub_cache_snapshot_symlinks_into_its_blobs_are_read(tmp_path):
    """A Hugging Face hub cache snapshot holds symlinks `snapshots/<rev>/<file>` ->
    `../../blobs/<hash>`: those stay inside the repository and are read."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_bytes(_raw(_GOOD, _DATA))
    os.symlink("../../blobs/f00d", snapshot / "model.safetensors")
    ckpt = hf.SafetensorsCheckpoint(snapshot)
    np.testing.assert_array_equal(ckpt["b"], [2.0, 3.0])


def test_bad_arguments_are_one_line(tmp_path, model_dir, capsys):
    for args in (
        ["to-orbax", str(model_dir / "config.json"), str(tmp_path / "a")],  # a file, not a dir
        ["to-orbax", str(tmp_path / "missing"), str(tmp_path / "b")],
        ["to-hf", str(model_dir), str(tmp_path / "c"), "--max-shard-gb", "nan"],
        ["to-hf", str(model_dir), str(tmp_path / "d"), "--max-shard-gb", "0"],
        ["to-hf", str(model_dir)],  # argparse: one line too
    ):
        with pytest.raises(SystemExit) if len(args) == 2 else contextlib.nullcontext():
            code = convert_hf.main([*args, "--no-progress"])
            assert code == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []
