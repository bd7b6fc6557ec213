"""`ortflow-import-artifacts PARAMS RUN_DIR`: parameters trained on a device (the page's download, or any runtime's
getContiguousParameters buffer) back into the run's torch model, saved as a torch state_dict that loads into it.

    ortflow-import-artifacts parameters.bin outputs/2026-11-22/10-00-00 --out device.pt
    then, in Python: model.load_state_dict(torch.load("device.pt"))   # the run's model (ortflow.load_run)
"""

import argparse
import sys
from pathlib import Path

import torch

from ortflow.device.export import load_manifest
from ortflow.device.params import into_model, read_buffer
from ortflow.errors import OrtflowError
from ortflow.run.reload import rebuild

FOLDER = "device"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ortflow-import-artifacts", description=__doc__.split("\n\n")[0])
    parser.add_argument("params", type=Path, help="the float32 parameters file (parameters.bin)")
    parser.add_argument("run_dir", type=Path, help="the run the set was exported from")
    parser.add_argument("--set", type=Path, help=f"the exported set's folder (default RUN_DIR/{FOLDER})")
    parser.add_argument("--out", type=Path, help="the state_dict file to write (default PARAMS with .pt)")
    args = parser.parse_args(argv)
    try:
        out = import_parameters(args.params, args.run_dir, args.set, args.out)
    except OrtflowError as err:
        print(f"ortflow-import-artifacts: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{out}: the run's model with the device's parameters (torch.load it into the run's model)")


def import_parameters(params: Path, run_dir: Path, set_dir: Path | None = None, out: Path | None = None) -> Path:
    """Write the state_dict; returns its path.

    Raises:
        OrtflowError: a file that is not a set's parameters, a run or set that does not match.
    """
    manifest = load_manifest(set_dir or run_dir / FOLDER)
    _, _, model, _ = rebuild(run_dir, "final")
    model = into_model(read_buffer(params), manifest, model, str(params))
    out = out or params.with_suffix(".pt")
    torch.save(model.state_dict(), out)
    return out


if __name__ == "__main__":
    main()
