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
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ortflow.errors import OrtflowError
from ortflow.report import terminal
from ortflow.run.reload import TEXT_BUILDER, rebuild
from ortflow.step import loss
from ortflow.step.batch import layout_of, split_batch
from ortflow.step.loss import EvalResult


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
    # Other libraries' notices (torch, transformers) go to a log file, as a run's go to its ortflow.log.
    log_file = Path("outputs") / "predict" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}.log"
    with terminal.job_logging(log_file):
        _predict(args)


def _predict(args: argparse.Namespace) -> None:
    try:
        cfg, data, model, path = rebuild(args.run_dir, args.weights, args.text)
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
