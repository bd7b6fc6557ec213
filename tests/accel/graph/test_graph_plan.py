"""The graph plan (ortflow/accel/graph/plan.py, pipeline.py): one settings type and one pipeline for both ORT
engines; a new switchable op is one module plus one field; `accel.target=portable` trains the recipes with ONNX
and com.microsoft operators only, and refuses an op it has no path for, naming the module."""

import copy
import re
from pathlib import Path

import onnx
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from ortflow.accel import artifacts, ortmodule
from ortflow.accel.compat import ortmodule_patches
from ortflow.accel.engine import EngineContext
from ortflow.accel.graph import pipeline
from ortflow.accel.graph import plan as graph_plan
from ortflow.config import DebugConfig, OptimConfig
from ortflow.errors import ModelError
from ortflow.validate import problems
from tests.conftest import make_cfg
from tests.helpers import graphs, tanh_op

optim = OmegaConf.structured(OptimConfig)
ENGINES = {
    "artifacts": (artifacts.ArtifactsEngine, tanh_op.ArtifactsSettings, artifacts.Settings),
    "ortmodule": (ortmodule.ORTModuleEngine, tanh_op.ORTModuleSettings, ortmodule.Settings),
}


def context(model: nn.Module, example, tmp: Path) -> EngineContext:
    return EngineContext(model, example, optim, debug=OmegaConf.structured(DebugConfig), onnx_dir=tmp / "onnx")


def trained_graphs(engine) -> list[onnx.ModelProto]:
    """The graphs an engine has trained with so far (ORTModule: after its first training step)."""
    if engine.name == "artifacts":
        return [onnx.load(str(engine.onnx_dir / f"{name}_model.onnx")) for name in ("training", "eval", "optimizer")]
    return [ortmodule_patches.training_graph(engine.module)]


def operators(models: list[onnx.ModelProto]) -> set[tuple[str, str]]:
    found = set()
    for model in models:
        for node in model.graph.node:
            operator = next((a.s.decode() for a in node.attribute if a.name == "operator"), "")
            found.add((node.domain or "ai.onnx", f"{node.op_type}:{operator}" if operator else node.op_type))
    return found


