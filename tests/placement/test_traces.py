"""Synthetic traces and the recorded-trace loader."""

import json

import numpy as np
import pytest

from moejax.placement import balanced, drifting_zipf, load_trace, save_trace, zipf
from moejax.placement.traces import zipf_exponent_for, zipf_probs


def test_shapes_sums_and_seeding():
    t = zipf(20, 8, 1000, s=1.0, num_layers=3, seed=4)
    assert t.shape == (20, 3, 8) and t.dtype == np.int64
    assert (t.sum(axis=2) == 1000).all()
    np.testing.assert_array_equal(t, zipf(20, 8, 1000, s=1.0, num_layers=3, seed=4))
    assert not np.array_equal(t, zipf(20, 8, 1000, s=1.0, num_layers=3, seed=5))


def test_zipf_is_skewed_and_balanced_is_not():
    z = zipf(200, 16, 10_000, s=1.2, seed=0)[:, 0].mean(axis=0)
    b = balanced(200, 16, 10_000, seed=0)[:, 0].mean(axis=0)
    assert z.max() / z.mean() > 3.0
    assert b.max() / b.mean() < 1.05
    # Sampling noise is present step to step.
    assert balanced(2, 16, 10_000, seed=0)[0, 0].std() > 0


def test_drifting_rotates_hot_set():
    t = drifting_zipf(400, 16, 20_000, s=1.5, shift_every=100, seed=0)[:, 0]
    hottest = [int(t[k * 100 : (k + 1) * 100].sum(axis=0).argmax()) for k in range(4)]
    assert len(set(hottest)) == 4  # a different hottest expert in each phase
    # Within a phase the distribution is stationary.
    assert int(t[0:50].sum(axis=0).argmax()) == int(t[50:100].sum(axis=0).argmax())


@pytest.mark.parametrize("e, ratio", [(16, 4.0), (128, 4.0), (4096, 2.5)])
def test_zipf_exponent_for_hits_target(e, ratio):
    s = zipf_exponent_for(e, ratio)
    assert zipf_probs(e, s)[0] * e == pytest.approx(ratio, rel=1e-6)
    with pytest.raises(ValueError, match="hot_ratio"):
        zipf_exponent_for(e, 0.5)


@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
def test_round_trip(tmp_path, suffix):
    trace = zipf(7, 6, 300, num_layers=2, seed=1)
    path = tmp_path / f"trace{suffix}"
    save_trace(path, trace)
    np.testing.assert_array_equal(load_trace(path), trace)


def test_load_training_formats(tmp_path):
    # .npy [steps, E] means one layer; .jsonl lines carry extra fields and blank lines.
    np.save(tmp_path / "one.npy", np.array([[1, 2, 3], [4, 5, 6]], np.int32))
    assert load_trace(tmp_path / "one.npy").shape == (2, 1, 3)
    lines = [
        {"step": 5, "loss": 1.0, "expert_counts": [[1, 2], [3, 4]]},
        {"step": 6, "expert_counts": [[0, 3], [2, 1]]},
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert load_trace(tmp_path / "t.jsonl").tolist() == [[[1, 2], [3, 4]], [[0, 3], [2, 1]]]


def test_loader_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"counts": [[1]]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: missing field 'expert_counts'"):
        load_trace(tmp_path / "bad.jsonl")
    np.save(tmp_path / "neg.npy", -np.ones((2, 1, 3)))
    with pytest.raises(ValueError, match="non-negative integer"):
        load_trace(tmp_path / "neg.npy")
    with pytest.raises(ValueError, match=r"\.npy or \.jsonl"):
        load_trace(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        zipf(0, 4, 10)
