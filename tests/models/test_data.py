"""Byte tokenizer, corpora (default and user files, with their errors), the batch iterator."""

import sysconfig

import numpy as np
import pytest

from moejax import data
from moejax.data import BatchIterator, DataError


def test_tokenizer_round_trip():
    text = "def f(x):\n    return 'é' * x\n"
    tokens = data.encode(text)
    assert tokens.dtype == np.int32 and tokens.max() < data.VOCAB_SIZE
    assert len(tokens) == len(text.encode()) and data.decode(tokens) == text


def test_default_corpus_is_the_sorted_stdlib_sources():
    corpus = data.default_corpus(max_bytes=200_000)
    again = data.default_corpus(max_bytes=200_000)
    np.testing.assert_array_equal(corpus.tokens, again.tokens)
    assert len(corpus.tokens) == 200_000
    files = data.stdlib_files()
    assert [f.name for f in files] == sorted(f.name for f in files)
    assert all(str(f).startswith(sysconfig.get_paths()["stdlib"]) for f in files)
    first = files[0].read_bytes()
    assert corpus.sources[0] == str(files[0])
    np.testing.assert_array_equal(corpus.tokens[: len(first)], np.frombuffer(first, np.uint8))
    assert corpus.tokens[len(first)] == data.DOC_SEPARATOR  # documents are NUL-separated


def test_user_text_dir_and_npy_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    sub = tmp_path / "d"
    sub.mkdir()
    (sub / "b.txt").write_text("world")
    (sub / ".hidden").write_text("skipped")
    np.save(tmp_path / "ids.npy", np.array([1, 2, 3], np.int64))
    corpus = data.load_corpus([tmp_path / "a.txt", sub, tmp_path / "ids.npy"])
    assert data.decode(corpus.tokens[:11]) == "hello\x00world"
    assert corpus.tokens[11:].tolist() == [0, 1, 2, 3]
    train, held_out = corpus.split(0.25)
    assert len(train) + len(held_out) == len(corpus.tokens) and len(held_out) == 3


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda p: p / "missing.txt", "no such file or directory"),
        (lambda p: _write(p / "e.txt", ""), "is empty"),
        (lambda p: (p / "d").mkdir() or p / "d", "directory has no files"),
        (lambda p: np.save(p / "f.npy", np.ones(3)) or p / "f.npy", "1-D integer"),
        (lambda p: np.save(p / "g.npy", np.array([1, 300])) or p / "g.npy", r"\[0, 256\)"),
        (lambda p: _write(p / "h.npy", "junk"), "not a readable .npy"),
        # The probe's silent NaN losses: each names the index and the value.
        (
            lambda p: np.save(p / "n.npy", np.array([1.0, 2.0, np.nan])) or p / "n.npy",
            r"index 2 holds nan; token ids must be whole numbers in \[0, 256\)",
        ),
        (lambda p: np.save(p / "m.npy", np.array([5, -1, 3])) or p / "m.npy", "index 1 holds -1"),
        (lambda p: np.save(p / "o.npy", np.array([5, 3, 256])) or p / "o.npy", "index 2 holds 256"),
        (lambda p: np.save(p / "q.npy", np.array([5.0, 3.5])) or p / "q.npy", "index 1 holds 3.5"),
    ],
)
def test_bad_corpus_is_a_one_line_error_naming_the_file(tmp_path, make, match):
    path = make(tmp_path)
    with pytest.raises(DataError, match=match) as err:
        data.load_corpus(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_iterator_windows_are_contiguous_and_cover_an_epoch_once():
    tokens = np.arange(1000)
    it = BatchIterator(tokens, batch_size=4, seq_len=10, seed=3)
    assert it.num_windows == 99 and it.batches_per_epoch == 24
    starts = []
    for _ in range(it.batches_per_epoch):
        batch = it.next()
        assert batch.shape == (4, 11)
        np.testing.assert_array_equal(batch, batch[:, :1] + np.arange(11))
        starts += (batch[:, 0] // 10).tolist()
    assert len(set(starts)) == 96  # 24 batches x 4 distinct windows; 3 left for other epochs
    assert starts != sorted(starts)  # shuffled
    assert it.epoch == 0
    it.next()
    assert it.epoch == 1  # the next batch starts a new, differently ordered epoch


def test_iterator_state_resumes_exactly_and_rejects_another_corpus():
    tokens = np.arange(500)
    it = BatchIterator(tokens, batch_size=4, seq_len=8, seed=1)
    for _ in range(17):  # into the second epoch (15 batches per epoch)
        it.next()
    state = it.state()
    expected = [it.next() for _ in range(20)]
    resumed = BatchIterator(tokens, batch_size=4, seq_len=8, seed=1)
    resumed.restore(state)
    for want in expected:
        np.testing.assert_array_equal(resumed.next(), want)
    other_seed = BatchIterator(tokens, batch_size=4, seq_len=8, seed=2)
    assert not np.array_equal(other_seed.next(), BatchIterator(tokens, 4, 8, seed=1).next())
    with pytest.raises(DataError, match="num_windows=62.*corpus or batch shape changed"):
        BatchIterator(np.arange(800), batch_size=4, seq_len=8).restore(state)


def test_corpus_smaller_than_one_batch_is_an_error():
    with pytest.raises(DataError, match="fewer than one batch of 4 windows of 9 tokens"):
        BatchIterator(np.arange(20), batch_size=4, seq_len=8)


@pytest.mark.parametrize("bad, says", [(np.nan, "nan"), (-1, "-1"), (256, "256")])
def test_train_refuses_a_corpus_with_a_bad_token_id_naming_it(bad, says, tmp_path):
    """A `Corpus` built in memory (not through load_corpus) with a NaN, a negative or an
    out-of-vocabulary id: `train` refuses it before compiling (a NaN max passed the old
    `max() >= vocab_size` check; negatives were not checked)."""
    from moejax.models import presets
    from moejax.training import presets as train_presets
    from moejax.training import train

    tokens = np.arange(4000, dtype=np.float64 if bad != bad else np.int64) % 256
    tokens[1234] = bad
    corpus = data.Corpus(tokens=tokens, sources=(), name="probe")
    with pytest.raises(DataError, match=f"corpus probe: index 1234 holds {says}; token ids"):
        train(presets.get("micro"), train_presets.get("micro"), corpus, run_dir=str(tmp_path))
