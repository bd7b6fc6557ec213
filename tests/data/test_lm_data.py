"""Language-model data: the prepare step (every source format and tokenizer, the manifest, the cache, interrupted and
failed prepares, bad inputs), the memmap block source (determinism, resume, DDP shards) and bits per byte."""

import errno
import hashlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from ortflow.data.text import build_text_data
from ortflow.data.tokens import prepare as prep
from ortflow.data.tokens.blocks import RandomBlocks
from ortflow.data.tokens.prepare import PrepareSettings, open_or_prepare, prepare
from ortflow.data.tokens.sources import embedded_corpus
from ortflow.data.tokens.store import MANIFEST, TokenStore, fingerprint
from ortflow.data.tokens.tokenizer import SEPARATOR, HFTokenizer, token_dtype, train_bpe
from ortflow.errors import DataError
from tests.conftest import REPO

DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 40 + "\nSecond line of the first document.\n",
    "def f(x):\n    return x * 2  # a comment with ünïcödé and 漢字\n" * 30,
    "Numbers 12345 and 3.14159, tabs\tand  double  spaces.\n" * 50,
    "Short one.",
    "A fifth document, written so that the corpus spans several chunks of a kilobyte. " * 25,
]


def settings(source, tmp_path: Path, **kw) -> PrepareSettings:
    return PrepareSettings(str(source), cache_dir=str(tmp_path / "cache"), **kw)


def tokens_of(store: TokenStore) -> np.ndarray:
    return np.concatenate([store.train.open(), store.val.open()])


def decoded(store: TokenStore) -> list[str]:
    """The corpus back from its tokens, one string per document (split at the separator)."""
    ids = tokens_of(store).tolist()
    sep = store.tokenizer.separator
    docs, current = [], []
    for i in [*ids, None]:
        if i is None or i == sep:
            docs.append(current)
            current = []
        else:
            current.append(i)
    if store.tokenizer.kind == "bytes":
        return [bytes(d).decode() for d in docs]
    return [store.tokenizer.tokenizer.decode(d, skip_special_tokens=False) for d in docs]


@pytest.fixture
def folder(tmp_path) -> Path:
    """DOCS as a folder, nested, in an order only a sorted walk reproduces; hidden files are skipped."""
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    names = ["a.txt", "b/c.txt", "b/d.md", "e.txt", "f.txt"]
    for name, text in zip(reversed(names), reversed(DOCS), strict=True):
        (root / name).write_text(text)
    (root / ".hidden").write_text("never read")
    return root


# -------------------------------------------------------------------------------------------------- formats
@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_a_folder_is_read_recursively_in_sorted_order_with_document_boundaries(folder, tmp_path, tokenizer):
    store = prepare(settings(folder, tmp_path, tokenizer=tokenizer, bpe_vocab_size=400))
    assert decoded(store) == DOCS  # every document back, in sorted-path order, nothing from the hidden file
    files = store.manifest["source"]["files"]
    assert [f["path"] for f in files] == ["a.txt", "b/c.txt", "b/d.md", "e.txt", "f.txt"]
    for f in files:
        assert f["sha256"] == hashlib.sha256((folder / f["path"]).read_bytes()).hexdigest()
    assert store.manifest["tokenizer"]["vocab_size"] == store.tokenizer.vocab_size


def test_one_text_file_with_the_byte_tokenizer_is_its_bytes(tmp_path):
    text = "".join(DOCS)
    (tmp_path / "one.txt").write_text(text)
    store = prepare(settings(tmp_path / "one.txt", tmp_path))
    assert tokens_of(store).tobytes() == np.frombuffer(text.encode(), np.uint8).astype(np.uint16).tobytes()
    assert store.manifest["dtype"] == "uint16" and store.tokens_per_byte == 1.0


def _records(tmp_path: Path, field: str = "text") -> list[dict]:
    return [{field: doc, "id": i} for i, doc in enumerate(DOCS)]


def test_json_lines_with_a_named_field(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _records(tmp_path, "content")) + "\n")
    store = prepare(settings(path, tmp_path, tokenizer="bpe", bpe_vocab_size=400, text_field="content"))
    assert decoded(store) == DOCS
    assert store.manifest["source"]["text_field"] == "content"


def test_parquet_with_a_named_field(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"body": DOCS, "n": list(range(len(DOCS)))}), path, row_group_size=2)
    store = prepare(settings(path, tmp_path, text_field="body"))
    assert decoded(store) == DOCS


