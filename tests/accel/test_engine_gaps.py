"""Models that once failed in an ORT engine: torch's segmentation loss layout, ops ORT cannot differentiate,
convolutions oneDNN is picky about (squeeze-excitation's 1x1 maps). Each trains at parity with eager PyTorch in both
ORT engines, proven executed by ORT's own run counters. Tiny models, batch 8."""

import copy

import pytest
import torch
from torch import nn

from tests.accel.test_vision_engines import (
    BATCH,
    CLASSES,
    RTOL,
    assert_ort_trained,
    images,
    make_engine,
    train_both,
)

KINDS = ["ortmodule", "artifacts"]


def segmentation_batches(steps: int = 3, classes: int = 4, side: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(BATCH, 3, side, side, generator=g), torch.randint(0, classes, (BATCH, side, side), generator=g))
        for _ in range(steps)
    ]


def tiny_unet(classes: int = 4) -> nn.Module:
    """Down, up and a skip connection; (B, C, H, W) logits as torch's segmentation models return them."""

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
            self.mid = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
            self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
            self.head = nn.Conv2d(8 + 3, classes, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.cat([self.up(self.mid(self.down(x))), x], dim=1))

    torch.manual_seed(0)
    return UNet()


@pytest.mark.parametrize("kind", KINDS)
def test_a_unet_with_torchs_segmentation_layout_trains_with_the_default_loss(kind, tmp_path):
    batches = segmentation_batches()
    eager, engine, expected, got = train_both(kind, tiny_unet, batches, tmp_path)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert_ort_trained(engine, len(batches))
    x, y = segmentation_batches(1)[0]
    want, have = eager.eval_step(x, y), engine.eval_step(x, y)
    assert have.count == want.count == y.numel()
    assert have.loss_sum == pytest.approx(want.loss_sum, rel=1e-4)
    assert have.sums["accuracy"] == want.sums["accuracy"]


def activations() -> nn.Module:
    """Every activation whose ONNX op ORT 1.19 cannot differentiate (docs/ort-gradients.md), in one small CNN."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
    for act in (
        nn.Hardswish(),
        nn.Hardsigmoid(),
        nn.ELU(),
        nn.SELU(),
        nn.CELU(0.5),
        nn.Softplus(beta=4.0, threshold=0.5),  # not torch's defaults: ortflow's symbolic carries them
        nn.Mish(),
        nn.PReLU(8),
    ):
        layers += [act, nn.Conv2d(8, 8, 1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES))


@pytest.mark.parametrize("kind", KINDS)
def test_activations_without_an_ort_gradient_train_by_decompositions_as_torch_computes_them(kind, tmp_path):
    batches = images(3)
    _, engine, expected, got = train_both(kind, activations, batches, tmp_path)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert_ort_trained(engine, len(batches))
    # One ONNX node each, nn.Mish's Softplus among them; nn.Softplus is written out by ortflow's export symbolic
    assert engine.describe()["graph_fixes"]["ops_without_gradient_decomposed"] == 7


class OpsWithoutAnOrtGradient(nn.Module):
    """A conv stem, one op ORT 1.19 cannot differentiate (docs/ort-gradients.md), a pooled linear head."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)  # 16 -> 8
        if op == "einsum":
            self.mix = nn.Parameter(torch.randn(8, 8) / 3)
        self.body = nn.Conv2d(2 if op == "pixel_shuffle" else 8, 8, 1)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        if self.op == "atan/tan/asin/acos":
            inside = torch.tanh(y) * 0.9
            y = torch.atan(y) + torch.tan(inside) + torch.asin(inside) + torch.acos(inside)
        elif self.op == "floor/round/sign":  # zero gradients: only y's own path reaches the stem
            y = y + y.floor() + y.round() * 0.5 + y.sign()
        elif self.op == "cumsum":
            y = y.cumsum(dim=2)
        elif self.op == "pixel_shuffle":
            y = nn.functional.pixel_shuffle(y, 2)  # (B, 8, 8, 8) -> (B, 2, 16, 16)
        elif self.op == "amax/amin/logsumexp":
            y = y - y.amax(dim=1, keepdim=True) + y.amin(dim=(2, 3)).unsqueeze(-1).unsqueeze(-1)
            y = y + torch.logsumexp(y, dim=1).unsqueeze(1)
        elif self.op == "max(dim)":  # its indices too (ArgMax: integers, nothing to differentiate)
            top, where = y.max(dim=1, keepdim=True)
            y = y * top + where.float()
        elif self.op == "einsum":  # a 1x1 convolution (an ellipsis) and a Gram matrix, written as einsums
            y = torch.einsum("bc...,dc->bd...", y, self.mix)
            y = torch.einsum("bcn,bdn->bcd", y.flatten(2), y.flatten(2)).unsqueeze(-1) / 64
        return self.head(self.body(y).mean(dim=(2, 3)))


# op -> the graph fix that makes it trainable. ORTModule exports max(dim) as an ATen node of its own (torch's
# gradient) and two-operand einsums without an ellipsis as MatMuls (its symbolics): that one needs no fix there.
OPS_WITHOUT_AN_ORT_GRADIENT = {
    "atan/tan/asin/acos": "ops_given_ort_gradients",
    "floor/round/sign": "ops_given_ort_gradients",
    "cumsum": "ops_given_ort_gradients",
    "pixel_shuffle": "ops_without_gradient_decomposed",
    "amax/amin/logsumexp": "ops_given_ort_gradients",
    "max(dim)": "ops_given_ort_gradients",
    "einsum": "ops_without_gradient_decomposed",
}
ORTMODULE_HAS_ITS_OWN = {"max(dim)"}


