"""`ortflow-export-artifacts RUN_DIR`: a trained run's weights as training artifacts a device trains with ONNX
Runtime's on-device training API (phones, browsers, embedded boxes; no Python, no torch): training, eval and
optimizer models and a checkpoint, manifest.json, an example batch, and a check that the set trains as eager
PyTorch does in a process that cannot import torch. `--web` adds a page that trains it in a browser.

    ortflow-export-artifacts outputs/2026-11-22/10-00-00 --web --lr 1e-3
    python outputs/2026-11-22/10-00-00/device/web/serve.py      # then open http://127.0.0.1:8000/web/
"""

import argparse
import sys
from datetime import datetime
from pathlib import Path

from ortflow.device.export import Request, export
from ortflow.errors import OrtflowError
from ortflow.files import read_record
from ortflow.report import terminal
from ortflow.run.reload import WEIGHTS, rebuild

FOLDER = "device"  # the default --out inside the run dir (export.device=true writes there too)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ortflow-export-artifacts", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help=f"the folder to write (default RUN_DIR/{FOLDER})")
    parser.add_argument("--batch-size", type=int, help="the batch the set trains on (static; default the run's)")
    parser.add_argument("--lr", type=float, help="the learning rate the set carries (default the run's optim.lr)")
    parser.add_argument("--weights", choices=WEIGHTS, default="final", help="the run's weights to export")
    parser.add_argument("--web", action="store_true", help="add web/: a page that trains the set in a browser")
    parser.add_argument("--ort-web", type=Path, help="onnxruntime-web 1.19.2's npm tarball or folder (default: npm)")
    parser.add_argument("--check-steps", type=int, default=5, help="steps of the torch-free check (default 5)")
    parser.add_argument(
        "--with-optimizer-state",
        action="store_true",
        help="carry the run's AdamW moments and step (refused: ONNX Runtime 1.19's API cannot write them)",
    )
    args = parser.parse_args(argv)
    log_file = Path("outputs") / "export" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}.log"
    with terminal.job_logging(log_file):
        try:
            manifest = _export(args)
        except OrtflowError as err:
            print(f"ortflow-export-artifacts: error: {err}", file=sys.stderr)
            sys.exit(2)
    out = args.out or args.run_dir / FOLDER
    print(f"{out}: training, eval and optimizer models, checkpoint, manifest.json, example batch")
    print(f"checked without torch ({manifest['check']['steps']} steps, lr {manifest['learning_rate']['value']:g}):")
    print("\n".join(manifest["check"]["table"]))
    if "web" in manifest:
        print(f"browser: {manifest['web']['serve']}")


# Why --with-optimizer-state is refused: what a user asking for it needs to know.
NO_OPTIMIZER_STATE = (
    "--with-optimizer-state: ONNX Runtime 1.19's training API (the last release with one) creates an optimizer's "
    "moments itself, at zero with step 0, and has no call that sets them: a checkpoint can carry them only once a "
    "device has trained. Exported sets start their optimizer fresh on the device, as manifest.json's `differences` "
    "says; run without --with-optimizer-state (a short warm-up on the device, or a lower --lr, softens the restart)."
)


def _export(args: argparse.Namespace) -> dict:
    if args.with_optimizer_state:
        raise OrtflowError(NO_OPTIMIZER_STATE)
    if args.batch_size is not None and args.batch_size < 1:
        raise OrtflowError(f"--batch-size {args.batch_size}: give a positive batch size.")
    if args.check_steps < 1:
        raise OrtflowError(f"--check-steps {args.check_steps}: give at least 1.")
    cfg, data, model, path = rebuild(args.run_dir, args.weights)
    record = read_record(args.run_dir) or {}
    run = {
        "dir": str(args.run_dir),
        "weights": str(path),
        "engine": (record.get("engine") or {}).get("engine"),
        "precision": record.get("precision"),
        "steps": (record.get("metrics") or {}).get("steps"),
    }
    request = Request(
        out=args.out or args.run_dir / FOLDER,
        batch_size=args.batch_size,
        lr=args.lr,
        steps=args.check_steps,
        web=args.web,
        ort_web=args.ort_web,
    )
    return export(cfg, model, data, request, run)


if __name__ == "__main__":
    main()