def test_a_dataset_saved_with_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(path))
    store = prepare(settings(path, tmp_path))
    assert decoded(store) == DOCS and store.manifest["source"]["kind"] == "hf_dataset"
    both = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": DOCS}), "test": datasets.Dataset.from_dict({"text": ["x"]})}
    ).save_to_disk(str(both))
    assert decoded(prepare(settings(both, tmp_path))) == DOCS  # a DatasetDict: its train split


def test_a_tokenizer_file_encodes_as_the_bpe_it_was_saved_from(folder, tmp_path):
    bpe = prepare(settings(folder, tmp_path, tokenizer="bpe", bpe_vocab_size=400))
    saved = tmp_path / "tokenizer.json"
    saved.write_text(bpe.tokenizer.json)
    from_file = prepare(settings(folder, tmp_path, tokenizer=str(saved)))
    assert from_file.path != bpe.path  # another cache key: another tokenizer setting
    assert np.array_equal(tokens_of(from_file), tokens_of(bpe))
    assert from_file.tokenizer.identity == bpe.tokenizer.identity


def test_ortflows_word_by_word_encoding_equals_the_tokenizers_own(tmp_path):
    text = embedded_corpus().decode()[:200_000] + "".join(DOCS) + " <|endoftext|> in the text stays text"
    tokenizer = train_bpe([text[:100_000]], 1000)
    # the reference: Hugging Face tokenizers encoding the text whole
    from ortflow.data.tokens import encode

    chunk = [(text.encode(), False)]
    words = encode.make_encoder("bpe", tokenizer.json, 0, "uint16")(chunk)
    whole = encode.make_encoder("pretrained", tokenizer.json, 0, "uint16")(chunk)
    assert np.array_equal(words, whole)
    assert tokenizer.tokenizer.token_to_id(SEPARATOR) == 0 and 0 not in words  # text spelling it stays text
    assert tokenizer.decode(words.tolist()) == text


def test_word_by_word_encoding_of_segments_with_every_kind_of_word_boundary():
    """Random chunks of several segments, with separators, built from pieces at the split pattern's edges: lone and
    repeated spaces before every class, tabs, \\v (not whitespace to the pattern), digit runs longer than 3, words
    longer than 7 and 15 bytes, UTF-8 (valid and cut), NUL, text spelling the separator."""
    import random

    from ortflow.data.tokens import encode

    pieces = [b" ", b"  ", b"\t", b"\n", b"\r\n", b"\f", b"\v", b"a", b"Zeta", b"1", b"12345", b"(", b"=" * 10]
    pieces += [b"\xc3\xa9", b"\xe2\x82", b"\xff", b"_", b"\0", b"abcdefghijkl", b"a" * 20, b" <|endoftext|>"]
    tokenizer = train_bpe([b"".join(pieces * 50).decode("utf-8", errors="replace"), "".join(DOCS)], 400)
    words = encode.make_encoder("bpe", tokenizer.json, 0, "uint16")
    whole = encode.make_encoder("pretrained", tokenizer.json, 0, "uint16")
    rng = random.Random(0)
    for _ in range(1500):
        chunk = [
            (b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 10))), rng.random() < 0.5)
            for _ in range(rng.randint(1, 5))
        ]
        assert np.array_equal(words(chunk), whole(chunk)), chunk