def tanh_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.parametrize("kind", ["artifacts", "ortmodule"])
def test_a_switchable_op_is_one_module_plus_one_field_and_both_engines_pick_it_up(kind, tmp_path):
    engine_type, with_field, _ = ENGINES[kind]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]
    eager = nn.Sequential(*copy.deepcopy(list(tanh_mlp())))
    opt = torch.optim.AdamW(
        eager.parameters(), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay
    )
    expected = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(eager(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    with tanh_op.declared():
        engine = engine_type(context(tanh_mlp(), batches[0], tmp_path / "on"), with_field())
        got = [engine.train_step(x, y) for x, y in batches]
        assert ("org.pytorch.aten", "ATen:tanh") in operators(trained_graphs(engine))
        assert engine.describe()["graph_plan"]["ops"]["tanh"] == "torch"
        assert engine.describe()["ort_train_steps"] == len(batches)
        off = engine_type(context(tanh_mlp(), batches[0], tmp_path / "off"), with_field(aten_tanh=False))
        off.train_step(*batches[0])
        assert ("org.pytorch.aten", "ATen:tanh") not in operators(trained_graphs(off))
        assert off.describe()["graph_plan"]["ops"]["tanh"] == "ort"
    assert "tanh" not in graph_plan.OPS  # taken out again: the other tests' plans never see it
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


def test_every_switchable_op_names_a_graph_setting_and_every_setting_switches_an_op():
    settings = set(graph_plan.setting_names()) - {"target"}
    declared = {op.setting for op in graph_plan.OPS.values() if op.setting is not None}
    assert declared == settings
    for op in graph_plan.OPS.values():
        assert op.module.startswith("ortflow.accel.graph."), op  # each declared where it is implemented
    # autograd's stops settle first (the others rewrite what they read), then the fixes that make a graph trainable
    first = ["stop_gradients", "attention_dropout_mode", "batchnorm_statistics"]
    assert [op.name for op in pipeline.ops_in_order()][:3] == first
    # the pipeline's one order table names every op with a rewrite, once, and nothing else
    rewriting = [name for name, op in graph_plan.OPS.items() if op.rewrite is not None]
    assert sorted(pipeline.ORDER) == sorted(rewriting) and len(set(pipeline.ORDER)) == len(pipeline.ORDER)


def test_an_op_with_a_rewrite_and_no_place_in_the_order_is_refused(monkeypatch):
    monkeypatch.setattr(pipeline, "ORDER", tuple(n for n in pipeline.ORDER if n != "gelu"))
    with pytest.raises(LookupError, match="gelu"):
        pipeline.ops_in_order()


def test_both_engines_take_their_graph_settings_from_the_one_list():
    graph = {f.name for f in graph_plan.fields(graph_plan.GraphSettings)}
    for module in (artifacts, ortmodule):
        own = {f.name for f in graph_plan.fields(module.Settings)} - graph
        assert not own & {name for name in own if name.startswith(("rewrite_", "aten_"))}, own
        assert issubclass(module.Settings, graph_plan.GraphSettings)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_fast_target_keeps_todays_choices_and_the_portable_one_takes_ort_everywhere(precision):
    fast = graph_plan.GraphPlan.compute(artifacts.Settings(), precision, "artifacts")
    assert fast.path("convolution") is graph_plan.Path.torch and fast.path("dropout") is graph_plan.Path.fed
    assert fast.path("batchnorm_statistics") is graph_plan.Path.host
    bf16 = precision == "bf16-mixed"
    for op in ("gemm", "layer_norm", "gelu", "cross_entropy"):
        assert fast.by_torch(op) == bf16, op
    portable = graph_plan.GraphPlan.compute(artifacts.Settings(target="portable"), "fp32", "artifacts")
    assert set(portable.paths.values()) == {graph_plan.Path.ort}
    assert portable.record()["target"] == "portable" and not portable.torch_kernels


def test_the_portable_target_in_bf16_is_refused_naming_both_keys():
    for mode in ("artifacts", "ortmodule"):
        found = problems(make_cfg(f"accel={mode}", "accel.target=portable", "trainer.precision=bf16-mixed"))
        assert any("accel.target=portable" in p and "trainer.precision=fp32" in p for p in found), found
        assert not problems(make_cfg(f"accel={mode}", "accel.target=portable"))


class Upsampler(nn.Module):
    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.up = nn.Sequential(nn.ConvTranspose2d(4, 4, 2, stride=2) if transposed else nn.Upsample(scale_factor=2))
        self.head = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.head(self.up(self.body(x)).flatten(1))


@pytest.mark.parametrize("kind", ["artifacts", "ortmodule"])
@pytest.mark.parametrize(
    ("transposed", "named"),
    [(True, "module up.0 (ConvTranspose2d): it has a transposed convolution"), (False, "module up.0 (Upsample)")],
)
def test_the_portable_target_refuses_an_op_without_an_ort_path_naming_the_module(kind, transposed, named, tmp_path):
    engine_type, _, settings = ENGINES[kind]
    x, y = torch.randn(4, 3, 4, 4), torch.randint(0, 10, (4,))
    expected = re.escape(f"accel.target=portable cannot train the model's {named}")
    with pytest.raises(ModelError, match=expected) as refused:
        engine = engine_type(context(Upsampler(transposed), (x, y), tmp_path), settings(target="portable"))
        engine.train_step(x, y)
    assert "accel.target=fast" in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["transformer", "vision", "digits"])
def test_the_portable_target_trains_every_recipe_in_both_engines_with_ort_operators_only(recipe):
    """No org.pytorch.aten node and no mask input in any graph, ORT's Dropout and BatchNorm kernels inside it, the
    losses of eager PyTorch at dropout 0."""
    expected, _ = graphs.recipe_losses(recipe, "none", "model.dropout=0.0" if recipe == "transformer" else None)
    for mode in ("artifacts", "ortmodule"):
        got, engine = graphs.recipe_losses(
            recipe, mode, "accel.target=portable", "model.dropout=0.0" if recipe == "transformer" else None
        )
        models = trained_graphs(engine)
        assert {domain for domain, _ in operators(models)} <= {"ai.onnx", "com.microsoft"}, (mode, operators(models))
        assert not [i.name for m in models for i in m.graph.input if i.name.startswith("dropout_mask")]
        info = engine.describe()
        assert info["executed_by"] == "onnxruntime" and info["graph_plan"]["target"] == "portable"
        if mode == "artifacts":
            assert info["graph_plan"]["portable"] is True
        if recipe == "vision":  # the running statistics are ORT's kernel's, counted by the host
            assert info["batchnorm_updates"] == len(got)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=2e-4, atol=0, msg=mode)


def test_the_portable_artifacts_graphs_keep_dropout_and_batchnorm_inside(tmp_path):
    """The transformer's Dropout nodes stay ORT's own (no mask input) and the fast target's differ: fed masks and
    torch-kernel nodes, recorded as not portable."""
    fast = graphs.engine_graphs("transformer", "artifacts", "fp32")
    portable = graphs.engine_graphs("transformer", "artifacts", "fp32", "accel.target=portable")
    assert any(i.name.startswith("dropout_mask") for i in fast["training"].graph.input)
    assert not any(i.name.startswith("dropout_mask") for i in portable["training"].graph.input)
    assert ("ai.onnx", "Dropout") in operators([portable["training"]])
    assert pipeline.portable(*portable.values())
