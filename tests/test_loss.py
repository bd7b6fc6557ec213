"""The loss group: each loss against torch's own, eval sums that aggregate exactly, custom losses, and the config
rules that follow from the loss (objective, task)."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from ortflow.errors import OrtflowError
from ortflow.step import loss
from ortflow.validate import problems
from tests.conftest import make_cfg


def _node(**kv):
    return OmegaConf.create(kv)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_matches_torch_and_its_sums_aggregate_to_the_mean(smoothing):
    torch.manual_seed(0)
    out, targets = torch.randn(6, 5, 11), torch.randint(0, 11, (6, 5))
    targets[0, :2] = loss.IGNORE_INDEX
    ce = loss.CrossEntropy(label_smoothing=smoothing)
    flat = out.reshape(-1, 11), targets.reshape(-1)
    torch.testing.assert_close(ce(out, targets), F.cross_entropy(*flat, label_smoothing=smoothing))
    halves = ce.sums(out[:3], targets[:3]) + ce.sums(out[3:], targets[3:])
    metrics = halves.metrics()
    assert halves.count == 28  # 30 targets, 2 ignored
    assert metrics["eval/loss"] == pytest.approx(float(ce(out, targets)), rel=1e-5)
    keep = targets != loss.IGNORE_INDEX
    assert metrics["eval/accuracy"] == pytest.approx(float((out.argmax(-1) == targets)[keep].float().mean()))


def test_mse_and_bce_sums_match_torch():
    torch.manual_seed(0)
    out, targets = torch.randn(8, 3), torch.randn(8, 3)
    mse = loss.MSE().sums(out, targets).metrics()
    assert mse["eval/loss"] == pytest.approx(float(F.mse_loss(out, targets)), rel=1e-5)
    assert mse["eval/mae"] == pytest.approx(float(F.l1_loss(out, targets)), rel=1e-5)
    labels = (targets > 0).float()
    bce = loss.BCEWithLogits(pos_weight=2.0)
    expected = F.binary_cross_entropy_with_logits(out, labels, pos_weight=torch.tensor(2.0))
    assert bce.sums(out, labels).metrics()["eval/loss"] == pytest.approx(float(expected), rel=1e-5)
    torch.testing.assert_close(bce(out, labels), expected)


def test_build_takes_shipped_losses_user_functions_and_user_classes():
    assert isinstance(loss.build(_node(_target_="ortflow.step.loss.MSE")), loss.MSE)
    fn = loss.build(_node(_target_="tests.zoo.mean_abs_error", scale=2.0))
    out, targets = torch.ones(4, 1), torch.zeros(4, 1)
    assert float(fn(out, targets)) == 2.0
    huber = loss.build(_node(_target_="torch.nn.HuberLoss", delta=0.5))
    assert float(huber(out, targets)) == pytest.approx(0.375)  # 0.5 * (1 - 0.5 / 2)


@pytest.mark.parametrize(
    ("target", "says"), [("tests.zoo.nowhere", "cannot be imported"), ("ortflow.step.loss.IGNORE_INDEX", "is a int")]
)
def test_build_refuses_what_is_not_a_loss(target, says):
    with pytest.raises(OrtflowError, match=says):
        loss.build(_node(_target_=target))


def test_the_objective_must_be_a_metric_the_loss_reports():
    assert problems(make_cfg("+recipe=regression", "objective=eval/mae")) == []
    found = problems(make_cfg("+recipe=regression", "objective=eval/accuracy"))
    assert any("objective='eval/accuracy'" in p and "eval/mae" in p for p in found), found
    assert problems(make_cfg("+recipe=digits", "objective=eval/accuracy")) == []


def test_early_stopping_watches_only_an_eval_metric_the_run_reports():
    assert problems(make_cfg("+recipe=digits", "trainer.early_stopping.metric=eval/accuracy")) == []
    found = problems(make_cfg("+recipe=regression", "trainer.early_stopping.metric=eval/accuracy"))
    assert any("trainer.early_stopping.metric='eval/accuracy'" in p and "eval/mae" in p for p in found), found
