"""Autograd's stop-gradients honoured by both ORT engines (accel/graph/stop_gradients.py), and the first-step check
every ORT run makes (accel/first_step.py) catching what an engine would train wrong."""

import json

import pytest

from ortflow.accel import artifacts, first_step
from ortflow.accel.graph import pipeline, stop_gradients
from ortflow.api import train
from ortflow.model import hooks
from tests.conftest import TINY_TRANSFORMER
from tests.helpers import plants

ENGINES = ["ortmodule", "artifacts"]
IDIOMS = ["teacher_branch", "straight_through", "codebook", "no_grad_block"]
STEPS = 30


def _run(tmp_path, model: str, accel: str, *extra: str, steps: int = STEPS):
    overrides = [
        "model=custom",
        f"model._target_={model if '.' in model else f'tests.helpers.stop_gradients.{model}'}",
        "data=digits",
        "data.batch_size=32",
        f"accel={accel}",
        f"trainer.max_steps={steps}",
        "trainer.eval_every=0",
        *extra,
    ]
    name = "-".join(o.rsplit("=", 1)[-1].rsplit(".", 1)[-1] for o in (model, accel, *extra))
    return train(overrides, run_dir=tmp_path / name)


def _engine(result) -> dict:
    return json.loads((result.run_dir / "run.json").read_text())["engine"]


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory):
    """Each idiom's eval loss after STEPS steps of eager PyTorch (and the detached buffer's)."""
    where = tmp_path_factory.mktemp("eager")
    return {m: _run(where, m, "none").metrics["eval/loss"] for m in [*IDIOMS, "detached_buffer"]}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("idiom", IDIOMS)
