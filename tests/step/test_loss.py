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


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("shape", [(6, 7), (6, 7, 4), (6, 7, 4, 3)], ids=["B,C", "B,C,d", "B,C,H,W"])
def test_cross_entropy_takes_torchs_layouts_as_torch_does(shape, smoothing):
    """(B, C) and (B, C, d1, ...) logits with (B, d1, ...) targets: torch's own loss, ignore_index, label smoothing
    and accuracy over the class dimension 1."""
    torch.manual_seed(0)
    out = torch.randn(*shape)
    targets = torch.randint(0, shape[1], (shape[0], *shape[2:]))
    targets[0] = loss.IGNORE_INDEX
    ce = loss.CrossEntropy(label_smoothing=smoothing)
    assert ce.problem(out, targets) is None
    torch.testing.assert_close(ce(out, targets), F.cross_entropy(out, targets, label_smoothing=smoothing))
    halves = (ce.sums(out[:3], targets[:3]) + ce.sums(out[3:], targets[3:])).metrics()
    keep = targets != loss.IGNORE_INDEX
    assert halves["eval/loss"] == pytest.approx(float(ce(out, targets)), rel=1e-5)
    assert halves["eval/accuracy"] == pytest.approx(float((out.argmax(1) == targets)[keep].float().mean()))
    flat = ce.flat_output(out, targets)  # the artifacts engine's layout for ORT's loss block, and back
    torch.testing.assert_close(F.cross_entropy(flat, ce.flat_targets(targets)), F.cross_entropy(out, targets))
    assert torch.equal(ce.unflat_output(flat, targets), out)


def test_cross_entropy_asks_for_class_dim_when_the_shapes_fit_both_layouts():
    out, targets = torch.randn(4, 5, 5), torch.randint(0, 5, (4, 5))
    problem = loss.CrossEntropy().problem(out, targets)
    assert "loss.class_dim=1" in problem and "loss.class_dim=-1" in problem
    with pytest.raises(OrtflowError, match=r"loss\.class_dim"):
        loss.CrossEntropy()(out, targets)
    for dim, torch_out in [(1, out), (-1, out.transpose(1, 2))]:
        ce = loss.CrossEntropy(class_dim=dim)
        assert ce.problem(out, targets) is None
        torch.testing.assert_close(ce(out, targets), F.cross_entropy(torch_out, targets))
    wrong = loss.CrossEntropy(class_dim=1).problem(torch.randn(4, 5, 3), torch.randint(0, 3, (4, 5)))
    assert "loss.class_dim=1" in wrong and "(4, 5, 3)" in wrong
    assert "(4, 'C', 5)" in loss.CrossEntropy().problem(torch.randn(4, 2, 3), targets)
    assert "class_dim" in OmegaConf.to_container(make_cfg("loss=cross_entropy", "loss.class_dim=1").loss)


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
    fn = loss.build(_node(_target_="tests.helpers.zoo.mean_abs_error", scale=2.0))
    out, targets = torch.ones(4, 1), torch.zeros(4, 1)
    assert float(fn(out, targets)) == 2.0
    huber = loss.build(_node(_target_="torch.nn.HuberLoss", delta=0.5))
    assert float(huber(out, targets)) == pytest.approx(0.375)  # 0.5 * (1 - 0.5 / 2)


@pytest.mark.parametrize(
    ("target", "says"),
    [("tests.helpers.zoo.nowhere", "cannot be imported"), ("ortflow.step.loss.IGNORE_INDEX", "is a int")],
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
