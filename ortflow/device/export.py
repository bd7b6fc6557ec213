"""A trained run's weights as training artifacts for a device (`ortflow-export-artifacts`, `export.device=true`).

export() writes into one folder: the set (training, eval and optimizer models and a checkpoint, made by the
artifacts engine with portable.ENGINE_SETTINGS in fp32), manifest.json (manifest.py), example/ (one batch),
train_without_torch.py (torch_free.py) and check/ (the torch-free check's files: the no-dropout set when the model
has dropout, each run's result); with `web`, web/ (web.py). It ends with the torch-free check (check.py) and
refuses to leave a set that fails it unreported: the failure is raised after the files are written.
"""

import copy
import dataclasses
import importlib.metadata
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ortflow.accel import artifacts
from ortflow.config import OptimConfig, OptimName
from ortflow.data import Data
from ortflow.device import artifact_set, check, graphs, manifest, portable, preprocessing, reference, torch_free
from ortflow.errors import ConfigError, OrtflowError
from ortflow.files import json_text, write_bytes_atomic
from ortflow.model import one_ulp
from ortflow.step import loss as losses
from ortflow.step.batch import Inputs, Layout, layout_of, split_batch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CHECK_FOLDER, NO_DROPOUT = "check", "no_dropout"


@dataclass(frozen=True)
class Request:
    """What to export. batch_size None: the run's; lr None: the run's peak optim.lr."""

    out: Path
    batch_size: int | None = None
    lr: float | None = None
    steps: int = 5  # steps of the torch-free check
    web: bool = False
    ort_web: Path | None = None  # onnxruntime-web's npm tarball or unpacked folder (None: npm fetches it)


def typed_optim(cfg: DictConfig) -> OptimConfig:
    """The run's optim group with its schema's types (run.json holds plain strings, e.g. the name)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OptimConfig), cfg.optim))


def refusals(cfg: DictConfig, optim: OptimConfig) -> list[str]:
    """Why this run cannot become a set any ORT on-device runtime trains (each names the setting)."""
    found = []
    if optim.name == OptimName.sgd and (optim.momentum or optim.weight_decay):
        found.append(
            f"optim.momentum={optim.momentum} / optim.weight_decay={optim.weight_decay}: ORT's on-device SGD "
            "(SGDOptimizerV2) has neither; only AdamW and plain SGD train on a device. Retrain with optim=adamw, or "
            "SGD with both at 0."
        )
    return found


def example_batch(data: Data, size: int) -> tuple[Inputs, torch.Tensor]:
    """The first `size` samples of the validation split (no augmentation: the same batch at every export), else of
    the training split, collated as their loader would."""
    for loader in (data.val, data.train):
        dataset = getattr(loader, "dataset", None)
        if dataset is not None and hasattr(dataset, "__len__") and len(dataset) >= size:
            return split_batch(loader.collate_fn([dataset[i] for i in range(size)]))
    raise ConfigError(f"--batch-size {size}: neither split of the run's data has {size} samples; give a smaller one.")


def _check_out(out: Path) -> None:
    """--out is empty, absent, or holds an earlier export (replaced once the new set passes); anything else is
    refused."""
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise OrtflowError(f"--out {out} is not empty and holds no earlier export ({MANIFEST}); give a new folder.")


def export(
    cfg: DictConfig, model: nn.Module, data: Data, request: Request, run: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write the set for `model`'s weights (the run's `cfg` and `data`) into request.out; returns the manifest.

    The set is written into a new folder beside --out and takes its place only once its check passed: a check that
    fails leaves nothing at --out (an earlier export there stays as it was) and the failed set at `<out>.failed`
    for inspection, its manifest's check saying why.

    Raises:
        OrtflowError: an optimizer or layer no on-device runtime has, a model the export cannot make portable, or a
            set that fails the torch-free check (check.CheckFailed; the check's table in the message).
    """
    out = request.out
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        record = _export(cfg, model, data, dataclasses.replace(request, out=staging), run)
    except check.CheckFailed as err:
        failed = out.with_name(out.name + ".failed")
        shutil.rmtree(failed, ignore_errors=True)
        staging.rename(failed)
        raise check.CheckFailed(f"{err}\nNothing was written to {out}; the failed set is in {failed}.") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return record