def test_stop_gradients_train_to_eagers_losses(idiom, engine, eager_losses, tmp_path):
    """detach(), a no_grad region, the straight-through estimator and a VQ codebook's two stopped losses: the same
    eval loss as eager after 30 steps (relative 1e-5), the stops counted, the first-step check passed."""
    result = _run(tmp_path, idiom, engine)
    assert result.metrics["eval/loss"] == pytest.approx(eager_losses[idiom], rel=1e-5)
    record = _engine(result)
    assert record["executed_by"] == "onnxruntime" and record["ort_train_steps"] == STEPS
    assert record["graph_fixes"].get(stop_gradients.NAME, 0) >= 1
    assert record["first_step_check"]["status"] == "passed", record["first_step_check"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("idiom", IDIOMS)
def test_stop_gradients_hold_in_the_portable_target(idiom, engine, eager_losses, tmp_path):
    """The stops are ONNX's own operators: the portable target (what a device trains) honours them alike."""
    result = _run(tmp_path, idiom, engine, "accel.target=portable")
    assert result.metrics["eval/loss"] == pytest.approx(eager_losses[idiom], rel=1e-5)
    record = _engine(result)
    assert record["graph_plan"]["portable"] and record["graph_fixes"].get(stop_gradients.NAME, 0) >= 1


@pytest.mark.parametrize("engine", ENGINES)
def test_a_detach_of_what_carries_no_gradient_is_left_alone(engine, eager_losses, tmp_path):
    """A buffer's detach (a mask, a cache) stops nothing: no stop is written, the losses are eager's."""
    result = _run(tmp_path, "detached_buffer", engine)
    assert result.metrics["eval/loss"] == pytest.approx(eager_losses["detached_buffer"], rel=1e-5)
    assert stop_gradients.NAME not in _engine(result)["graph_fixes"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("idiom", ["teacher_branch", "no_grad_block"])
def test_the_first_step_check_stops_a_run_whose_stops_were_dropped(idiom, engine, monkeypatch, tmp_path):
    """Without the stops (the export as torch writes it), ORT differentiates through the detach or the no_grad
    region: the first-step check stops the run before its first update, naming the parameter, and writes no
    checkpoint."""
    monkeypatch.setattr(stop_gradients, "mark", lambda graph: 0)
    with pytest.raises(first_step.FirstStepDiffers, match=r"'body(\.0)?\.(weight|bias)' [\d.]+% off") as failed:
        _run(tmp_path, idiom, engine)
    assert "ortflow-check" in str(failed.value) and "accel.verify=false" in str(failed.value)
    assert not list(tmp_path.rglob("*.pt")), "a checkpoint was written"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("precision", "scale"), [("fp32", 1.1), ("bf16-mixed", 1.5)])
def test_the_first_step_check_catches_a_planted_gradient_error(engine, precision, scale, tmp_path):
    """One parameter's gradient planted 10% off in fp32, 50% off in bf16-mixed, inside the engine's graph: stopped,
    that parameter named."""
    mlp = "tests.helpers.zoo.mlp"
    planted = pipeline.planted(plants.scale_gradient("2.weight", scale, engine))
    off = pytest.raises(first_step.FirstStepDiffers, match=r"'2\.weight' (9|10|11|4\d|50|5\d)\.\d% off")
    with plants.declared(), planted, off:
        _run(tmp_path, mlp, engine, f"trainer.precision={precision}", steps=2)


def test_accel_verify_false_trains_without_the_check(monkeypatch, tmp_path):
    """The off switch: the same dropped stop trains on, and run.json says the check was off."""
    monkeypatch.setattr(stop_gradients, "mark", lambda graph: 0)
    result = _run(tmp_path, "teacher_branch", "artifacts", "accel.verify=false", steps=2)
    assert _engine(result)["first_step_check"] == {"status": "off", "reason": "accel.verify=false"}


def test_the_first_step_check_catches_a_gradient_hook_an_engine_would_not_run(monkeypatch, tmp_path):
    """The artifacts engine refuses parameter hooks (its gradients never reach torch's autograd); were that refusal
    missing, the first-step check would stop the run: eager's hook zeroes the weight's gradient, ORT's does not."""
    monkeypatch.setattr(artifacts, "RUNS_IN_STEP", artifacts.RUNS_IN_STEP | {hooks.Kind.parameter_hook})
    with pytest.raises(first_step.FirstStepDiffers, match=r"'0\.weight' "):
        _run(tmp_path, "tests.helpers.zoo.gradient_masked", "artifacts", steps=2)


@pytest.mark.parametrize(
    ("engine", "extra", "side"),
    [
        ("ortmodule", (), first_step.FIRST_STEP),  # its fed dropout masks applied by its own module run eagerly
        ("artifacts", (), first_step.OWN_PASS),  # its masks belong to its graph: a pass of its own, masks all ones
        ("ortmodule", ("trainer.accumulate_grad_batches=2",), first_step.OWN_PASS),
    ],
)
def test_the_check_takes_the_engines_gradients_from_its_first_step_where_it_can(engine, extra, side, tmp_path):
    """The transformer recipe (dropout modules): where the engine's first step has the batch's own gradients (one
    process, one micro-batch, masks eager can apply), the check reads them there, between the backward and the
    update; elsewhere the engine runs a pass of its own. A correct engine passes either way; a gradient planted 10%
    off is caught either way, before any checkpoint."""
    overrides = ["+recipe=transformer", *TINY_TRANSFORMER, f"accel={engine}", "trainer.max_steps=2", *extra]
    result = train(overrides, run_dir=tmp_path / "clean")
    record = _engine(result)["first_step_check"]
    assert record["status"] == "passed" and record["engine_side"] == side, record
    assert _engine(result)["graph_fixes"]["dropout_to_mask_inputs"] >= 1
    planted = pipeline.planted(plants.scale_gradient("fc.weight", 1.1, engine))
    off = pytest.raises(first_step.FirstStepDiffers, match=r"'fc\.weight' (9|10|11)\.\d% off")
    with plants.declared(), planted, off:
        train(overrides, run_dir=tmp_path / "planted")
    assert not list((tmp_path / "planted").rglob("*.pt")), "a checkpoint was written"


def test_the_export_trace_tracks_grad_without_saving_activations():
    """Inside traced_with_grad the forward's values know whether they require grad (the stops are read from that),
    and autograd saves nothing for a backward the export never runs: a backward names the export."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    saved: list[torch.Tensor] = []

    def count(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(count, lambda t: t)
    with torch.no_grad(), hooks, stop_gradients.traced_with_grad(model):
        out = model(torch.randn(4, 8))
    assert out.requires_grad and not saved
    with pytest.raises(RuntimeError, match="exported it to ONNX"):
        out.sum().backward()
