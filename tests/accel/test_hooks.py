"""Hooks and state a training step changes, in every engine (ortflow/model/hooks.py): each kind either runs as eager
PyTorch runs it (the same losses, weights, buffers and hook calls) or the engine refuses the model before the first
step, naming the parameter, buffer, attribute or module and the hook. Tiny models, batch 8, 3 steps of SGD (whose
weights move by the gradients themselves, so a hook that did not run shows in the weights)."""

import collections
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn.modules import module as torch_module

from ortflow import accel
from ortflow.accel import auto, catalog
from ortflow.accel.engine import EngineContext
from ortflow.check.modes import check, fresh_model, try_mode
from ortflow.config import FP32, DebugConfig, OptimConfig, OptimName
from ortflow.errors import ModelError
from ortflow.model import hooks
from tests.conftest import REPO, make_cfg

STEPS = 3
RTOL = {"ortmodule": 1e-5, "artifacts": 1e-4, "compile": 1e-5}  # losses; measured <= 1e-7 (ortmodule, compile)
# and <= 2e-6 (artifacts)
EXECUTED_BY = {"ortmodule": "onnxruntime", "artifacts": "onnxruntime", "compile": "inductor"}
ATOL = 1e-5  # weights and buffers after 3 SGD steps (measured <= 1e-7)
SGD = OmegaConf.structured(OptimConfig(name=OptimName.sgd, lr=0.5, weight_decay=0.0))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(STEPS)]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))


@functools.cache
def accel_config(kind: str, *overrides: str):
    return make_cfg(f"accel={kind}", *overrides).accel


def make_engine(kind: str, model: nn.Module, example, tmp: Path, *overrides: str):
    ctx = EngineContext(model, example, SGD, debug=OmegaConf.structured(DebugConfig), onnx_dir=tmp / kind)
    return accel.build(accel_config(kind, *overrides), ctx)


# ---------------------------------------------------------------------------------------------------- the models
class Calls(collections.Counter):
    """How often each hook ran."""

    def hook(self, name: str, result=None) -> Callable:
        def hook(*_args):
            self[name] += 1
            return result(*_args) if result is not None else None

        hook.__qualname__ = f"{name}_hook"
        return hook


def zero_first(*args):  # a gradient hook's replacement: the gradient masked to 0
    return torch.zeros_like(args[-1])


def zero_accumulated(p: torch.Tensor) -> None:  # a post-accumulate-grad hook: the accumulated gradient masked to 0
    p.grad.zero_()


class HookInForward(nn.Module):
    """A gradient hook registered by the forward on the hidden activations (gradient reversal, feature masking)."""

    def __init__(self, calls: Calls) -> None:
        super().__init__()
        self.net, self.calls = mlp(), calls

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        h.register_hook(self.calls.hook("activation", lambda g: g * 0))
        return self.net[2](h)