def _export(
    cfg: DictConfig, model: nn.Module, data: Data, request: Request, run: dict[str, Any] | None
) -> dict[str, Any]:
    """export() into request.out, a new folder."""
    optim = typed_optim(cfg)
    lr, batch_size = _settings(cfg, optim, data, request)
    objective = losses.build(cfg.loss)
    grad_clip = OmegaConf.select(cfg, "trainer.grad_clip")
    batch = example_batch(data, batch_size)
    model = model.float().eval()
    momenta = artifact_set.batchnorm_momenta(model)  # momentum=None refused before anything is written
    out = request.out
    shipped, check_set, quiet = _build_sets(model, batch, objective, optim, lr, grad_clip, out)

    layout = layout_of(batch[0])
    example = _write_example(out, shipped, objective, layout, batch)
    described = _write_preprocessing(cfg, data, out)
    record = _manifest(cfg, shipped, example, described, optim, lr, grad_clip, batch_size, momenta, run)
    _write_manifests(out, record, shipped, check_set)
    shutil.copyfile(torch_free.__file__, out / check.SCRIPT)

    lr_in_graph = reference.float32_lr(shipped.learning_rate_scale, portable.RUNTIME_LR)
    steps = (layout, batch, objective, optim, lr_in_graph, grad_clip, request.steps)
    eager, envelope = _eager_with_noise(quiet, steps)
    device, dropout_on = _device_runs(out, shipped, check_set, request.steps)
    tensors = record["parameters"]["tensors"]
    gradients = check.device_gradients(device, tensors)
    replay = reference.replayed_update(quiet, gradients, optim, lr_in_graph, grad_clip)
    verdict = check.compare(device, eager, tensors, dropout_on, shipped.dropout_nodes, envelope, replay)
    set_name = str(check_set.folder.relative_to(out)) if check_set is not shipped else "."
    record["check"] = _check_record(request.steps, lr, verdict, device, eager, envelope, set_name)
    _write_manifest(out, record)
    log.info("device export %s, check without torch:\n%s", out, verdict.table())
    _raise_if_failed(verdict)
    if request.web:
        _add_web(out, request.ort_web, record)
    return record


def _settings(cfg: DictConfig, optim: OptimConfig, data: Data, request: Request) -> tuple[float, int]:
    """The export's learning rate and batch size, once the run is known to be one a device can train."""
    if problems := refusals(cfg, optim):
        raise OrtflowError(" ".join(problems))
    lr = float(request.lr if request.lr is not None else optim.lr)
    if not lr > 0:
        raise ConfigError(f"--lr {lr}: give a positive learning rate.")
    batch_size = request.batch_size or int(data.train.batch_size)
    return lr, batch_size


def _build_sets(
    model: nn.Module,
    batch: tuple[Inputs, torch.Tensor],
    objective: losses.Loss,
    optim: OptimConfig,
    lr: float,
    grad_clip: float | None,
    out: Path,
) -> tuple[artifact_set.ArtifactSet, artifact_set.ArtifactSet, nn.Module]:
    """Write the shipped set and, for a model with dropout, the checked one without it; returns them and that model."""
    shipped = artifact_set.build(model, batch, objective, optim, lr, grad_clip, out)
    quiet = model if not shipped.dropout_nodes else artifact_set.without_dropout(model)
    check_set = shipped
    if shipped.dropout_nodes:
        check_set = artifact_set.build(quiet, batch, objective, optim, lr, grad_clip, out / CHECK_FOLDER / NO_DROPOUT)
    return shipped, check_set, quiet


