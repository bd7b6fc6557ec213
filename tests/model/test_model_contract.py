"""The model contract, checked before the first step in every accel mode: a builder that returns the wrong thing, a
forward with the wrong output, a model that mixes samples across the batch; sequence-first models by config."""

import itertools

import pytest
import torch
from omegaconf import OmegaConf

from ortflow import accel
from ortflow.accel.engine import EngineContext
from ortflow.config import DebugConfig, OptimConfig
from ortflow.data.text import build_text_data
from ortflow.model import builder_node, sequence_first
from ortflow.model.contract import check_model
from ortflow.step.loss import CrossEntropy
from tests.conftest import REPO, TINY, make_cfg
from tests.helpers.seed_model import build as build_seed_model

BIGRAM = ["+model.vocab_size=256", "+model.width=16"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["model=custom", "model._target_=os.getcwd"], "returned str"),
        (["model=custom", "model._target_=builtins.dict"], "returned dict"),
        (["model=custom", "model._target_=tests.helpers.user_model.build_returns_int"], "forward returned int"),
        (
            ["model=custom", "model._target_=tests.helpers.user_model.build_wrong_rank", *BIGRAM],
            "logits of shape (8, 256)",
        ),
        (["model=custom", "model._target_=tests.helpers.user_model.build_too_few_classes", *BIGRAM], "10 classes"),
        (["model=custom", "model._target_=tests.helpers.seed_model.build"], "mixes samples across the batch dimension"),
        (["model=transformer", "data=digits", "model.vocab_size=256"], "forward failed on a data batch"),
    ],
)
@pytest.mark.parametrize("mode", ["none", "ortmodule", "artifacts"])
def test_a_model_that_breaks_the_contract_is_refused_before_training(
    args, says, mode, tmp_path, ortflow_cli, monkeypatch
):
    monkeypatch.syspath_prepend(str(REPO))
    base = [a for a in TINY[4:] if "data=digits" not in args or not a.startswith("data.block_size")]
    status, stderr = ortflow_cli(*args, *base, f"accel={mode}", "hydra.run.dir=r", cwd=tmp_path)
    assert status == 2 and says in stderr, stderr[-2000:]
    assert "Traceback" not in stderr and "model._target_=" in stderr
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [".hydra", ".ortflow.lock", "ortflow.log", "run.json"]


def test_a_vocabulary_that_follows_data_without_one_is_refused_naming_the_key(tmp_path, ortflow_cli):
    status, stderr = ortflow_cli("model=transformer", "data=digits", "hydra.run.dir=r", cwd=tmp_path)
    assert status == 2 and "model.vocab_size is null" in stderr and "Traceback" not in stderr, stderr[-2000:]


def test_the_shipped_transformer_and_a_sequence_first_model_pass_the_batch_check():
    x = torch.randint(0, 256, (4, 8))
    shipped = make_cfg("model.vocab_size=256")
    from hydra.utils import instantiate

    check_model(instantiate(builder_node(shipped.model)), x, x, CrossEntropy(), "transformer")
    check_model(sequence_first(build_seed_model()), x, x, CrossEntropy(), "seed")
    with pytest.raises(Exception, match="mixes samples"):
        check_model(build_seed_model(), x, x, CrossEntropy(), "seed")


@pytest.mark.parametrize("mode", ["ortmodule", "artifacts"])
def test_the_seed_document_model_trains_sequence_first_in_every_mode_with_parity(mode, tmp_path):
    data = build_text_data("python_docs", block_size=8, batch_size=4, val_fraction=0.1, seed=0)
    batches = list(itertools.islice(iter(data.train), 5))

    def engine(kind: str):
        torch.manual_seed(0)
        model = sequence_first(build_seed_model(dropout=0.0))
        ctx = EngineContext(
            model,
            batches[0],
            OmegaConf.structured(OptimConfig),
            debug=OmegaConf.structured(DebugConfig),
            onnx_dir=tmp_path / kind,
        )
        return accel.build(make_cfg(f"accel={kind}").accel, ctx)

    eager, ort = engine("none"), engine(mode)
    expected = [eager.train_step(x, y) for x, y in batches]
    got = [ort.train_step(x, y) for x, y in batches]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=0)
    assert ort.describe()["executed_by"] == "onnxruntime"


def test_artifacts_refuses_syncbatchnorm_before_training_naming_the_layer(tmp_path, ortflow_cli, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    args = ["model=custom", "model._target_=tests.helpers.zoo.sync_batchnorm_mlp", "data=digits", "accel=artifacts"]
    status, stderr = ortflow_cli(*args, "trainer.max_steps=2", "hydra.run.dir=r", cwd=tmp_path)
    assert status == 2 and "SyncBatchNorm" in stderr and "Traceback" not in stderr, stderr[-2000:]
    status, stderr = ortflow_cli(*args[:-1], "accel=none", "trainer.max_steps=2", "hydra.run.dir=r", cwd=tmp_path)
    assert status == 0, stderr[-2000:]  # refused before training: the dir takes the corrected command
