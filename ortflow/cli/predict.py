"""`ortflow-predict RUN_DIR`: use a trained run without training. It rebuilds the run's model from its run.json
config, loads `checkpoints/best.pt` (the best evaluation; `--weights final` for final.pt), and evaluates it on the
run's validation split, or on any text file (`--text FILE`, text recipes). For a language model, `--prompt TEXT`
samples a continuation instead. Text is encoded and decoded with the run's own tokenizer (the tokenizer.json and
data_manifest.json its run dir keeps).

    ortflow-predict outputs/2026-11-22/10-00-00 --text notes.txt
    ortflow-predict outputs/2026-11-22/10-00-00 --prompt "The " --tokens 200 --temperature 0.8
"""

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ortflow.errors import OrtflowError
from ortflow.run.metadata import read_record
from ortflow.step import loss
from ortflow.step.batch import layout_of, split_batch
from ortflow.step.loss import EvalResult

TEXT_BUILDER = "ortflow.data.text.build_text_data"
TOKENIZER_FILE, RUN_MANIFEST = "tokenizer.json", "data_manifest.json"  # what a text run's dir keeps (runner.py)


def load_run(run_dir: Path, weights: str, text: Path | None) -> tuple[DictConfig, Any, nn.Module, Path]:
    """The run's config, data (its own, or `text` for a text run), and model with the chosen weights."""
    from ortflow.run.runner import build_data, build_model

    record = read_record(run_dir)
    if not record or "config" not in record:
        raise OrtflowError(f"{run_dir} holds no run.json with a config; give a run directory written by ortflow.")
    cfg = OmegaConf.create(record["config"])
    if text is not None and cfg.data.get("_target_") != TEXT_BUILDER:
        raise OrtflowError(f"--text: the run in {run_dir} was not trained on text (data={cfg.data._target_}).")
    if cfg.data.get("_target_") == TEXT_BUILDER:
        use_run_tokenizer(cfg, run_dir, record, text)
    path = run_dir / "checkpoints" / f"{weights}.pt"
    if weights == "best" and not path.is_file():
        path = run_dir / "checkpoints" / "final.pt"  # a run without evaluations has no best.pt
    if not path.is_file():
        raise OrtflowError(f"{path} does not exist: the run did not finish (resume it, or use --weights final).")
    data = build_data(cfg)
    if cfg.data.get("_target_") == TEXT_BUILDER:
        check_tokenizer(data, run_dir)
    model = build_model(cfg, data)
    try:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except (RuntimeError, ValueError, OSError) as err:
        raise OrtflowError(f"{path} cannot be loaded into the run's model ({str(err).splitlines()[0]}).") from None
    return cfg, data, model.eval(), path


def use_run_tokenizer(cfg: DictConfig, run_dir: Path, record: dict[str, Any], text: Path | None) -> None:
    """Point the run's text config at the run's own tokenizer: for --text, the tokenizer file the run dir keeps
    (the byte tokenizer when it keeps none); for the run's validation split, the prepared folder it trained on
    when it still exists, else its source prepared again with that tokenizer file."""
    tokenizer = run_dir / TOKENIZER_FILE
    if text is not None:
        cfg.data.source = str(text)
        cfg.data.tokenizer = str(tokenizer) if tokenizer.is_file() else "bytes"
        return
    prepared = (record.get("data") or {}).get("prepared")
    if prepared and (Path(prepared) / "manifest.json").is_file():
        cfg.data.source = prepared
    elif tokenizer.is_file():
        cfg.data.tokenizer = str(tokenizer)


def check_tokenizer(data: Any, run_dir: Path) -> None:
    """Refuse data encoded with another tokenizer than the run's (its manifest in the run dir says which)."""
    manifest = run_dir / RUN_MANIFEST
    if not manifest.is_file():
        return  # a run from before token files: bytes
    tokenizer = json.loads(manifest.read_text())["tokenizer"]
    expected = "bytes" if tokenizer["kind"] == "bytes" else "sha256:" + tokenizer["sha256"][:16]
    if data.tokenizer != expected:
        raise OrtflowError(
            f"the data was encoded with tokenizer {data.tokenizer}, but the run in {run_dir} was trained with "
            f"{expected} ({manifest}); its token ids would mean other text."
        )


@torch.no_grad()
def evaluate(model: nn.Module, objective: loss.Loss, loader: Any, max_batches: int | None) -> dict[str, float]:
    total = EvalResult(0.0, 0)
    for batch in itertools.islice(loader, max_batches):
        inputs, targets = split_batch(batch)
        layout = layout_of(inputs)
        total = total + objective.sums(layout.call(model, layout.flatten(inputs)), targets)
    return {**total.metrics(), "targets": total.count}


@torch.no_grad()
def sample(
    model: nn.Module, tokenizer: Any, prompt: str, tokens: int, block_size: int, temperature: float, seed: int
) -> str:
    """Continue `prompt` token by token (encoded and decoded with the run's tokenizer), drawing each next token from
    the model's softmax at `temperature`."""
    generator = torch.Generator().manual_seed(seed)
    ids = list(tokenizer.encode(prompt))
    if not ids:
        raise OrtflowError("--prompt is empty; give some text to continue.")
    for _ in range(tokens):
        window = torch.tensor([ids[-block_size:]], dtype=torch.long)
        logits = model(window)[0, -1] / max(temperature, 1e-6)
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
    return tokenizer.decode(ids)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ortflow-predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--weights", choices=("best", "final"), default="best")
    parser.add_argument("--text", type=Path, help="evaluate on this text file instead of the validation split")
    parser.add_argument("--batches", type=int, help="evaluate at most this many batches")
    parser.add_argument("--prompt", help="sample a continuation of this text (language models)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens to sample (default 200)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the metrics to this JSON file")
    args = parser.parse_args(argv)
    try:
        cfg, data, model, path = load_run(args.run_dir, args.weights, args.text)
        if args.prompt is not None:
            if cfg.data.get("_target_") != TEXT_BUILDER:
                raise OrtflowError("--prompt samples from a language model; this run was not trained on text.")
            tokenizer = data.tokenizer_object
            print(sample(model, tokenizer, args.prompt, args.tokens, cfg.data.block_size, args.temperature, args.seed))
            return
        split = f"text file {args.text}" if args.text else "the validation split"
        loader = data.val
        if args.text:  # every window of the file, not only its held-out end
            loader = torch.utils.data.DataLoader(
                torch.utils.data.ConcatDataset([data.train.dataset, data.val.dataset]), cfg.data.batch_size
            )
        metrics = evaluate(model, loss.build(cfg.loss), loader, args.batches)
    except OrtflowError as err:
        print(f"ortflow-predict: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{path} on {split}:")
    print(json.dumps(metrics, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"weights": str(path), "split": split, **metrics}, indent=2))


if __name__ == "__main__":
    main()
