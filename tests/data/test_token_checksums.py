"""Token files that cannot change unnoticed (ortflow/data/tokens/checksums.py): a changed byte, same size, stops the
reads of its block naming the file, the block and the `ortflow-prepare --force` command, in the train split, the
validation windows and a whole-file map; every DDP rank stops at the same step; a store from before checksums is
refused or prepared again; `--force` replaces a changed store. End to end: the command exits with 2 on the changed
byte, and trains on the store prepared again."""

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from ortflow.cli import prepare as prepare_cli
from ortflow.data.tokens import checksums
from ortflow.data.tokens.blocks import RandomBlocks, Windows
from ortflow.data.tokens.prepare import PrepareSettings, open_or_prepare, prepare
from ortflow.data.tokens.sources import embedded_corpus
from ortflow.data.tokens.store import MANIFEST, TokenStore, fingerprint
from ortflow.errors import DataError
from tests.conftest import TINY


@pytest.fixture
def corpus(tmp_path) -> Path:
    """CPython's documentation as a text file: with the byte tokenizer, a train.bin of 3-4 blocks of 256 KiB."""
    path = tmp_path / "docs.txt"
    path.write_bytes(embedded_corpus())
    return path


def settings(corpus: Path, tmp_path: Path) -> PrepareSettings:
    return PrepareSettings(str(corpus), cache_dir=str(tmp_path / "cache"))


@pytest.fixture
def store(corpus, tmp_path) -> Path:
    return prepare(settings(corpus, tmp_path)).path


