"""Third-party vision models (torchvision and timm; random init, 3x32x32 images, batch 8) in both ORT engines:
`ortflow-check` gives each engine the verdict "within eager's own noise", or, where eager's own one-ulp runs are too
chaotic at this size for the check to see a 1% step-1 gradient error, "cannot judge" (never "differs");
segmentation models with torch's (B, C, H, W) logits train with the default loss at eager's first-step loss. Minutes
on 2 cores: the slow tier."""

import pytest
import torch

from ortflow.check.modes import check, without_dropout
from tests.accel.test_vision_engines import BATCH, assert_ort_trained, train_both
from tests.conftest import REPO
from tests.helpers.vision_zoo import Segmentation

pytestmark = pytest.mark.slow

IMAGES = ["data=images", "data.image_size=32", "data.train_images=64", "data.val_images=16", "data.batch_size=8"]
MODELS = [
    "torchvision:mobilenet_v3_small",  # Hardswish, Hardsigmoid, squeeze-excitation
    "torchvision:efficientnet_b0",  # SiLU, squeeze-excitation, stochastic depth
    "torchvision:regnet_y_400mf",  # squeeze-excitation, grouped convolutions; ill-conditioned gradients at 32x32
    "torchvision:shufflenet_v2_x0_5",  # channel shuffle by view/transpose
    "torchvision:squeezenet1_1",  # ReLUs everywhere: weights whose gradients are near AdamW's eps
    "torchvision:densenet121",
    "torchvision:convnext_shrunk",  # LayerNorm over channels, depthwise 7x7, permutes
    "torchvision:googlenet",  # conv biases before BatchNorms: their step-1 gradients are rounding noise
    # timm's own builds of the architectures above (mobilenetv3_small_050, efficientnet_b0, regnety_002, resnet18)
    # are the same layer types: they passed and are left out; timm's ConvNeXt and ViT stay, built its own way.
    "timm:convnext_atto",
    "timm:vit_tiny_patch16_224",  # at img_size 32, patch 8
]
# At 32x32 and batch 8 one ulp of the weights moves a gradient of these so far that the check cannot see a 1% error
# (measured on a Zen 4, the smallest error it sees: DenseNet-121 0.035, RegNetY-400MF 0.87; ShuffleNetV2 0.5 0.0061,
# which another CPU's rounding may bring over 1%: either verdict, never "differs"). A batch of 32 does not help (0.15
# and 0.25). GoogLeNet, "cannot judge" while its conv biases' rounding-noise gradients set the bound, is judged.
UNJUDGEABLE = {
    "torchvision:densenet121": True,
    "torchvision:regnet_y_400mf": True,
    "torchvision:shufflenet_v2_x0_5": None,
}


@pytest.mark.parametrize("name", MODELS)
def test_a_third_party_model_trains_within_eagers_own_noise(name, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    overrides = [*IMAGES, "model=custom", "model._target_=tests.helpers.vision_zoo.build", f"+model.name={name}"]
    report = check([*overrides, "+model.num_classes=10"], 3, ["none", "ortmodule", "artifacts"])
    rows = {r["mode"]: r for r in report["rows"]}
    for mode in ("ortmodule", "artifacts"):
        row = rows[mode]
        assert row["trains"] and row["executed_by"] == "onnxruntime", row
        verdicts = {False: ("within eager's own noise",), True: ("cannot judge",)}
        expected = verdicts.get(UNJUDGEABLE.get(name, False), (*verdicts[False], *verdicts[True]))
        assert row["verdict"].startswith(expected), row


def test_resnet18_gets_a_verdict(monkeypatch):
    report = check(
        [*IMAGES, "model=torchvision", "model.name=resnet18", "model.num_classes=10"], 5, ["none", "artifacts"]
    )
    row = next(r for r in report["rows"] if r["mode"] == "artifacts")
    assert report["envelopes"]["fp32"]["detectable"]["gradient"]["error"] is not None
    assert row["verdict"].startswith("within eager's own noise"), row


@pytest.mark.parametrize("name", ["lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large"])
@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_a_segmentation_model_trains_with_the_default_loss(name, kind, tmp_path):
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 5, (BATCH, 32, 32), generator=g))
        for _ in range(2)
    ]
    _, engine, expected, got = train_both(kind, lambda: without_dropout(Segmentation(name, 5)), batches, tmp_path)
    assert got[0] == pytest.approx(expected[0], rel=1e-5)  # the same weights and batch: the same loss
    assert_ort_trained(engine, len(batches))