class Counted(nn.Module):
    """A step counter as a Python attribute that changes the forward (a schedule read inside the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.steps = mlp(), 0

    def forward(self, x):
        self.steps += 1
        return self.net(x) * (1.0 if self.steps < 2 else 0.5)


def counting_buffer(model: nn.Sequential, calls: Calls) -> nn.Module:
    model[0].register_buffer("seen", torch.zeros((), dtype=torch.long))
    model[0].register_forward_hook(lambda module, _args, _out: module.seen.add_(1) and None)
    return model


def with_hooks(setup: Callable[[nn.Sequential, Calls], object]) -> Callable[[Calls], nn.Module]:
    def build(calls: Calls) -> nn.Module:
        model = mlp()
        setup(model, calls)
        return model

    build.setup = setup  # several cases' hooks on one model: test_every_kind_an_engine_runs_at_once
    return build


# kind -> (the model, the engines that run it as eager does, what a refusal names)
CASES: dict[str, tuple[Callable[[Calls], nn.Module], set[str], list[str]]] = {
    "parameter hook": (
        with_hooks(lambda m, c: m[0].weight.register_hook(c.hook("mask", zero_first))),
        {"ortmodule", "compile"},
        ["parameter '0.weight'", "mask_hook", "Tensor.register_hook"],
    ),
    "post-accumulate-grad hook": (
        with_hooks(lambda m, c: m[0].weight.register_post_accumulate_grad_hook(c.hook("zero", zero_accumulated))),
        {"ortmodule", "compile"},
        ["parameter '0.weight'", "zero_hook", "register_post_accumulate_grad_hook"],
    ),
    "full backward hook": (
        with_hooks(lambda m, c: m[2].register_full_backward_hook(c.hook("scale", lambda _m, gi, _go: (gi[0] * 0,)))),
        set(),
        ["module '2' (Linear)", "scale_hook", "register_full_backward_hook"],
    ),
    "full backward pre-hook": (
        with_hooks(lambda m, c: m[2].register_full_backward_pre_hook(c.hook("mask", lambda _m, go: (go[0] * 0,)))),
        set(),
        ["module '2' (Linear)", "mask_hook", "register_full_backward_pre_hook"],
    ),
    "legacy backward hook": (
        with_hooks(lambda m, c: m[2].register_backward_hook(c.hook("log"))),
        set(),
        ["module '2' (Linear)", "log_hook", "register_backward_hook"],
    ),
    "forward hook": (  # an output transform: traced into the exported graph
        with_hooks(lambda m, c: m[1].register_forward_hook(lambda _m, _a, out: out * 2)),
        {"ortmodule", "artifacts", "compile"},
        [],
    ),
    "forward pre-hook": (  # an input transform: traced into the exported graph
        with_hooks(lambda m, c: m[2].register_forward_pre_hook(lambda _m, args: (args[0] * 0.5,))),
        {"ortmodule", "artifacts", "compile"},
        [],
    ),
    "weight_norm pre-hook": (  # a pure reparametrisation: torch's pre-hook recomputes the weight every forward
        with_hooks(lambda m, c: nn.utils.weight_norm(m[2])),
        {"ortmodule", "artifacts", "compile"},
        [],
    ),
    "weight_norm parametrization": (
        with_hooks(lambda m, c: nn.utils.parametrizations.weight_norm(m[2])),
        {"ortmodule", "artifacts", "compile"},
        [],
    ),
    "forward hook updating a buffer": (
        with_hooks(counting_buffer),
        set(),
        ["buffer '0.seen'", "forward hook tests.accel.test_hooks.counting_buffer.<locals>.<lambda>"],
    ),
    "spectral_norm (buffers updated by its pre-hook)": (
        with_hooks(lambda m, c: nn.utils.spectral_norm(m[2])),
        set(),
        ["buffer '2.weight_u'", "buffer '2.weight_v'", "forward pre-hook torch.nn.utils.spectral_norm.SpectralNorm"],
    ),
    "spectral_norm parametrization": (
        with_hooks(lambda m, c: nn.utils.parametrizations.spectral_norm(m[2])),
        set(),
        ["buffer '2.parametrizations.weight.0._u'", "buffer '2.parametrizations.weight.0._v'"],
    ),
    "gradient hook registered in the forward": (
        HookInForward,
        set(),
        ["the forward calls register_hook(tests.accel.test_hooks.activation_hook) at test_hooks.py"],
    ),
    "step counter attribute": (
        lambda calls: Counted(),
        set(),
        ["attribute 'steps'", "outputs change from one call to the next"],
    ),
}
GLOBAL_HOOKS = {
    "forward": (torch_module.register_module_forward_hook, lambda _m, _a, _o: None),
    "forward pre-": (torch_module.register_module_forward_pre_hook, lambda _m, _a: None),
    "backward": (torch_module.register_module_full_backward_hook, lambda _m, _gi, _go: None),
    "backward pre-": (torch_module.register_module_full_backward_pre_hook, lambda _m, _go: None),
}


def state(engine) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in engine.model_state_dict().items()}


def assert_trains_as_eager(kind: str, build: Callable[[Calls], nn.Module], tmp_path: Path) -> Calls:
    """`build`'s model trained by eager PyTorch and by `kind`: the same losses, weights, buffers and hook calls."""
    data = batches()
    eager_calls, calls = Calls(), Calls()
    eager = make_engine("none", build(eager_calls), data[0], tmp_path)
    # the first-step check's two backwards (eager's, the engine's) would run every hook twice more
    off = ["accel.verify=false"] if kind in ("ortmodule", "artifacts") else []
    engine = make_engine(kind, build(calls), data[0], tmp_path, *off)
    expected = [eager.train_step(x, y) for x, y in data]
    got = [engine.train_step(x, y) for x, y in data]
    assert engine.describe()["executed_by"] == EXECUTED_BY[kind]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    want, have = state(eager), state(engine)
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=ATOL, msg=name)
    assert calls == eager_calls  # every hook ran as often as in eager
    return calls