@pytest.mark.parametrize("op", list(OPS_WITHOUT_AN_ORT_GRADIENT))
@pytest.mark.parametrize("kind", KINDS)
def test_ops_without_an_ort_gradient_train_at_eagers_loss_and_gradients(kind, op, tmp_path):
    from ortflow.check import capture, parity

    batches = images(3)
    torch.manual_seed(0)
    model = OpsWithoutAnOrtGradient(op)
    eager = make_engine("none", copy.deepcopy(model), batches[0], tmp_path)
    engine = make_engine(kind, model, batches[0], tmp_path)
    first, want = capture.step_one(eager, lambda: eager.train_step(*batches[0]))
    expected = [first, *(eager.train_step(x, y) for x, y in batches[1:])]
    first, have = capture.step_one(engine, lambda: engine.train_step(*batches[0]))
    got = [first, *(engine.train_step(x, y) for x, y in batches[1:])]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert want.gradients.keys() == have.gradients.keys()
    assert all(parity.relative(have.gradients[n], g) < RTOL[kind] for n, g in want.gradients.items())  # each one
    assert_ort_trained(engine, len(batches))
    if not (kind == "ortmodule" and op in ORTMODULE_HAS_ITS_OWN):
        assert engine.describe()["graph_fixes"][OPS_WITHOUT_AN_ORT_GRADIENT[op]] >= 1


class Upsampling(nn.Module):
    """Every interpolation mode segmentation heads use, by scale factor and by size (LR-ASPP's and DeepLab's
    F.interpolate(size=input.shape[-2:]))."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.head = nn.Conv2d(4 * 5, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        ups = [
            nn.functional.interpolate(y, scale_factor=2, mode="nearest"),
            nn.functional.interpolate(y, scale_factor=2, mode="bilinear"),
            nn.functional.interpolate(y, scale_factor=2, mode="bilinear", align_corners=True),
            nn.functional.interpolate(y, scale_factor=2, mode="bicubic"),
            nn.functional.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False),
        ]
        return self.head(torch.cat(ups, dim=1)).mean(dim=(2, 3))


@pytest.mark.parametrize("kind", KINDS)
def test_upsampling_trains_by_torchs_kernels_and_gradients(kind, tmp_path):
    batches = images(3)
    torch.manual_seed(0)
    _, engine, expected, got = train_both(kind, Upsampling, batches, tmp_path)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert_ort_trained(engine, len(batches))
    assert engine.describe()["graph_fixes"]["upsamples_run_by_torch"] == 5


class PickyConvs(nn.Module):
    """The convolutions oneDNN is picky about, in one model: stride 2 on an odd size, depthwise, grouped, dilated,
    1x1 convolutions over a 1x1 map, and a squeeze-excitation block (EfficientNet's and RegNetY's, whose gate
    multiplies the feature map: a broadcast whose gradient must be reduced)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)  # 15 -> 8
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.grouped = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2)
        self.squeeze = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 2, 1), nn.SiLU(), nn.Conv2d(2, 8, 1))
        self.pooled = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 8, 1), nn.ReLU(), nn.Conv2d(8, CLASSES, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.grouped(torch.relu(self.depthwise(torch.relu(self.stem(x)))))
        y = y * torch.sigmoid(self.squeeze(y))
        return self.pooled(y).flatten(1)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("kind", KINDS)
def test_convolutions_onednn_is_picky_about_train_at_parity(kind, layout, tmp_path):
    batches = images(3, shape=(3, 15, 15))
    if layout == "channels_last":
        batches = [(x.to(memory_format=torch.channels_last), y) for x, y in batches]
    _, engine, expected, got = train_both(kind, PickyConvs, batches, tmp_path)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert_ort_trained(engine, len(batches))
    assert engine.describe()["graph_fixes"]["convolutions_run_by_torch"] == 7


def test_timms_batchnorm_with_activation_is_trained_as_torchs_batchnorm():
    """timm's BatchNormAct2d copies torch's BatchNorm forward (the same running-statistics update) and adds its
    activation: accepted, where a BatchNorm subclass with a forward of its own is refused."""
    norm_act = pytest.importorskip("timm.layers.norm_act")
    from ortflow.accel.graph import batchnorm
    from ortflow.errors import ModelError

    batchnorm.refuse_unsupported(nn.Sequential(norm_act.BatchNormAct2d(4)), "artifacts")

    class Custom(norm_act.BatchNormAct2d):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(ModelError, match="forward of its own"):
        batchnorm.refuse_unsupported(nn.Sequential(Custom(4)), "artifacts")


def test_the_survey_runs_each_op_alone_through_orts_training_graph_builder():
    from ortflow.accel.graph import gradient_survey

    layers = {name: gradient_survey.LAYERS[name] for name in ("Hardswish", "ReLU", "Upsample(bilinear)")}
    results = gradient_survey.survey(16, layers)
    assert not results["HardSwish"].trains and "not been registered: HardSwish" in results["HardSwish"].status
    assert not results["Resize"].trains and "ResizeGrad" in results["Resize"].status  # no CPU kernel
    assert results["Relu"].trains and results["Relu"].layers == ["ReLU"]
    assert "| HardSwish |" in gradient_survey.markdown(results)