def _write_example(
    out: Path,
    shipped: artifact_set.ArtifactSet,
    objective: losses.Loss,
    layout: Layout,
    batch: tuple[Inputs, torch.Tensor],
) -> list[dict[str, Any]]:
    """Write the example batch as the set's graphs take it into out/example; returns its inputs' manifest entries."""
    inputs, targets = batch
    graph_targets = objective.flat_targets(targets) if shipped.loss_by_ort_block else targets
    feeds = [t.numpy() for t in (*layout.flatten(inputs), graph_targets)]
    return manifest.write_example(out / manifest.EXAMPLE_FOLDER, shipped.user_inputs, feeds)


def _write_preprocessing(cfg: DictConfig, data: Data, out: Path) -> dict[str, Any]:
    """Write the files the preprocessing's description names into `out`; returns the description."""
    described, files = preprocessing.describe(cfg.data, data)
    for name, content in files.items():
        write_bytes_atomic(out / name, content)
    return described


def _write_manifests(
    out: Path, record: dict[str, Any], shipped: artifact_set.ArtifactSet, check_set: artifact_set.ArtifactSet
) -> None:
    """Write the manifest into `out` and, where the check has its own set, into that set with the example's path."""
    _write_manifest(out, record)
    if check_set is not shipped:
        _write_manifest(
            check_set.folder,
            {**record, "example_batch": {**record["example_batch"], "folder": f"../../{manifest.EXAMPLE_FOLDER}"}},
        )


def _eager_with_noise(quiet: nn.Module, steps: tuple[Any, ...]) -> tuple[reference.Reference, check.Envelope]:
    """Eager PyTorch's steps and its own rounding noise, measured from weights moved by one ulp."""
    eager = reference.eager_steps(quiet, *steps)
    seeds = one_ulp.NOISE_SEEDS
    noise = [reference.eager_steps(one_ulp.perturbed(copy.deepcopy(quiet), seed), *steps) for seed in seeds]
    return eager, check.Envelope.measure(eager, noise)


def _device_runs(
    out: Path, shipped: artifact_set.ArtifactSet, check_set: artifact_set.ArtifactSet, steps: int
) -> tuple[check.DeviceRun, check.DeviceRun | None]:
    """Train the checked set without torch, and the shipped one for a step with dropout on where it has dropout."""
    results = out / CHECK_FOLDER
    results.mkdir(exist_ok=True)
    device = check.run_without_torch(out, check_set.folder, steps, results / "dropout_off.json")
    dropout_on = None
    if shipped.dropout_nodes:
        dropout_on = check.run_without_torch(out, out, 1, results / "dropout_on.json")
    return device, dropout_on


def _check_record(
    steps: int,
    lr: float,
    verdict: check.Verdict,
    device: check.DeviceRun,
    eager: reference.Reference,
    envelope: check.Envelope,
    set_name: str,
) -> dict[str, Any]:
    """The manifest's record of the torch-free check: its verdict, both sides' losses, eager's noise, tolerances."""
    return {
        "steps": steps,
        "lr": lr,
        "passed": not verdict.failures,
        "failures": verdict.failures,
        "table": verdict.table().splitlines(),
        "losses_without_torch": device.losses,
        "eval_loss_without_torch": device.eval_loss,
        "losses_eager": eager.losses,
        "set": set_name,
        "eager_noise": envelope.record(),
        "detects": envelope.detects(),  # (the smallest errors it catches; eager_noise holds what sets them)
        "tolerances": _tolerances(),
    }


def _tolerances() -> dict[str, Any]:
    """The check's tolerances as the manifest states them."""
    return {
        "loss_step1": check.TOLERANCE,
        "later_losses": f"max({check.TOLERANCE:g}, {check.LOSS_MARGIN:g} x eager's band at the step)",
        "step1_gradients": f"max({check.GRADIENT_FLOOR:g}, {check.MARGIN:g} x the spread)",
        "first_update": check.UPDATE_TOLERANCE,
        "parameters": f"max({check.PARAMETER_TOLERANCE:g}, {check.MARGIN:g} x the spread)",
        "batchnorm": f"max({check.BATCHNORM_TOLERANCE:g} x scale, {check.MARGIN:g} x the spread)",
    }


