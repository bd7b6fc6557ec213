"""Data builders: shapes, the embedded corpus, local files, clear errors for bad files."""

import math

import pytest

from ortflow.data.digits import build_digits_data
from ortflow.data.text import build_text_data, unigram_entropy
from ortflow.errors import OrtflowError


def test_text_windows_are_next_byte_targets():
    data = build_text_data("python_docs", block_size=32, batch_size=4, val_fraction=0.1, seed=0)
    x, y = next(iter(data.train))
    assert x.shape == y.shape == (4, 32)
    assert (x[:, 1:] == y[:, :-1]).all()
    assert 3.0 < data.info["unigram_entropy"] < 4.0  # English text in bytes


def test_same_seed_same_batches_other_seed_other_batches():
    first = [next(iter(build_text_data("python_docs", 16, 4, 0.1, seed=s).train))[0] for s in (1, 1, 2)]
    assert (first[0] == first[1]).all() and not (first[0] == first[2]).all()


def test_any_local_text_file_is_lm_data(tmp_path):
    text = "the quick brown fox jumps over the lazy dog. " * 200
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    data = build_text_data(str(path), 16, 4, 0.1, seed=0, cache_dir=str(tmp_path / "cache"))
    assert data.info["unigram_entropy"] == pytest.approx(unigram_entropy(text.encode()))
    assert data.info["val_windows"] > 0


def test_missing_file_names_the_file_and_the_key(tmp_path):
    with pytest.raises(OrtflowError, match=r"data\.source.*nope\.txt.*does not exist"):
        build_text_data(str(tmp_path / "nope.txt"), 16, 4, 0.1, 0)


def test_too_small_file_says_what_to_change(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("hello")
    with pytest.raises(OrtflowError, match=r"tiny\.txt' has 5 bytes, too few to hold out a validation split"):
        build_text_data(str(path), 16, 4, 0.1, 0, cache_dir=str(tmp_path / "cache"))
    path.write_text("hello world. " * 300)
    with pytest.raises(OrtflowError, match=r"too few for one window of data\.block_size=1024"):
        build_text_data(str(path), 1024, 4, 0.1, 0, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(OrtflowError, match=r"too few for one step .*data\.batch_size=64"):
        build_text_data(str(path), 64, 64, 0.1, 0, cache_dir=str(tmp_path / "cache"))


def test_unigram_entropy_of_two_equiprobable_bytes_is_log_2():
    assert unigram_entropy(b"abab") == pytest.approx(math.log(2))


def test_digits_split_is_stratified_and_held_out():
    data = build_digits_data(batch_size=32, val_fraction=0.25, seed=0)
    assert data.info["train_images"] + data.info["val_images"] == 1797
    x, _ = next(iter(data.val))
    assert x.shape[1] == 64 and x.min() >= 0.0 and x.max() <= 1.0
    assert set(range(10)) == set(data.val.dataset.tensors[1].tolist())
