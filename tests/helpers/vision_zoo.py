"""Third-party vision models for the zoo tests (tests/accel/test_vision_zoo.py): torchvision and timm, random init,
small enough for 3x32x32 images. model._target_=tests.helpers.vision_zoo.build +model.name=NAME."""

from torch import nn


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