def _raise_if_failed(verdict: check.Verdict) -> None:
    """Raise check.CheckFailed with the failures and the table if the set failed its check."""
    if verdict.failures:
        raise check.CheckFailed(
            "the exported set does not train as eager PyTorch does without torch: "
            + "; ".join(verdict.failures)
            + ".\n"
            + verdict.table()
        )


def _add_web(out: Path, ort_web: Path | None, record: dict[str, Any]) -> None:
    """Write the browser page into out/web and add its description to the manifest."""
    from ortflow.device import web

    web.write(out, ort_web)
    record["web"] = web.describe()
    _write_manifest(out, record)


def _write_manifest(folder: Path, record: dict[str, Any]) -> None:
    write_bytes_atomic(folder / MANIFEST, json_text(record, indent=2).encode())


def _manifest(
    cfg: DictConfig,
    shipped: artifact_set.ArtifactSet,
    example: list[dict[str, Any]],
    described: dict[str, Any],
    optim: OptimConfig,
    lr: float,
    grad_clip: float | None,
    batch_size: int,
    momenta: dict[str, float],
    run: dict[str, Any] | None,
) -> dict[str, Any]:
    import onnx
    import onnxruntime

    folder = shipped.folder
    models = {key: onnx.load(str(folder / file)) for key, file in artifact_set.FILES.items() if key != "checkpoint"}
    training, evaluation = models["training_model"], models["eval_model"]
    return {
        "format": manifest.FORMAT,
        "ortflow": importlib.metadata.version("ortflow"),
        "onnxruntime": onnxruntime.__version__,
        "opset": next(o.version for o in training.opset_import if o.domain in ("", "ai.onnx")),
        "domains": {key: graphs.domains(model) for key, model in models.items()},
        "files": dict(artifact_set.FILES),
        "batch_size": batch_size,
        "inputs": {
            "training": manifest.io_spec(training.graph.input, shipped.user_inputs),
            "eval": manifest.io_spec(evaluation.graph.input, shipped.user_inputs),
        },
        "outputs": {
            "training": manifest.io_spec(training.graph.output)[:1],
            "eval": manifest.io_spec(evaluation.graph.output),
        },
        "example_batch": {"folder": manifest.EXAMPLE_FOLDER, "format": "raw little-endian, C order", "inputs": example},
        "preprocessing": described,
        "loss": {
            "config": OmegaConf.to_container(cfg.loss, resolve=True, enum_to_str=True),
            "in_graph": "ORT's loss block on the model's output (targets flattened)"
            if shipped.loss_by_ort_block
            else "exported with the model",
            "reduction": "mean",
        },
        "optimizer": manifest.optimizer(optim, grad_clip),
        "learning_rate": manifest.learning_rate(lr, float(optim.lr), shipped.learning_rate_scale),
        "parameters": manifest.parameters(shipped),
        "batchnorm": manifest.batchnorm(momenta),
        "dropout": {"nodes": shipped.dropout_nodes, "by": "ORT's Dropout op in the training graph (no mask inputs)"},
        "run": run or {},
        "differences": manifest.differences(cfg, lr, batch_size, shipped.dropout_nodes, bool(momenta)),
        "portable_settings": {"accel": artifacts.NAME, **portable.ENGINE_SETTINGS, "precision": portable.PRECISION},
    }


def load_manifest(folder: Path) -> dict[str, Any]:
    """An export's manifest.json.

    Raises:
        OrtflowError: the folder holds no export.
    """
    path = folder / MANIFEST if folder.is_dir() else folder
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise OrtflowError(
            f"'{path}' is not an exported set's manifest ({err}); give the folder --out wrote."
        ) from None
    if record.get("format") != manifest.FORMAT:
        raise OrtflowError(f"'{path}' is not an ortflow device manifest (format {record.get('format')!r}).")
    return record