@pytest.mark.parametrize(
    ("case", "kind"),
    [
        # An engine trains the cases it runs: one build each, in the slow tier (the quick tier trains them all in
        # one model: test_every_kind_an_engine_runs_at_once). The refusals come before any build: quick.
        pytest.param(case, kind, marks=[pytest.mark.slow] if kind in runs else [], id=f"{case}-{kind}")
        for case, (_, runs, _) in sorted(CASES.items())
        for kind in ("ortmodule", "artifacts", "compile")
    ],
)
# the legacy register_backward_hook and weight_norm cases: torch's own deprecations, shown to users of them, expected
@pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")
@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
def test_each_hook_runs_as_in_eager_or_the_engine_refuses_naming_it(case, kind, tmp_path):
    build, runs, named = CASES[case]
    if kind in runs:
        assert_trains_as_eager(kind, build, tmp_path)
        return
    with pytest.raises(ModelError) as refused:
        make_engine(kind, build(Calls()), batches()[0], tmp_path)
    message = str(refused.value)
    assert message.startswith(f"accel={kind} cannot train this model as eager PyTorch does")
    assert all(text in message for text in named), message
    assert "accel=none" in message


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts", "compile"])
def test_every_kind_an_engine_runs_at_once(kind, tmp_path):
    """Every hook `kind` runs, on one model (each changes the training: one that did not run shows in the weights)."""
    # (weight_norm's two forms cannot share the layer: the pre-hook's form, deprecated, is tried alone)
    cases = [case for case, (_, runs, _) in CASES.items() if kind in runs and case != "weight_norm pre-hook"]
    assert len(cases) == {"ortmodule": 5, "artifacts": 3, "compile": 5}[kind]

    def build(calls: Calls) -> nn.Module:
        model = mlp()
        for case in cases:
            CASES[case][0].setup(model, calls)
        return model

    calls = assert_trains_as_eager(kind, build, tmp_path)
    assert kind == "artifacts" or calls == {"mask": STEPS, "zero": STEPS}


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts", "compile"])
@pytest.mark.parametrize("which", sorted(GLOBAL_HOOKS))
def test_a_global_module_hook_is_refused_by_the_ort_engines(which, kind, tmp_path):
    register, hook = GLOBAL_HOOKS[which]
    handle = register(hook)
    try:
        with pytest.raises(ModelError, match=f"every module: global {which}hook"):
            make_engine(kind, mlp(), batches()[0], tmp_path)
        make_engine("none", mlp(), batches()[0], tmp_path)  # eager runs it
    finally:
        handle.remove()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "case"), [("artifacts", "parameter hook"), ("ortmodule", "full backward hook")], ids=["artifacts", "ortm"]
)
def test_without_the_refusal_the_engine_would_train_another_model(kind, case, tmp_path, monkeypatch):
    """Why the refusals exist: bypassed, ORT trains on without running the hook, silently."""
    build, _, _ = CASES[case]
    monkeypatch.setattr(hooks, "refuse_unrun", lambda *_args: None)  # (EngineContext.refuse_unrun calls it)
    data = batches()
    eager_calls, calls = Calls(), Calls()
    eager = make_engine("none", build(eager_calls), data[0], tmp_path)
    # what training would become: the first-step check, the net under the refusals, would stop it at step 1
    engine = make_engine(kind, build(calls), data[0], tmp_path, "accel.verify=false")
    for x, y in data:
        eager.train_step(x, y)
        engine.train_step(x, y)
    assert sum(eager_calls.values()) == STEPS and sum(calls.values()) == 0
    moved = max(float((state(engine)[k] - state(eager)[k]).abs().max()) for k in state(eager))
    assert moved > 100 * ATOL


