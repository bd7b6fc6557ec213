"""A corpus of malformed configs, recipes, data files and checkpoints (tests/helpers/corpus/ plus files derived from
a real checkpoint here). Each one must stop with a non-zero exit code and a message naming the bad key or file, with no
traceback, and must leave every file that existed before untouched."""

import datetime
import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from ortflow.data.tokens.prepare import PrepareSettings, prepare
from ortflow.run import checkpoint
from tests.conftest import TESTS, TINY, run_cli

CORPUS = TESTS / "helpers" / "corpus"
SEARCH = f"hydra.searchpath=[file://{CORPUS}]"

# (case id, command-line arguments, text the error must contain). {corpus} is tests/helpers/corpus, {made} the files
# derived below from real checkpoints.
CONFIGS = [
    ("unknown-option", ["accel=foo"], "accel/foo"),
    ("not-an-int", ["trainer.max_steps=abc"], "trainer.max_steps"),
    ("misspelt-key", ["trainer.max_step=10"], "trainer.max_step"),
    ("added-unknown-key", ["+trainer.typo=1"], "trainer.typo"),
    ("no-such-recipe", ["+recipe=nope"], "recipe/nope"),
    ("artifacts-opset-17", ["accel=artifacts", "accel.opset=17"], "accel.opset=17"),
    ("debug-without-ortmodule", ["debug=verbose"], "debug"),
    ("negative-lr", ["optim.lr=-1"], "optim.lr=-1"),
    ("unknown-objective", ["objective=eval/perplexity"], "objective="),
    ("val-fraction-above-1", ["data.val_fraction=1.5"], "data.val_fraction=1.5"),
    ("negative-min-lr-ratio", ["scheduler=cosine", "scheduler.min_lr_ratio=-1"], "scheduler.min_lr_ratio=-1"),
    ("min-lr-ratio-above-1", ["scheduler=cosine", "scheduler.min_lr_ratio=5"], "scheduler.min_lr_ratio=5"),
    ("negative-warmup", ["scheduler.warmup_steps=-3"], "scheduler.warmup_steps=-3"),
    ("beta-above-1", ["accel=artifacts", "optim.betas=[1.5,0.999]"], "optim.betas=[1.5, 0.999]"),
    ("one-beta", ["optim.betas=[0.9]"], "optim.betas=[0.9]"),
    ("negative-eps", ["optim.eps=-1"], "optim.eps=-1"),
    ("negative-weight-decay", ["optim.weight_decay=-1"], "optim.weight_decay=-1"),
    ("nan-lr", ["optim.lr=nan"], "optim.lr=nan"),
    ("negative-seed", ["seed=-1"], "seed=-1"),
    ("seed-above-2-64", [f"seed={2**64 + 1}"], "seed="),
    ("artifacts-opset-7", ["accel=artifacts", "accel.opset=7"], "accel.opset=7"),
    ("huge-batch", ["data.batch_size=100000000"], "data.batch_size=100000000"),
    ("heads-do-not-divide", ["model.nhead=3"], "model.nhead=3"),
    ("no-such-builder", ["model._target_=no_such_pkg.build"], "model._target_=no_such_pkg.build"),
    ("custom-without-target", ["model=custom"], "model._target_"),
    ("keep-zero-checkpoints", ["trainer.checkpoint.keep=0"], "trainer.checkpoint.keep=0"),
    ("unknown-nonfinite-policy", ["trainer.on_nonfinite=ignore"], "trainer.on_nonfinite"),
    ("empty-resume", ["trainer.resume="], "trainer.resume"),
    ("batch-size-zero", ["data.batch_size=0"], "data.batch_size=0"),
]
RECIPES = [
    (f"recipe-{name}", [SEARCH, f"+recipe={name}"], named)
    for name, named in [
        ("unclosed_bracket", "unclosed_bracket.yaml"),
        ("misspelt_key", "trainer.max_stepz"),
        ("wrong_type", "trainer.max_steps"),
        ("unknown_option", "accel/turbo"),
        ("missing_package_header", "missing_package_header.yaml"),
        ("list_not_mapping", "recipe/list_not_mapping"),
        ("duplicate_key", "duplicate_key.yaml"),
        ("tab_indent", "tab_indent.yaml"),
        ("invalid_values", "optim.lr=-0.1"),
        ("bad_interpolation", "optim.lr"),
        ("mismatched_groups", "model=mlp"),
    ]
]
DATA = [
    ("data-empty-file", ["data.source={corpus}/data/empty.txt"], "empty.txt"),
    ("data-too-small", ["data.source={corpus}/data/tiny.txt"], "tiny.txt"),
    ("data-is-a-directory", ["data.source={corpus}/data/a_directory.txt"], "a_directory.txt"),
    ("data-missing", ["data.source={corpus}/data/no_such_file.txt"], "no_such_file.txt"),
    ("data-empty-source", ["data.source="], "data.source"),
    ("data-fifo", ["data.source={made}/fifo"], "not a regular file"),
    ("data-dev-zero", ["data.source=/dev/zero"], "/dev/zero"),
    ("data-binary-file", ["data.source={made}/binary.txt"], "binary.txt' looks binary"),
    ("data-tokenizer-unparsable", ["data.tokenizer={corpus}/data/tiny.txt"], "tiny.txt' is not a tokenizer file"),
    ("data-truncated-tokens", ["data.source={made}/prepared"], "truncated or of another dtype"),
    ("run-dir-is-a-file", ["hydra.run.dir={made}/good.pt"], "not a directory"),
]
CHECKPOINTS = [
    ("ckpt-empty", ["trainer.resume={corpus}/checkpoint/empty.pt"], "empty.pt"),
    ("ckpt-text", ["trainer.resume={corpus}/checkpoint/text.pt"], "text.pt"),
    ("ckpt-json", ["trainer.resume={corpus}/checkpoint/json.pt"], "json.pt"),
    ("ckpt-a-directory", ["trainer.resume={corpus}/checkpoint"], "is not a file"),
    ("ckpt-missing", ["trainer.resume={corpus}/checkpoint/none.pt"], "none.pt"),
    ("ckpt-truncated", ["trainer.resume={made}/truncated.pt"], "truncated.pt"),
    ("ckpt-bit-flipped", ["trainer.resume={made}/bit_flipped.pt"], "bit_flipped.pt"),
    ("ckpt-weights-only", ["trainer.resume={made}/weights_only.pt"], "weights only"),
    ("ckpt-future-version", ["trainer.resume={made}/future_version.pt"], "future_version.pt"),
    ("ckpt-arbitrary-object", ["trainer.resume={made}/arbitrary_object.pt"], "arbitrary_object.pt"),
    (
        "ckpt-corrupt-ort-state",
        ["accel=artifacts", "optim.fused=false", "trainer.resume={made}/corrupt_ort_state.pt"],
        "ONNX Runtime",
    ),
    ("ckpt-other-model", ["model.d_model=64", "trainer.resume={made}/good.pt"], "does not fit this model"),
    ("ckpt-beyond-max-steps", ["trainer.max_steps=4", "trainer.resume={made}/good.pt"], "trainer.max_steps=4"),
    ("ckpt-auto-none-valid", ["hydra.run.dir={made}/auto_run", "trainer.resume=auto"], "no checkpoint in"),
]
CASES = CONFIGS + RECIPES + DATA + CHECKPOINTS


