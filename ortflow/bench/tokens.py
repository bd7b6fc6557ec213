"""Benchmarks of the language-model data path (not tests: numbers depend on the machine and its load).

    python -m ortflow.bench.tokens corpus /tmp/corpus.txt --mb 1000   # text from installed packages' sources
    python -m ortflow.bench.tokens prepare /tmp/corpus.txt --tokenizer bytes
    python -m ortflow.bench.tokens prepare /tmp/corpus.txt --tokenizer bpe --vocab 8192
    python -m ortflow.bench.tokens rss --mb 100 2048                  # RSS streaming from token files of each size
    python -m ortflow.bench.tokens loader --source /tmp/corpus.txt        # batch time against a transformer step

`prepare` prepares into a fresh cache folder and reports MB/s of source bytes over the whole prepare (tokenizer
training, encoding, the split, the content hashes, the manifest). `rss` streams random blocks (and an evaluation's
windows) from a token file in a fresh process per size and reports its resident memory. `loader` times fetching a
batch against an optimizer step of `+recipe=transformer` in the same process.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".py", ".pyi", ".md", ".txt", ".rst", ".h", ".c", ".cpp")


def make_corpus(out: Path, megabytes: int) -> None:
    """Concatenate text files of the installed packages (sorted, binaries skipped) up to `megabytes` MB, starting
    over from the first when they run out."""
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"]}
    files = sorted(p for root in roots for p in Path(root).rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    target, written = megabytes * 10**6, 0
    with out.open("wb") as f:
        while written < target:
            for path in files:
                data = path.read_bytes()[: target - written]
                if b"\0" in data:
                    continue
                f.write(data)
                written += len(data)
                if written >= target:
                    break
    print(f"{out}: {written / 1e6:.0f} MB from {len(files)} files")


def bench_prepare(source: str, tokenizer: str, vocab: int, num_proc: int | None, train_bytes: int) -> dict:
    from ortflow.data.tokens.prepare import PrepareSettings, prepare

    with tempfile.TemporaryDirectory(prefix="ortflow-bench-") as cache:
        settings = PrepareSettings(source, tokenizer, vocab, train_bytes, cache_dir=cache, num_proc=num_proc)
        started = time.perf_counter()
        store = prepare(settings)
        seconds = time.perf_counter() - started
        size = sum(f["size"] for f in store.manifest["source"]["files"])
        result = {
            "tokenizer": tokenizer,
            "vocab_size": store.tokenizer.vocab_size,
            "source_mb": size / 1e6,
            "seconds": seconds,
            "mb_per_s": size / seconds / 1e6,
            "tokens": sum(s["tokens"] for s in store.manifest["splits"].values()),
            "tokenizer_train_s": store.manifest["prepare"].get("tokenizer_train_seconds"),
            "num_proc": store.manifest["prepare"]["num_proc"],
            "load_average": os.getloadavg(),
        }
    return result


RSS_CHILD = """
import json, sys, numpy as np, torch
from ortflow.data.tokens.blocks import RandomBlocks, Windows
from ortflow.data.tokens.store import TokenArray

def rss():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM")}

path, count, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tokens = TokenArray(count, "uint16", path)
before = rss()
source = RandomBlocks(tokens, 1024, 32, seed=0)
it = iter(source)
for _ in range(steps):
    next(it)
windows = Windows(tokens, 1024)
for i in range(0, len(windows), max(1, len(windows) // 256)):
    windows[i]
print(json.dumps({"before_mb": before, "after_mb": rss()}))
"""


def bench_rss(sizes_mb: list[int], steps: int) -> list[dict]:
    """RSS of a fresh process streaming `steps` batches of 32 x 1025 random tokens from a token file of each size."""
    results = []
    with tempfile.TemporaryDirectory(prefix="ortflow-rss-") as tmp:
        for mb in sizes_mb:
            path = Path(tmp) / f"{mb}.bin"
            count = mb * 10**6 // 2
            rng = np.random.default_rng(0)
            with path.open("wb") as f:
                for start in range(0, count, 2**25):
                    f.write(rng.integers(0, 8192, min(2**25, count - start), dtype=np.uint16).tobytes())
            out = subprocess.run(
                [sys.executable, "-c", RSS_CHILD, str(path), str(count), str(steps)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            results.append({"token_file_mb": mb, "batches": steps, **json.loads(out)})
            path.unlink()
    return results


def bench_loader(source: str, accel: str, steps: int, overrides: list[str]) -> dict:
    """Median time to fetch a batch against the median optimizer step of +recipe=transformer (same process)."""
    from ortflow.api import register_configs
    from ortflow.paths import compose_config
    from ortflow.run.runner import build_data, build_engine, build_model
    from ortflow.run.seeding import seed_everything
    from ortflow.step.batch import split_batch

    register_configs()
    cfg = compose_config(["+recipe=transformer", f"accel={accel}", f"data.source={source}", *overrides])
    seed_everything(cfg.seed)
    data = build_data(cfg)
    model = build_model(cfg, data)
    with tempfile.TemporaryDirectory(prefix="ortflow-loader-") as tmp:
        engine = build_engine(cfg, model, data, Path(tmp))
        batches = iter(data.train)
        engine.train_step(*split_batch(next(batches)))  # export and sessions
        fetch, step = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            batch = next(batches)
            t1 = time.perf_counter()
            engine.train_step(*split_batch(batch))
            step.append(time.perf_counter() - t1)
            fetch.append(t1 - t0)
    f, s = statistics.median(fetch), statistics.median(step)
    return {
        "source": source,
        "accel": accel,
        "batch": f"{cfg.data.batch_size} x {cfg.data.block_size}",
        "fetch_ms": 1000 * f,
        "step_ms": 1000 * s,
        "loader_share_percent": 100 * f / (f + s),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ortflow.bench.tokens", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    corpus = sub.add_parser("corpus")
    corpus.add_argument("out", type=Path)
    corpus.add_argument("--mb", type=int, default=1000)
    prep = sub.add_parser("prepare")
    prep.add_argument("source")
    prep.add_argument("--tokenizer", default="bytes")
    prep.add_argument("--vocab", type=int, default=8192)
    prep.add_argument("--num-proc", type=int)
    prep.add_argument("--train-bytes", type=int, default=100_000_000)
    rss = sub.add_parser("rss")
    rss.add_argument("--mb", type=int, nargs="+", default=[100, 2048])
    rss.add_argument("--steps", type=int, default=2000)
    loader = sub.add_parser("loader")
    loader.add_argument("--source", default="python_docs")
    loader.add_argument("--accel", default="none")
    loader.add_argument("--steps", type=int, default=30)
    loader.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.what == "corpus":
        make_corpus(args.out, args.mb)
        return
    if args.what == "prepare":
        result = bench_prepare(args.source, args.tokenizer, args.vocab, args.num_proc, args.train_bytes)
    elif args.what == "rss":
        result = bench_rss(args.mb, args.steps)
    else:
        result = bench_loader(args.source, args.accel, args.steps, args.overrides)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
