"""Third-party vision models for the zoo tests (tests/accel/test_vision_zoo.py): torchvision and timm, random init,
small enough for 3x32x32 images. model._target_=tests.helpers.vision_zoo.build +model.name=NAME; segmenters
(`lraspp`, `small_unet`), and the digits as 3x32x32 images (`digits_images`), on which docs/models.md's list of models
ortflow-check once called different was measured."""

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from ortflow.data import Data


def build(name: str, num_classes: int = 10, **_ignored) -> nn.Module:
    source, _, model = name.partition(":")
    if source == "timm":
        import timm

        kwargs = {"img_size": 32, "patch_size": 8} if model.startswith("vit") else {}
        return timm.create_model(model, pretrained=False, num_classes=num_classes, **kwargs)
    import torchvision

    if model == "convnext_shrunk":  # ConvNeXt's blocks at a width and depth a 2-core CPU trains in seconds
        from torchvision.models.convnext import CNBlockConfig, ConvNeXt

        settings = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)]
        return ConvNeXt(settings, num_classes=num_classes)
    if model == "googlenet":  # its auxiliary classifiers return a tuple in training: the main head only
        return torchvision.models.get_model(model, weights=None, num_classes=num_classes, aux_logits=False)
    return torchvision.models.get_model(model, weights=None, num_classes=num_classes)


class Segmentation(nn.Module):
    """A torchvision segmentation model's "out" logits, (B, C, H, W)."""

    def __init__(self, name: str, num_classes: int) -> None:
        super().__init__()
        import torchvision

        self.model = torchvision.models.segmentation.__dict__[name](
            weights=None, weights_backbone=None, num_classes=num_classes
        )

    def forward(self, x):
        return self.model(x)["out"]


def digits_images(batch_size: int = 8, seed: int = 0, side: int = 32, segmentation: bool = False) -> "Data":
    """scikit-learn's digits as 3 x side x side images (each 8x8 digit upscaled, bilinear, on every channel), for
    third-party vision models (data=custom data._target_=tests.helpers.vision_zoo.digits_images). `seed` draws the
    split and the batches. With `segmentation`, (B, side, side) targets: the digit's class + 1 where its ink is,
    0 elsewhere (11 classes)."""
    import torch
    from torch.nn import functional
    from torch.utils.data import DataLoader, TensorDataset

    from ortflow.data import Data
    from ortflow.data.digits import build_digits_data

    digits = build_digits_data(batch_size, 0.25, seed)

    def images(loader, **kwargs) -> DataLoader:
        x, y = loader.dataset.tensors
        up = functional.interpolate(x.view(-1, 1, 8, 8), size=(side, side), mode="bilinear", align_corners=False)
        if segmentation:
            y = torch.where(up[:, 0] > 0.5, y.view(-1, 1, 1) + 1, 0)
        return DataLoader(TensorDataset(up.expand(-1, 3, -1, -1).contiguous(), y), batch_size, **kwargs)

    generator = torch.Generator().manual_seed(seed)
    train = images(digits.train, shuffle=True, drop_last=True, generator=generator)
    return Data(train, images(digits.val), {**digits.info, "side": side}, fingerprint=digits.fingerprint)


def lraspp(num_classes: int = 11, **_ignored) -> nn.Module:
    """torchvision's LR-ASPP segmenter (MobileNetV3-large backbone), its "out" logits."""
    return Segmentation("lraspp_mobilenet_v3_large", num_classes)


def small_unet(num_classes: int = 11, width: int = 8, **_ignored) -> nn.Module:
    """A small U-Net: two levels down (conv, ReLU, max-pool), transposed convolutions back up, skip connections,
    (B, C, H, W) logits."""
    import torch

    def block(c_in: int, c_out: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU()
        )

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down1, self.down2 = block(3, width), block(width, 2 * width)
            self.mid = block(2 * width, 4 * width)
            self.up2, self.dec2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2), block(4 * width, 2 * width)
            self.up1, self.dec1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2), block(2 * width, width)
            self.head = nn.Conv2d(width, num_classes, 1)
            self.pool = nn.MaxPool2d(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            d1 = self.down1(x)
            d2 = self.down2(self.pool(d1))
            m = self.mid(self.pool(d2))
            u2 = self.dec2(torch.cat([self.up2(m), d2], dim=1))
            return self.head(self.dec1(torch.cat([self.up1(u2), d1], dim=1)))

    return UNet()