@pytest.fixture
def gpt2_style(tmp_path) -> Path:
    """A tokenizer that is not ortflow's (GPT-2's byte-level pre-tokenizer): encoded whole, not word by word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DOCS, trainer)
    path = tmp_path / "gpt2-style" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def test_a_pretrained_tokenizer_folder_with_its_own_separator(folder, tmp_path, gpt2_style):
    store = prepare(settings(folder, tmp_path, tokenizer=str(gpt2_style.parent)))
    assert store.tokenizer.kind == "pretrained" and store.tokenizer.separator == 0  # "</s>"
    assert decoded(store) == DOCS


def test_the_token_dtype_fits_the_vocabulary(folder, tmp_path):
    assert token_dtype(2**16) == np.uint16 and token_dtype(2**16 + 1) == np.uint32
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    big = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "big.json"
    big.save(str(path))
    (tmp_path / "w.txt").write_text(" ".join(f"w{i}" for i in range(0, 70_000, 7)))
    store = prepare(settings(tmp_path / "w.txt", tmp_path, tokenizer=str(path)))
    assert store.manifest["dtype"] == "uint32"
    ids = tokens_of(store)
    assert ids.dtype == np.uint32 and ids.max() == 69_993  # ids above 65,535 kept whole
    assert (store.path / "train.bin").stat().st_size == 4 * store.manifest["splits"]["train"]["tokens"]


# ------------------------------------------------------------------------------------------------- manifest
def test_the_manifest_records_sources_tokenizer_counts_and_settings(folder, tmp_path):
    store = prepare(settings(folder, tmp_path, tokenizer="bpe", bpe_vocab_size=400, val_fraction=0.2))
    m = json.loads((store.path / MANIFEST).read_text())
    assert m["format"] == "ortflow-tokens" and m["version"] == 2 and m["ortflow_version"]
    assert m["fingerprint"] == fingerprint(m)
    tok = m["tokenizer"]
    assert tok["kind"] == "bpe" and tok["file"] == "tokenizer.json" and tok["separator"] == 0
    assert tok["sha256"] == hashlib.sha256((store.path / "tokenizer.json").read_bytes()).hexdigest()
    assert tok["sampled"] is False and tok["trained_on_chars"] > 0
    splits = m["splits"]
    for name in ("train", "val"):
        n = splits[name]["tokens"]
        assert (store.path / splits[name]["file"]).stat().st_size == 2 * n > 0
        sums = splits[name]["checksums"]  # one CRC-32 per block, of the file as written
        data = (store.path / splits[name]["file"]).read_bytes()
        blocks = [data[i : i + sums["block_bytes"]] for i in range(0, len(data), sums["block_bytes"])]
        assert sums["crc32"] == "".join(f"{zlib.crc32(block):08x}" for block in blocks)
    docs_bytes = sum(len(d.encode()) for d in DOCS) + len(DOCS) - 1  # separators count as bytes
    assert splits["train"]["bytes"] + splits["val"]["bytes"] == docs_bytes
    assert abs(m["val_fraction_actual"] - 0.2) < 0.05
    assert m["settings"]["bpe_vocab_size"] == 400 and m["settings"]["val_fraction"] == 0.2
    assert m["source"]["kind"] == "folder" and len(m["source"]["files"]) == 5


def test_a_bounded_sample_trains_the_bpe_of_a_large_corpus(folder, tmp_path):
    store = prepare(settings(folder, tmp_path, tokenizer="bpe", bpe_vocab_size=300, bpe_train_bytes=2000))
    tok = store.manifest["tokenizer"]
    assert tok["sampled"] is True and tok["trained_on_chars"] < sum(map(len, DOCS)) / 2


# ---------------------------------------------------------------------------------------------------- cache
def test_preparing_the_same_sources_again_does_nothing(folder, tmp_path, monkeypatch):
    first = prepare(settings(folder, tmp_path, tokenizer="bpe", bpe_vocab_size=400))
    stamps = {p: p.stat().st_mtime_ns for p in first.path.iterdir()}
    monkeypatch.setattr(prep, "_prepare_into", lambda *a: pytest.fail("prepared again"))
    again = prepare(settings(folder, tmp_path, tokenizer="bpe", bpe_vocab_size=400))
    assert again.path == first.path and {p: p.stat().st_mtime_ns for p in first.path.iterdir()} == stamps
    monkeypatch.undo()
    other = prepare(settings(folder, tmp_path, tokenizer="bpe", bpe_vocab_size=300))  # another setting: another key
    (folder / "a.txt").write_text(DOCS[-1] + " changed")  # another content: another key
    changed = prepare(settings(folder, tmp_path, tokenizer="bpe", bpe_vocab_size=400))
    assert len({first.path, other.path, changed.path}) == 3
    assert changed.manifest["fingerprint"] != first.manifest["fingerprint"]


def test_the_default_cache_is_under_the_users_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert prep.cache_root(PrepareSettings("x")) == tmp_path / "xdg" / "ortflow" / "tokens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert prep.cache_root(PrepareSettings("x")) == tmp_path / "home" / ".cache" / "ortflow" / "tokens"


def test_an_exception_mid_write_leaves_nothing_that_looks_complete(folder, tmp_path, monkeypatch):
    calls = []

    def fail_on_second(file, tokens):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        file.write(tokens.tobytes())

    monkeypatch.setattr(prep, "write_tokens", fail_on_second)
    with pytest.raises(RuntimeError, match="boom"):
        prepare(settings(folder, tmp_path))
    cache = tmp_path / "cache"
    assert not list(cache.rglob(MANIFEST)) and not list(cache.glob(".*.tmp-*"))
    monkeypatch.undo()
    store = prepare(settings(folder, tmp_path))
    assert decoded(store) == DOCS


KILLED = """
import sys, time
from pathlib import Path
from ortflow.data.tokens import prepare as prep