def flip_middle_byte(file: Path) -> int:
    """One byte in the middle of `file` changed in place (the size stays); returns its offset."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0x5A
    file.write_bytes(bytes(data))
    return middle


def test_a_changed_byte_stops_the_reads_of_its_block_naming_the_file_the_block_and_the_fix(store, corpus):
    block = flip_middle_byte(store / "train.bin") // checksums.BLOCK_BYTES
    train = TokenStore.open(store).train  # the size matches: opening does not read the contents
    blocks = -(-train.count * 2 // checksums.BLOCK_BYTES)
    assert blocks >= 3 and 0 < block < blocks - 1
    train.rows(np.array([0, 100]), 33)  # block 0: unchanged
    tokens_per_block = checksums.BLOCK_BYTES // 2
    with pytest.raises(DataError) as err:
        train.rows(np.array([block * tokens_per_block + 7]), 33)
    text = str(err.value)
    assert f"train.bin' changed after it was prepared: its block {block} of {blocks}" in text
    assert f"`ortflow-prepare --force data.source={corpus} data.tokenizer=bytes data.val_fraction=0.1`" in text
    with pytest.raises(DataError, match=f"block {block} of"):  # not marked checked: it stops every time
        train.rows(np.array([(block + 1) * tokens_per_block - 1]), 2)  # the last token of the block, and the next
    train.rows(np.array([(block + 1) * tokens_per_block + 3]), 33)  # the next block is fine


def test_each_block_is_checked_once_in_a_process(store, monkeypatch):
    calls, crc32 = [], zlib.crc32
    monkeypatch.setattr(checksums.zlib, "crc32", lambda data: calls.append(len(data)) or crc32(data))
    train = TokenStore.open(store).train
    source = RandomBlocks(train, 64, 8, seed=0)
    for index in range(20):
        source.batch(index)
    blocks = len(train.checks.expected)
    assert len(calls) == train.checks.checked.sum() <= blocks  # each block hashed at most once
    assert train.checks.checked.all()  # 160 random rows met every one of the 3-4 blocks


def test_every_rank_stops_at_the_same_step(store):
    """Each rank, in its own process (its own store), checks the blocks of the whole step, not just its rows."""
    flip_middle_byte(store / "train.bin")
    failed = []
    for rank in (0, 1):
        source = RandomBlocks(TokenStore.open(store).train, 64, 4, seed=3, rank=rank, world_size=2)
        for index in range(100):
            try:
                source.batch(index)
            except DataError:
                failed.append(index)
                break
    assert len(failed) == 2 and failed[0] == failed[1], failed


def test_the_validation_windows_and_a_whole_file_map_are_checked(store):
    flip_middle_byte(store / "val.bin")
    val = TokenStore.open(store).val
    windows = Windows(val, 64)
    with pytest.raises(DataError, match=r"val\.bin' changed after it was prepared: its block \d+ of"):
        for i in range(len(windows)):
            windows[i]
    with pytest.raises(DataError, match=r"val\.bin' changed after it was prepared"):
        TokenStore.open(store).val.open()


def test_a_store_from_before_checksums_is_refused_with_the_command_that_prepares_it_again(store, corpus):
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["version"] = 1
    for split in manifest["splits"].values():
        del split["checksums"]
    manifest["fingerprint"] = fingerprint(manifest)
    (store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"format version 1\), whose manifest has no checksums") as err:
        open_or_prepare(PrepareSettings(str(store)))
    assert f"ortflow-prepare --force data.source={corpus}" in str(err.value)


def test_checksums_that_do_not_fit_the_file_are_refused(store):
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["splits"]["val"]["checksums"]["crc32"] += "00000000"  # one block too many
    manifest["fingerprint"] = fingerprint(manifest)
    (store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"checksums of the token file '.*val\.bin' do not fit it"):
        TokenStore.open(store)


def test_force_prepares_a_changed_store_again_and_replaces_it(store, corpus, tmp_path):
    original = {p.name: p.read_bytes() for p in store.iterdir()}
    flip_middle_byte(store / "train.bin")
    again = prepare(settings(corpus, tmp_path), force=True)
    assert again.path == store
    assert {p.name: p.read_bytes() for p in store.iterdir() if p.name != MANIFEST} == {
        k: v for k, v in original.items() if k != MANIFEST
    }
    assert again.manifest["fingerprint"] == json.loads(original[MANIFEST])["fingerprint"]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()) == [store.name]  # nothing left over
    RandomBlocks(again.train, 64, 8, seed=0).batch(0)


def test_force_names_the_source_of_a_prepared_folder_it_cannot_prepare_from(store, corpus):
    with pytest.raises(
        DataError,
        match=f"--force cannot prepare again by itself: pass the text it was prepared from \\(data.source={corpus}\\)",
    ):
        open_or_prepare(PrepareSettings(str(store)), force=True)


@pytest.mark.slow
def test_a_run_on_a_changed_token_file_exits_2_naming_it_and_trains_once_prepared_again(
    store, corpus, tmp_path, ortflow_cli
):
    args = [*TINY, f"data.source={store}"]
    status, stderr = ortflow_cli(*args, "hydra.run.dir=before", cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    kept = {p.name: p.read_bytes() for p in store.iterdir()}
    offset = flip_middle_byte(store / "train.bin")
    status, stderr = ortflow_cli(*args, "hydra.run.dir=changed", cwd=tmp_path)
    assert status == 2, stderr[-3000:]
    block = offset // checksums.BLOCK_BYTES
    assert f"train.bin' changed after it was prepared: its block {block} of" in stderr
    assert "ortflow-prepare --force data.source=" in stderr and "Traceback" not in stderr
    assert json.loads((tmp_path / "changed" / "run.json").read_text())["status"] == "failed"
    assert (tmp_path / "before" / "checkpoints" / "final.pt").is_file()  # the earlier run is untouched
    now = {p.name: p.read_bytes() for p in store.iterdir()}  # the store is left as it was found
    assert now.keys() == kept.keys() and all(now[k] == kept[k] for k in kept if k != "train.bin")
    prepare_cli.main(["--force", f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert (store / "train.bin").read_bytes() == kept["train.bin"]
    status, stderr = ortflow_cli(*args, "hydra.run.dir=again", cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    losses = [json.loads(line).get("train/loss") for line in (tmp_path / "before" / "metrics.jsonl").open()]
    assert losses == [json.loads(line).get("train/loss") for line in (tmp_path / "again" / "metrics.jsonl").open()]