def test_every_problem_is_named_at_once():
    model = CASES["spectral_norm (buffers updated by its pre-hook)"][0](Calls())
    model[0].weight.register_hook(zero_first)
    model[0].register_full_backward_hook(lambda *_: None)
    with pytest.raises(ModelError) as refused:
        hooks.refuse_unrun(model, batches()[0][0], "artifacts", catalog.runs_in_step())
    message = str(refused.value)
    for text in ("parameter '0.weight'", "module '0' (Linear)", "buffer '2.weight_u'", "register_full_backward_hook"):
        assert text in message, message


class FirstCallCache(nn.Module):
    """Fills a cache on its first call only (as rotary-embedding tables and lazy modules do): not a state update."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.register_buffer("scale", torch.zeros(1), persistent=False)
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, x):
        if not self.cache:
            self.cache["ready"] = torch.ones(1)
            self.scale.fill_(1.0)
        return self.net(x) * self.scale


def test_the_probe_leaves_the_model_and_the_random_state_as_they_were():
    model = Counted()
    model.net[2].eval()  # a part kept in eval mode stays so
    model.net[0].register_buffer("seen", torch.zeros(()))
    model.net[0].register_forward_hook(lambda module, _a, _o: module.seen.add_(1) and None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    found = hooks.state_updates(model, batches()[0][0])
    assert {f.kind for f in found} == {hooks.Kind.state_update, hooks.Kind.stateful_forward}
    assert model.steps == 0 and model.training and not model.net[2].training and model.net[0].training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    cached = FirstCallCache()
    assert hooks.state_updates(cached, batches()[0][0]) == []
    assert cached.cache == {} and float(cached.scale) == 0.0  # restored as well


def test_copy_model_keeps_parameter_hooks_and_auto_probes_the_hooked_model(tmp_path):
    calls = Calls()
    model = CASES["parameter hook"][0](calls)
    copied = hooks.copy_model(model)
    copied(batches()[0][0]).sum().backward()
    assert calls["mask"] == 1 and torch.count_nonzero(copied[0].weight.grad) == 0
    ctx = EngineContext(model, batches()[0], SGD, onnx_dir=tmp_path)
    probe = auto.probe_one(ctx, "artifacts", FP32, {}, steps=1)
    assert probe.error is not None and "parameter '0.weight'" in probe.error, probe


def test_the_check_compares_with_the_hooked_model_a_run_builds(monkeypatch):
    """ortflow-check's eager reference keeps the hook (it is built as a run builds it, not deep-copied): its losses
    are those of the masked model; artifacts refuses it. (ORTModule runs the hook: the tests above.)"""
    monkeypatch.syspath_prepend(str(REPO))
    digits = ["data=digits", "data.batch_size=32", "model=custom"]
    report = check([*digits, "model._target_=tests.helpers.zoo.gradient_masked"], 3, ["none", "artifacts"])
    rows = {r["mode"]: r for r in report["rows"]}
    assert not rows["artifacts"]["trains"] and "parameter '0.weight'" in rows["artifacts"]["reason"]
    plain = try_mode("none", [*digits, "model._target_=tests.helpers.zoo.mlp"], 3, fresh_model, None)
    assert rows["none"]["losses"][0] == plain["losses"][0]  # the same model and batches: only the hook differs
    assert rows["none"]["losses"][1:] != plain["losses"][1:]
