"""`ortflow-prepare [OVERRIDES]`: tokenize a text corpus once into the token cache, as a run with the same `data.*`
overrides would (and then finds it there). Takes the overrides `ortflow` takes; only `data.*` matters.

    ortflow-prepare data.source=/corpus data.tokenizer=bpe data.bpe_vocab_size=8192
    ortflow-prepare +recipe=transformer_bpe                    # what that recipe trains on
    ortflow-prepare data.source=/corpus/shard.parquet data.text_field=content data.cache_dir=/fast/disk/tokens
    ortflow-prepare --force data.source=/corpus       # again, replacing a prepared store whose files changed

Prints the prepared folder (a `data.source` in its own right) and its manifest's counts; exit status 2 with one
paragraph for a bad source, tokenizer or disk, nothing prepared before lost.
"""

import argparse
import sys
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from ortflow.errors import OrtflowError
from ortflow.report import terminal


def _compose(overrides: list[str]):
    """The data config `ortflow OVERRIDES` would compose, checked against the schema's ranges."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ortflow import ranges
    from ortflow.api import register_configs
    from ortflow.errors import ConfigError, collect
    from ortflow.paths import compose_config

    register_configs()
    try:
        cfg = compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise ConfigError(f"the overrides {overrides} do not compose into a config: {text}") from None
    if not str(cfg.data.get("_target_", "")).endswith("build_text_data"):
        raise ConfigError(
            f"ortflow-prepare tokenizes text data; data._target_={cfg.data.get('_target_')} is not text (use "
            "data=text, the default, with data.source=...)."
        )
    collect([p for p in ranges.problems(cfg) if p.startswith("data.")], "The data settings have problems:")
    return cfg


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ortflow-prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="data.source=... data.tokenizer=... (as for `ortflow`)")
    parser.add_argument(
        "--force", action="store_true", help="prepare again even if the cache holds it (a store whose files changed)"
    )
    args = parser.parse_args(argv)
    # ortflow's warnings on the terminal; other libraries' notices (pyarrow, datasets, tokenizers) in a log file.
    log_file = Path("outputs") / "prepare" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}.log"
    with terminal.job_logging(log_file):
        _prepare(args)


def _prepare(args: argparse.Namespace) -> None:
    try:
        from ortflow.data.tokens.prepare import PrepareSettings, open_or_prepare

        cfg = _compose(args.overrides)
        settings = PrepareSettings.from_config(OmegaConf.to_container(cfg.data, resolve=True))
        store = open_or_prepare(settings, force=args.force)
    except OrtflowError as err:
        text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(f"ortflow-prepare: error: {text}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("ortflow-prepare: interrupted; nothing partial was kept.", file=sys.stderr)
        sys.exit(130)
    manifest = store.manifest
    splits, tokenizer = manifest["splits"], manifest["tokenizer"]
    print(store.path if store.path is not None else "(the embedded corpus in bytes is tokenized in memory by a run)")
    print(
        f"  tokenizer {tokenizer['kind']} (vocabulary {tokenizer['vocab_size']:,}), {manifest['dtype']}; "
        f"train {splits['train']['tokens']:,} tokens ({splits['train']['bytes']:,} bytes), "
        f"val {splits['val']['tokens']:,} tokens ({splits['val']['bytes']:,} bytes); fingerprint "
        f"{manifest['fingerprint']}"
    )


if __name__ == "__main__":
    main()