def slow(file, tokens):
    file.write(tokens.tobytes())
    Path(sys.argv[2]).touch()  # tokens are being written
    time.sleep(60)

prep.write_tokens = slow
prep.prepare(prep.PrepareSettings(sys.argv[1], cache_dir=sys.argv[3]))
"""


def test_a_killed_prepare_leaves_nothing_that_looks_complete_and_the_next_one_succeeds(folder, tmp_path):
    started = tmp_path / "started"
    cmd = [sys.executable, "-c", KILLED, str(folder), str(started), str(tmp_path / "cache")]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cache = tmp_path / "cache"
    left = list(cache.glob(".*.tmp-*"))
    assert left and not list(cache.rglob(MANIFEST))  # a hidden partial folder, never a store
    store = prepare(settings(folder, tmp_path))
    assert decoded(store) == DOCS and not any(p.exists() for p in left)  # the stale folder is removed


# ----------------------------------------------------------------------------------------------- bad inputs
def test_an_empty_corpus_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"empty\.txt' is empty"):
        prepare(settings(tmp_path / "empty.txt", tmp_path))
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "a.txt").write_text("")
    (blank / "b.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(DataError, match=r"blank' holds no text"):
        prepare(settings(blank, tmp_path))


def test_a_binary_file_is_refused_by_name(folder, tmp_path):
    (folder / "b" / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    with pytest.raises(DataError, match=r"image\.png' looks binary"):
        prepare(settings(folder, tmp_path))


def test_records_without_the_named_field_are_refused_by_name(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"c\.jsonl' line 2 has no field 'text' \(data\.text_field\).*\['body'\]"):
        prepare(settings(path, tmp_path))
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"c\.parquet' \(parquet\) has no field 'text'"):
        prepare(settings(tmp_path / "c.parquet", tmp_path))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl' line 1 is not JSON"):
        prepare(settings(tmp_path / "bad.jsonl", tmp_path))


def test_a_tokenizer_file_that_does_not_parse_is_refused_by_name(folder, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "Nope"}}')
    with pytest.raises(DataError, match=r"tokenizer.json' is not a tokenizer file"):
        prepare(settings(folder, tmp_path, tokenizer=str(bad)))
    with pytest.raises(DataError, match=r"'no/such/tokenizer\.json' is not bytes, bpe"):
        prepare(settings(folder, tmp_path, tokenizer="no/such/tokenizer.json"))
    assert not list((tmp_path / "cache").rglob(MANIFEST))


@pytest.fixture
def prepared(folder, tmp_path) -> Path:
    return prepare(settings(folder, tmp_path, tokenizer="bpe", bpe_vocab_size=400)).path


def _expect(store_dir: Path, pattern: str) -> None:
    before = {p.name: p.read_bytes() for p in store_dir.iterdir()}
    with pytest.raises(DataError, match=pattern):
        open_or_prepare(PrepareSettings(str(store_dir)))
    assert {p.name: p.read_bytes() for p in store_dir.iterdir()} == before  # nothing prepared is lost


def test_a_truncated_token_file_is_refused_by_name(prepared):
    data = (prepared / "train.bin").read_bytes()
    (prepared / "train.bin").write_bytes(data[:-3])
    _expect(prepared, r"train\.bin' has .* bytes, but its manifest says .* tokens of uint16.*truncated")


def test_a_token_file_of_another_dtype_is_refused_by_name(prepared):
    ids = np.fromfile(prepared / "val.bin", dtype=np.uint16)
    ids.astype(np.uint32).tofile(prepared / "val.bin")
    _expect(prepared, r"val\.bin' has .* bytes, but its manifest says .*of another dtype")


def test_a_manifest_from_a_newer_format_is_refused_by_name(prepared):
    manifest = json.loads((prepared / MANIFEST).read_text())
    (prepared / MANIFEST).write_text(json.dumps({**manifest, "version": 99}))
    _expect(prepared, r"manifest.json' has format version 99, newer than this ortflow reads \(2\)")


def test_a_tokenizer_file_changed_after_preparing_is_refused(prepared):
    (prepared / "tokenizer.json").write_text("{}")
    _expect(prepared, r"tokenizer.json' is not the one its manifest records")


def test_a_disk_that_fills_during_prepare_names_the_file_and_keeps_what_was_prepared(
    folder, prepared, tmp_path, monkeypatch
):
    kept = {p: p.read_bytes() for p in prepared.iterdir()}

    def full(file, tokens):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prep, "write_tokens", full)
    with pytest.raises(DataError, match=r"disk full while preparing .*writing '.*train\.bin'"):
        prepare(settings(folder, tmp_path))  # the byte tokenizer: another key, a new prepare
    cache = tmp_path / "cache"
    assert not list(cache.glob(".*.tmp-*"))  # the temporary files are removed
    assert {p: p.read_bytes() for p in prepared.iterdir()} == kept
    assert [p.parent for p in cache.rglob(MANIFEST)] == [prepared]


def test_an_unwritable_cache_dir_names_the_key(folder, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match=r"data\.cache_dir: cannot write the token cache"):
        prepare(PrepareSettings(str(folder), cache_dir=str(tmp_path / "file" / "cache")))


# ---------------------------------------------------------------------------------------------- block source
@pytest.fixture(scope="module")
def blocks_store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blocks")
    return prepare(PrepareSettings("python_docs", tokenizer="bpe", bpe_vocab_size=600, cache_dir=str(tmp)))


def _batches(source: RandomBlocks, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(source)
    return [next(it) for _ in range(n)]


def test_blocks_are_a_function_of_seed_and_position(blocks_store):
    a, b = RandomBlocks(blocks_store.train, 16, 4, seed=3), RandomBlocks(blocks_store.train, 16, 4, seed=3)
    first, second = _batches(a, 5), _batches(b, 5)
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x, y = first[0]
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    tokens = blocks_store.train.open()
    start = int(a.offsets(0)[0])
    assert np.array_equal(x[0].numpy(), tokens[start : start + 16])  # the block read from the token file
    other = _batches(RandomBlocks(blocks_store.train, 16, 4, seed=4), 1)[0][0]
    assert not torch.equal(other, x)


def test_a_restored_position_gives_the_same_next_batches_bitwise(blocks_store):
    from ortflow.data.resumable import ResumableBatches

    run = ResumableBatches(RandomBlocks(blocks_store.train, 16, 4, seed=0))
    for _ in range(7):
        next(run)
    state = json.loads(json.dumps(run.state_dict()))  # what a checkpoint holds survives serialisation
    expected = [next(run) for _ in range(3)]
    resumed = ResumableBatches(RandomBlocks(blocks_store.train, 16, 4, seed=0))
    resumed.load_state_dict(state)
    assert resumed.exact
    for (x1, y1), (x2, y2) in zip(expected, [next(resumed) for _ in range(3)], strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_ranks_draw_disjoint_blocks_that_together_are_one_larger_batch(blocks_store):
    whole = RandomBlocks(blocks_store.train, 16, 8, seed=0)
    ranks = [RandomBlocks(blocks_store.train, 16, 4, seed=0).shard(r, 2) for r in (0, 1)]
    for index in range(20):
        starts = [r.offsets(index)[r.rank * 4 : (r.rank + 1) * 4] for r in ranks]
        spans = sorted((s, s + 17) for s in np.concatenate(starts))
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))  # no shared token
        together = torch.cat([r.batch(index)[0] for r in ranks])
        assert torch.equal(together, whole.batch(index)[0])


def test_a_corpus_too_small_for_one_step_says_what_to_change(blocks_store):
    with pytest.raises(DataError, match=r"too few for one step .*data\.batch_size=4096"):
        RandomBlocks(blocks_store.train, 64, 4096, seed=0)


def test_validation_windows_are_fixed_and_cover_the_split_in_order(tmp_path):
    data = build_text_data("python_docs", 16, 4, 0.1, 0, tokenizer="bpe", bpe_vocab_size=600, cache_dir=str(tmp_path))
    first = [x for x, _ in data.val]
    again = [x for x, _ in data.val]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    val = data.val.dataset.tokens.open()
    windows = torch.cat(first)
    assert len(windows) == (len(val) - 1) // 16
    for i, window in enumerate(windows):
        assert np.array_equal(window.numpy(), val[i * 16 : i * 16 + 16])


def test_bits_per_byte_is_the_loss_in_nats_per_token_times_tokens_per_byte_over_ln2(tmp_path):
    data = build_text_data("python_docs", 16, 4, 0.1, 0, tokenizer="bpe", bpe_vocab_size=600, cache_dir=str(tmp_path))
    manifest = json.loads(data.run_files["data_manifest.json"])
    val = manifest["splits"]["val"]
    got = data.eval_metrics({"eval/loss": 2.5})["eval/bits_per_byte"]
    assert got == pytest.approx(2.5 * val["tokens"] / val["bytes"] / math.log(2))
    assert data.info["vocab_size"] == data.tokenizer_object.vocab_size == manifest["tokenizer"]["vocab_size"]
    assert data.tokenizer == HFTokenizer.from_str(data.run_files["tokenizer.json"].decode(), "x").identity
    assert data.fingerprint == manifest["fingerprint"]


# ------------------------------------------------------------------------------------------- ortflow-prepare
def test_ortflow_prepare_prints_the_folder_a_run_then_finds(folder, tmp_path, capfd):
    from ortflow.cli import prepare as cli

    args = [f"data.source={folder}", "data.tokenizer=bpe", "data.bpe_vocab_size=400", f"data.cache_dir={tmp_path}/c"]
    cli.main(args)
    printed = Path(capfd.readouterr().out.splitlines()[-2])
    assert (printed / MANIFEST).is_file()
    data = build_text_data(str(folder), 16, 2, 0.1, 0, tokenizer="bpe", bpe_vocab_size=400, cache_dir=f"{tmp_path}/c")
    assert data.info["prepared"] == str(printed)  # the run's settings find what ortflow-prepare made
    with pytest.raises(SystemExit) as exit_:
        cli.main([f"data.source={tmp_path / 'missing.txt'}"])
    assert exit_.value.code == 2
    err = capfd.readouterr().err
    assert "missing.txt' does not exist" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_tokenizer_named_by_its_model_is_found_in_the_local_hugging_face_cache(
    folder, tmp_path, gpt2_style, monkeypatch
):
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--someone--tiny-lm" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_bytes(gpt2_style.read_bytes())
    (tmp_path / "hub" / "models--someone--tiny-lm" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny-lm" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    store = prepare(settings(folder, tmp_path, tokenizer="someone/tiny-lm"))
    assert store.tokenizer.kind == "pretrained" and decoded(store) == DOCS
    with pytest.raises(DataError, match=r"'someone/absent' is not bytes, bpe, a tokenizer.json file, or a model"):
        prepare(settings(folder, tmp_path, tokenizer="someone/absent"))


def test_parquet_and_saved_datasets_without_the_data_extra_name_the_pip_command(tmp_path, monkeypatch):
    (tmp_path / "c.parquet").write_bytes(b"PAR1 not read")
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text("{}")
    (saved / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"c\.parquet'\) needs pyarrow: pip install 'ortflow\[data\]'"):
        prepare(settings(tmp_path / "c.parquet", tmp_path))
    with pytest.raises(DataError, match=r"saved'\) needs datasets: pip install 'ortflow\[data\]'"):
        prepare(settings(saved, tmp_path))


def test_the_default_embedded_corpus_in_bytes_touches_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    data = build_text_data("python_docs", 16, 4, 0.1, 0)
    assert data.info["prepared"] == "in memory" and not (tmp_path / "xdg").exists()
    reference = np.frombuffer(embedded_corpus(), np.uint8)
    tokens = np.concatenate([data.train.tokens.open(), data.val.dataset.tokens.open()])
    assert np.array_equal(tokens, reference)  # the corpus' bytes, split into train and val


def test_the_fingerprint_is_the_contents_not_where_or_when(folder, tmp_path):
    import shutil

    moved = tmp_path / "elsewhere" / "corpus"
    shutil.copytree(folder, moved)
    first = prepare(PrepareSettings(str(folder), "bpe", 400, cache_dir=str(tmp_path / "one")))
    again = prepare(PrepareSettings(str(moved), "bpe", 400, cache_dir=str(tmp_path / "two")))
    assert first.path != again.path and first.manifest["fingerprint"] == again.manifest["fingerprint"]
    assert first.tokenizer.identity == again.tokenizer.identity  # the BPE trains the same on the same text
    (moved / "e.txt").write_text(DOCS[3] + "!")
    changed = prepare(PrepareSettings(str(moved), "bpe", 400, cache_dir=str(tmp_path / "two")))
    assert changed.manifest["fingerprint"] != first.manifest["fingerprint"]