def _checkpoint_run(cwd: Path, accel: str, *overrides: str) -> Path:
    result = run_cli(*TINY, f"accel={accel}", *overrides, "trainer.checkpoint.every=3", "hydra.run.dir=run", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "run" / "checkpoints"


def _resave(payload: dict, path: Path) -> None:
    torch.save(checkpoint.seal(payload), path)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """Malformed checkpoints derived from real ones (binary files are made here rather than stored)."""
    out = tmp_path_factory.mktemp("made")
    eager = _checkpoint_run(tmp_path_factory.mktemp("eager"), "none")
    good = (eager / "step-00000006.pt").read_bytes()
    (out / "good.pt").write_bytes(good)
    (out / "truncated.pt").write_bytes(good[: len(good) // 2])
    flipped = bytearray(good)
    weights = checkpoint.load(out / "good.pt")["model"]["fc.weight"].numpy().tobytes()
    flipped[good.index(weights) + 100] ^= 0xFF  # inside a tensor's bytes: torch.load alone would not notice
    (out / "bit_flipped.pt").write_bytes(bytes(flipped))
    shutil.copy(eager / "final.pt", out / "weights_only.pt")
    payload = checkpoint.load(out / "good.pt")
    _resave({**payload, "version": 99}, out / "future_version.pt")
    torch.save({"when": datetime.date(2026, 1, 1)}, out / "arbitrary_object.pt")
    # ORT's own state is in the checkpoint where ORT's optimizer graph steps (optim.fused=false)
    ort_run = _checkpoint_run(tmp_path_factory.mktemp("artifacts"), "artifacts", "optim.fused=false")
    artifacts = checkpoint.load(ort_run / "step-00000006.pt")
    artifacts["optimizer"]["checkpoint"] = b"\x00garbage" * 64
    _resave(artifacts, out / "corrupt_ort_state.pt")
    os.mkfifo(out / "fifo")  # reading it would block forever
    (out / "binary.txt").write_bytes(b"text, then \0\1\2 bytes no text file holds")
    store = prepare(PrepareSettings("python_docs", tokenizer="bpe", bpe_vocab_size=300, cache_dir=str(out / "cache")))
    shutil.copytree(store.path, out / "prepared")
    train = out / "prepared" / "train.bin"
    train.write_bytes(train.read_bytes()[:-1])  # a token file cut short
    auto_run = out / "auto_run" / "checkpoints"
    auto_run.mkdir(parents=True)
    (auto_run / "step-00000006.pt").write_bytes(good[:1000])
    return out


def _files(*roots: Path) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for root in roots for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(("case", "args", "named"), CASES, ids=[c[0] for c in CASES])
def test_malformed_input_gets_a_clear_error_and_loses_nothing(case, args, named, made, tmp_path, ortflow_cli):
    args = [a.format(corpus=CORPUS, made=made) for a in args]
    # The tiny run's settings, minus those the case sets; model settings only where the case resumes a checkpoint
    # (the others may choose another model group).
    base = TINY if case.startswith("ckpt-") else TINY[4:]
    keys = {a.partition("=")[0] for a in args}
    before = _files(CORPUS, made)
    status, stderr = ortflow_cli(*[a for a in base if a.partition("=")[0] not in keys], *args, cwd=tmp_path)
    assert status != 0, f"{case} was accepted"
    assert named in stderr, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    after = _files(CORPUS, made)
    assert {p: after.get(p) for p in before} == before  # nothing that existed was changed or removed
    assert not list((tmp_path / "outputs").rglob("final.pt"))
