"""accel=artifacts' AdamW by torch's fused kernel on ORT's own buffers (optim.fused) against ORT's optimizer graph."""

import pytest
import torch
from omegaconf import OmegaConf

from ortflow import accel
from ortflow.accel import buffer_adamw
from ortflow.accel.compat import ort
from ortflow.accel.compat.ort import buffer_view
from ortflow.accel.engine import EngineContext
from ortflow.config import DebugConfig, OptimConfig
from ortflow.model.mlp import build_mlp
from tests.conftest import make_cfg

STEPS = 6
CLIP = 0.05  # below the model's gradient norms: every step is clipped


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.rand(8, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator))] * STEPS


def artifacts_engine(fused: bool, grad_clip: float | None, example, tmp):
    torch.manual_seed(0)
    model = build_mlp(in_features=64, num_classes=10, hidden=[32, 16])
    optim = OmegaConf.structured(OptimConfig(fused=fused, weight_decay=0.1))
    debug = OmegaConf.structured(DebugConfig)
    ctx = EngineContext(model, example, optim, grad_clip=grad_clip, debug=debug, onnx_dir=tmp / "onnx")
    return accel.build(make_cfg("accel=artifacts").accel, ctx)


@pytest.mark.parametrize("grad_clip", [None, CLIP])
def test_torchs_fused_adamw_on_ort_buffers_steps_as_orts_optimizer_graph(grad_clip, tmp_path):
    data = batches()
    by_torch = artifacts_engine(True, grad_clip, data[0], tmp_path / "torch")
    by_ort = artifacts_engine(False, grad_clip, data[0], tmp_path / "ort")
    start = by_torch.model_state_dict()
    for x, y in data:
        assert by_torch.train_step(x, y) == pytest.approx(by_ort.train_step(x, y), rel=1e-6)
        if grad_clip is not None:
            assert by_torch.last_grad_norm > 2 * grad_clip  # the clipping is exercised
    assert by_torch.describe()["optimizer"] != by_ort.describe()["optimizer"]
    assert by_torch.describe()["ort_train_steps"] == STEPS  # forward and backward are still ORT's runs
    got, want = by_torch.model_state_dict(), by_ort.model_state_dict()
    for name, _ in by_ort.model.named_parameters():
        moved = (want[name] - start[name]).abs().max()
        assert moved > 1e-3, name  # every weight trained
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def _aliased(engine) -> bool:
    """Whether the fused AdamW's parameters are still views of ORT's own weight buffers (a reallocation by ORT would
    leave torch stepping copies ORT never reads again: training stopped without a word)."""
    adamw = engine.optimizer
    names = engine.trainable
    return len(adamw._params) == len(names) and all(
        p.data_ptr() == buffer_view(engine.state._state.get_parameter(n).data).data_ptr()
        for p, n in zip(adamw._params, names, strict=True)
    )


def test_the_fused_adamws_views_still_alias_orts_buffers_after_evaluation_and_batchnorm_updates(tmp_path, monkeypatch):
    """After training steps, evaluations in between and BatchNorm's running statistics written into ORT's state each
    step, the optimizer still steps ORT's own buffers; views planted as copies are told apart."""
    from tests.accel.test_vision_engines import conv_bn, images

    data = images(3)
    torch.manual_seed(0)
    optim = OmegaConf.structured(OptimConfig(fused=True))
    ctx = EngineContext(conv_bn(), data[0], optim, debug=OmegaConf.structured(DebugConfig), onnx_dir=tmp_path / "bn")
    engine = accel.build(make_cfg("accel=artifacts").accel, ctx)
    assert engine.norms is not None and _aliased(engine)
    before = {k: v.clone() for k, v in engine.model_state_dict().items()}
    for x, y in data:
        engine.train_step(x, y)
        engine.eval_step(x, y)
        assert _aliased(engine)
    after = engine.model_state_dict()
    assert not torch.equal(after["0.weight"], before["0.weight"])  # ORT read the weights torch stepped
    monkeypatch.setattr(buffer_adamw, "buffer_view", lambda value: ort.buffer_view(value).clone())
    copied = accel.build(make_cfg("accel=artifacts").accel, ctx)
    assert not _aliased(copied)
