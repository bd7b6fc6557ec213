"""Train an exported set where torch is absent: ONNX Runtime's on-device training API from Python, nothing else.

Run as a script (`python train_without_torch.py SET_DIR`, a copy of this file beside every exported set; ortflow's
export check runs it in a fresh process): it imports only the standard library, numpy and onnxruntime. torch is
made unimportable (`sys.modules["torch"] = None`), and `onnxruntime.training`'s package `__init__`, which imports
torch, is never run: its `api` modules are loaded under stub parent packages whose `__path__` is the real folder.
At the end /proc/self/maps is read: no torch library, nor ORTModule's torch extensions, may be mapped.

It trains `--steps` steps on the set's example batch (manifest.json says its files), evaluates the batch, and
writes the losses, the learning rate the optimizer started at, the mapped libraries checked and the trained
parameters (`get_contiguous_parameters`, every parameter in the manifest's order) into `--out`; beside it, the first
step's gradients (the trainable parameters', in the manifest's order) and every parameter after the first update.
"""

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np

# Paths that would mean torch (or a torch extension) is in this process.
FORBIDDEN_MAPS = ("libtorch", "libc10", "/torch/lib/", "aten_op_executor", "torch_interop_utils", "ortflow/extensions")
FIRST_GRADIENTS, FIRST_PARAMETERS = ".step1-gradients.bin", ".step1-parameters.bin"  # beside --out
DTYPES = {"float32": np.float32, "int64": np.int64, "int32": np.int32, "bool": np.bool_, "float64": np.float64}


def load_training_api() -> tuple[object, object, object, str]:
    """(CheckpointState, Module, Optimizer, onnxruntime's version), torch unimportable, the package __init__ unrun."""
    sys.modules["torch"] = None  # any `import torch` now raises ImportError
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("onnxruntime is not installed (pip install onnxruntime-training==1.19.2, or -cpu)")
    root = Path(next(iter(spec.submodule_search_locations)))
    for name, folder in (
        ("onnxruntime.training", root / "training"),
        ("onnxruntime.training.api", root / "training" / "api"),
    ):
        stub = types.ModuleType(name)
        stub.__path__ = [str(folder)]  # submodules load from the real folder; the package's __init__ never runs
        sys.modules[name] = stub
    sys.modules["onnxruntime.training.ortmodule"] = None  # onnxruntime's import probes for ORTModule (torch)
    import onnxruntime
    from onnxruntime.training.api.checkpoint_state import CheckpointState
    from onnxruntime.training.api.module import Module
    from onnxruntime.training.api.optimizer import Optimizer

    onnxruntime.set_default_logger_severity(3)
    return CheckpointState, Module, Optimizer, onnxruntime.__version__


def mapped_forbidden() -> list[str]:
    """The mapped files of this process that belong to torch or its extensions."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/" in line}
    return sorted(p for p in paths if any(f in p for f in FORBIDDEN_MAPS))


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def read_batch(folder: Path, spec: list[dict]) -> list[np.ndarray]:
    return [np.fromfile(folder / s["file"], dtype=DTYPES[s["dtype"]]).reshape(s["shape"]) for s in spec]


def session_options(threads: int | None, optimize: bool) -> object | None:
    """ONNX Runtime's session options for --threads and --no-graph-optimizations (None: its defaults)."""
    if threads is None and optimize:
        return None
    import onnxruntime

    options = onnxruntime.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    if not optimize:
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    return options


def train(set_dir: Path, steps: int, example_dir: Path, threads: int | None = None, optimize: bool = True) -> dict:
    CheckpointState, Module, Optimizer, version = load_training_api()
    manifest = json.loads((set_dir / "manifest.json").read_text())
    files = manifest["files"]
    feeds = read_batch(example_dir, manifest["example_batch"]["inputs"])
    state = CheckpointState.load_checkpoint(str(set_dir / files["checkpoint"]))
    module = Module(
        str(set_dir / files["training_model"]),
        state,
        str(set_dir / files["eval_model"]),
        session_options=session_options(threads, optimize),
    )
    optimizer = Optimizer(str(set_dir / files["optimizer_model"]), module)
    start_lr = float(optimizer.get_learning_rate())  # left as the runtime sets it: the set carries the rate
    trainable = [t for t in manifest["parameters"]["tensors"] if t["trainable"]]
    losses, first = [], {}
    module.train()
    for step in range(steps):
        losses.append(float(np.asarray(module(*feeds)).reshape(-1)[0]))
        if step == 0:  # the first step's gradients (before clipping and the update), the trainable ones in order
            grads = [np.asarray(state.parameters[t["name"]].grad, np.float32).reshape(-1) for t in trainable]
            first["gradients"] = np.concatenate(grads) if grads else np.zeros(0, np.float32)
        optimizer.step()
        module.lazy_reset_grad()
        if step == 0:  # every parameter and running statistic after the first update
            first["parameters"] = np.asarray(module.get_contiguous_parameters(trainable_only=False).numpy(), np.float32)
    module.eval()
    eval_out = module(*feeds)
    eval_loss = float(np.asarray(eval_out[0] if isinstance(eval_out, (list, tuple)) else eval_out).reshape(-1)[0])
    parameters = np.asarray(module.get_contiguous_parameters(trainable_only=False).numpy(), np.float32)
    return {
        "onnxruntime": version,
        "runtime_start_lr": start_lr,
        "losses": losses,
        "eval_loss": eval_loss,
        "parameters": parameters,
        "first": first,
        "torch_importable": _importable("torch"),
        "forbidden_maps": mapped_forbidden(),
        "training_package_init_run": hasattr(sys.modules["onnxruntime.training"], "__file__"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("set_dir", type=Path, help="the folder holding manifest.json and the set's files")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--example", type=Path, help="the example batch's folder (default: the manifest's)")
    parser.add_argument("--out", type=Path, help="write the result JSON here (the parameters beside it, .bin)")
    parser.add_argument("--threads", type=int, help="ONNX Runtime's intra-op threads (default: its own choice)")
    parser.add_argument(
        "--no-graph-optimizations", action="store_true", help="run the graphs as written (ORT_DISABLE_ALL)"
    )
    args = parser.parse_args(argv)
    manifest = json.loads((args.set_dir / "manifest.json").read_text())
    example = args.example or args.set_dir / manifest["example_batch"]["folder"]
    result = train(args.set_dir, args.steps, example, args.threads, not args.no_graph_optimizations)
    parameters, first = result.pop("parameters"), result.pop("first")
    if args.out is not None:
        parameters.tofile(args.out.with_suffix(".bin"))
        result["parameters_file"] = args.out.with_suffix(".bin").name
        for key, suffix in (("gradients", FIRST_GRADIENTS), ("parameters", FIRST_PARAMETERS)):
            if key in first:
                first[key].tofile(args.out.with_suffix(suffix))
                result[f"first_step_{key}_file"] = args.out.with_suffix(suffix).name
        args.out.write_text(json.dumps(result, indent=2))
    for step, loss in enumerate(result["losses"], 1):
        print(f"step {step}: loss {loss:.7f}")
    print(f"eval loss {result['eval_loss']:.7f}; torch mapped: {result['forbidden_maps'] or 'none'}")
    if result["forbidden_maps"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
