"""Engines are plugins: a fourth engine is one module and one yaml file; engines in one process keep their own
ORT settings and run counters; a mismatched _target_ or a refused option is reported by the engine's own checks."""

import itertools

import pytest
import torch
from omegaconf import OmegaConf

from ortflow import accel
from ortflow.accel.engine import EngineContext
from ortflow.config import DebugConfig, OptimConfig
from ortflow.data.text import build_text_data
from ortflow.run.runner import train
from ortflow.validate import problems
from tests.conftest import TESTS, TINY, USER_ENV, make_cfg, run_cli

PLUGIN = f"hydra.searchpath=[file://{TESTS / 'helpers' / 'plugin'}]"


def test_a_fourth_engine_is_one_module_and_one_yaml(tmp_path):
    cfg = make_cfg(PLUGIN, "accel=tiny", "optim=sgd", "optim.weight_decay=0", *TINY, "trainer.checkpoint.every=3")
    assert problems(cfg) == []
    metrics = train(cfg, tmp_path / "run").metrics
    assert metrics["executed_by"] == "tiny"
    record = OmegaConf.load(tmp_path / "run" / "run.json")
    assert record.engine.tiny_steps == 6 and record.status == "completed"
    # Its checks are its own, reported with every other problem; its checkpoint names it.
    assert any("accel=tiny trains with SGD only" in p for p in problems(make_cfg(PLUGIN, "accel=tiny")))
    from ortflow.run import checkpoint

    assert checkpoint.load(tmp_path / "run" / "checkpoints" / "step-00000006.pt")["accel"] == "tiny"


def test_a_fourth_engine_runs_from_the_command_line(tmp_path):
    args = [PLUGIN, "accel=tiny", "optim=sgd", "optim.weight_decay=0", *TINY, "hydra.run.dir=run"]
    result = run_cli(*args, cwd=tmp_path, env=USER_ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    assert OmegaConf.load(tmp_path / "run" / "run.json").engine.executed_by == "tiny"


def test_check_and_bench_list_the_engines_of_the_search_path(tmp_path):
    """accel/catalog.py reads the config directories the overrides put on the search path: ortflow-check's default
    modes include a user's engine, its row judged by its own run; an engine yaml there that names no importable module
    is refused naming the file."""
    from ortflow.check.modes import fresh_model, try_mode
    from ortflow.errors import ConfigError
    from ortflow.paths import search_dirs

    assert "tiny" in accel.engines(search_dirs([PLUGIN])) and "tiny" not in accel.engines()
    row = try_mode("tiny", [PLUGIN, "optim=sgd", "optim.weight_decay=0", *TINY], 2, fresh_model, grads=False)
    assert row["trains"] and row["executed_by"] == "tiny", row
    from ortflow.cli.bench import parse_args

    assert parse_args(["--modes", "none,tiny", PLUGIN]).modes == "none,tiny"
    with pytest.raises(SystemExit):  # without the search path, tiny is no mode
        parse_args(["--modes", "none,tiny"])
    (tmp_path / "accel").mkdir()
    (tmp_path / "accel" / "broken.yaml").write_text("_target_: no_such_package.engine.build\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml"):
        accel.engines([tmp_path])


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["accel=ortmodule", "accel._target_=ortflow.accel.artifacts.build"], "choose the mode with accel=artifacts"),
        (["accel=artifacts", "accel._target_=ortflow.accel.none.build"], "choose the mode with accel=none"),
        (["accel=none", "accel._target_=no_such_module.build"], "cannot be imported"),
        (["accel=none", "accel._target_=ortflow.run.runner.train"], "is not an engine builder"),
        (["accel=none", "debug=onnx"], "apply to accel=ortmodule only"),
        (["accel=artifacts", "debug=verbose"], "apply to accel=ortmodule only"),
        (["accel=artifacts", "accel.opset=7"], "accel.opset=7"),
    ],
)
def test_the_engine_named_by_target_checks_the_config(overrides, says):
    found = problems(make_cfg(*overrides))
    assert any(says in p for p in found), found


def _ortmodule(tmp_path, model, example, **settings):
    cfg = make_cfg("accel=ortmodule", *(f"accel.{k}={v}" for k, v in settings.items()))
    ctx = EngineContext(
        model,
        example,
        OmegaConf.structured(OptimConfig),
        debug=OmegaConf.structured(DebugConfig),
        onnx_dir=tmp_path / "onnx",
    )
    return accel.build(cfg.accel, ctx)


def _session_threads(engine) -> int:
    manager = engine.module._torch_module._execution_manager(True)
    return manager._execution_agent._inference_session.get_session_options().intra_op_num_threads


def test_two_ortmodule_engines_in_one_process_keep_their_own_settings(tmp_path):
    data = build_text_data("python_docs", block_size=8, batch_size=4, val_fraction=0.1, seed=0)
    batches = list(itertools.islice(iter(data.train), 4))

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(256, 16), torch.nn.Linear(16, 256))

    one = _ortmodule(tmp_path / "a", model(), batches[0], intra_op_threads=1)
    two = _ortmodule(tmp_path / "b", model(), batches[0], intra_op_threads=2)
    for x, y in batches[:2]:  # interleaved: each export and session creation happens while the other exists
        one.train_step(x, y)
        two.train_step(x, y)
    two.train_step(*batches[2])
    assert (_session_threads(one), _session_threads(two)) == (1, 2)
    assert one.runs.snapshot()[:2] == (2, 2) and two.runs.snapshot()[:2] == (3, 3)  # each counts its own runs
    assert torch.backends.mha.get_fastpath_enabled()  # torch's switch is restored outside the engines' calls
