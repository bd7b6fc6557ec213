"""Image data: the embedded shapes (determinism, shapes, transforms, fingerprint) and a user's ImageFolder tree (its
layout, its transforms, a clear DataError naming the folder or file for each bad input, a fingerprint that follows
the files)."""

import io
import itertools
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ortflow.data.images import shapes
from ortflow.data.images.embedded import build_images_data
from ortflow.data.images.folder import build_image_folder_data
from ortflow.data.resumable import ResumableBatches
from ortflow.errors import ConfigError, DataError
from tests.conftest import make_cfg

EMBEDDED = {
    "image_size": 32,
    "train_images": 200,
    "val_images": 50,
    "noise": 0.08,
    "batch_size": 16,
    "seed": 0,
    "crop": "center",
    "crop_scale": [0.08, 1.0],
    "hflip": 0.5,
    "mean": [0.5, 0.5, 0.5],
    "std": [0.3, 0.3, 0.3],
}
FOLDER = {
    "image_size": 16,
    "resize": 18,
    "batch_size": 4,
    "seed": 0,
    "crop": "random_resized",
    "crop_scale": [0.5, 1.0],
    "hflip": 0.5,
    "mean": [0.485, 0.456, 0.406],
    "std": [0.229, 0.224, 0.225],
}
CLASSES = ("cat", "dog", "eel")


def images(**changes):
    return build_images_data(**{**EMBEDDED, **changes})


def folder_data(root: Path, **changes):
    return build_image_folder_data(str(root), **{**FOLDER, **changes})


def batches(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(iter(loader), n))


# ------------------------------------------------------------------------------------------------ embedded shapes
def test_embedded_images_are_rgb_of_the_configured_size_with_balanced_classes():
    data = images(image_size=40)
    x, y = next(iter(data.train))
    assert x.shape == (16, 3, 40, 40) and x.dtype == torch.float32 and y.dtype == torch.int64
    labels = data.val.dataset.labels
    assert torch.bincount(labels, minlength=10).tolist() == [5] * 10
    assert data.info["classes"] == 10 and data.info["train_images"] == 200 and data.info["image_size"] == 40


def test_embedded_images_are_drawn_from_the_seed():
    first, again, other = images(), images(), images(seed=1)
    (xa, ya), (xb, yb), (xc, _) = (next(iter(d.val)) for d in (first, again, other))
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, xc)
    assert torch.equal(batches(first.train, 2)[1][0], batches(again.train, 2)[1][0])


def test_training_and_validation_images_are_different_draws():
    data = images(train_images=100, val_images=100)
    assert not torch.equal(data.train.dataset.load(0), data.val.dataset.load(0))


def test_drawn_images_are_never_blank_and_cover_every_class():
    """With no noise, every image still varies (a shape on a background), and all ten classes are drawn."""
    x, y = shapes.generate(400, 32, 0.0, np.random.default_rng(0))
    spread = x.reshape(400, 3, -1).astype(float).std(axis=2).max(axis=1)
    assert (spread > 10).all()
    assert set(y.tolist()) == set(range(10))


def test_normalisation_uses_the_configured_mean_and_std():
    raw = images(mean=[0.0, 0.0, 0.0], std=[1.0, 1.0, 1.0], hflip=0.0)
    scaled = images(mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25], hflip=0.0)
    x_raw, x_scaled = next(iter(raw.val))[0], next(iter(scaled.val))[0]
    assert x_raw.min() >= 0.0 and x_raw.max() <= 1.0
    torch.testing.assert_close(x_scaled, (x_raw - 0.5) / 0.25)


def test_hflip_mirrors_some_training_images_and_no_evaluation_image():
    plain, flipped = images(hflip=0.0), images(hflip=1.0)
    x_plain, _ = next(iter(plain.train))
    x_flip, _ = next(iter(flipped.train))
    torch.testing.assert_close(x_flip, x_plain.flip(-1))  # same order and seeds, every image mirrored
    torch.testing.assert_close(next(iter(flipped.val))[0], next(iter(plain.val))[0])


def test_random_resized_crop_differs_per_epoch_and_keeps_the_size():
    data = images(crop="random_resized", crop_scale=[0.3, 0.6], hflip=0.0, train_images=16)
    first, second = (next(iter(data.train)) for _ in range(2))  # two epochs of one batch
    assert first[0].shape == (16, 3, 32, 32)
    order = [torch.argsort(b[1]) for b in (first, second)]
    assert not torch.allclose(first[0][order[0]], second[0][order[1]])


def test_augmentation_comes_from_the_loader_generator_not_torch_global_rng():
    """Eager and ORT engines draw differently from torch's generator between batches: the batches must not care."""
    data = images(crop="random_resized", crop_scale=[0.3, 1.0])
    torch.manual_seed(1)
    a = batches(data.train, 3)
    again = images(crop="random_resized", crop_scale=[0.3, 1.0])
    torch.manual_seed(2)
    b = batches(again.train, 3)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_worker_processes_give_the_same_augmented_batches():
    kwargs = {"crop": "random_resized", "crop_scale": [0.3, 1.0], "train_images": 48}
    in_process, workers = images(**kwargs), images(**kwargs, num_workers=2)
    for (xa, ya), (xb, yb) in zip(in_process.train, workers.train, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_a_resumed_position_gives_the_same_augmented_batches():
    kwargs = {"crop": "random_resized", "crop_scale": [0.3, 1.0], "train_images": 48}
    run = ResumableBatches(images(**kwargs).train)
    for _ in range(4):  # into the second epoch (3 batches per epoch)
        next(run)
    state = run.state_dict()
    expected = [next(run) for _ in range(4)]
    resumed = ResumableBatches(images(**kwargs).train)
    resumed.load_state_dict(state)
    for (xa, ya), (xb, yb) in zip(expected, (next(resumed) for _ in range(4)), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_embedded_fingerprint_follows_the_generator_settings():
    data = images()
    base = data.fingerprint
    assert base == images().fingerprint and len(base) == 16 and data.info["fingerprint"] == base
    assert base == images(hflip=0.0, batch_size=8).fingerprint  # transforms and batching are not the data
    for change in ({"seed": 1}, {"noise": 0.1}, {"image_size": 40}, {"train_images": 100}):
        assert images(**change).fingerprint != base, change


def test_fewer_drawn_images_than_a_batch_says_what_to_change():
    with pytest.raises(DataError, match=r"data\.train_images=10 is fewer than one batch of data\.batch_size=16"):
        images(train_images=10)


def test_a_crop_scale_out_of_order_names_the_key():
    with pytest.raises(ConfigError, match=r"data\.crop_scale=\[0\.9, 0\.2\]"):
        images(crop="random_resized", crop_scale=[0.9, 0.2])


def test_data_images_composes_from_the_config_group():
    cfg = make_cfg("data=images")
    assert cfg.data._target_.endswith("build_images_data") and cfg.data.image_size >= 32


# --------------------------------------------------------------------------------------------------- image folder
def _png(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (20, 24)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """ROOT/train/<cat|dog|eel>/ 6 PNGs each (a nested subfolder included), ROOT/val/<cat|dog>/ 2 each, plus files
    ImageFolder ignores (hidden, not an image)."""
    root = tmp_path / "pets"
    for c, name in enumerate(CLASSES):
        for i in range(6):
            sub = "nested/" if i == 5 else ""
            _png(root / "train" / name / f"{sub}{i}.png", (80 * c, 10 * i, 200))
        if name != "eel":
            for i in range(2):
                _png(root / "val" / name / f"{i}.png", (80 * c, 0, 100), size=(30, 18))
    (root / "train" / "cat" / "notes.txt").write_text("not an image")
    (root / "train" / "cat" / ".hidden.png").write_bytes(b"")
    (root / "train" / ".ipynb_checkpoints").mkdir()
    return root


def test_an_image_folder_loads_with_classes_from_train(tree):
    data = folder_data(tree)
    assert data.info["classes"] == 3 and data.info["class_names"] == "cat, dog, eel"
    assert data.info["train_images"] == 18 and data.info["val_images"] == 4 and data.info["skipped_files"] == 2
    x, y = next(iter(data.train))
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    xv, yv = next(iter(data.val))
    assert yv.tolist() == [0, 0, 1, 1]  # val has no eel: its classes keep train's numbers
    red = (xv[0, 0] * 0.229 + 0.485).mean()  # cat's red channel is 0, dog's 80/255
    assert red.item() == pytest.approx(0.0, abs=1e-3) and (xv[2, 0] * 0.229 + 0.485).mean().item() == pytest.approx(
        80 / 255, abs=1e-2
    )


def test_an_image_folder_training_loader_drops_the_short_batch_and_is_seeded(tree):
    data = folder_data(tree, batch_size=5)
    epoch = list(data.train)
    assert len(epoch) == 3 and all(len(y) == 5 for _, y in epoch)  # 18 images: 3 full batches
    again = folder_data(tree, batch_size=5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(epoch, again.train, strict=True))


def test_image_folder_composes_and_requires_root():
    from ortflow.validate import problems

    assert any(p.startswith("data.root is required") for p in problems(make_cfg("data=image_folder")))
    assert problems(make_cfg("data=image_folder", "data.root=/x")) == []


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda root: root / "nope", "does not exist"),
        (lambda root: _file(root / "file"), "is a file"),
        (lambda root: _remove(root / "train"), "train' is missing"),
        (lambda root: _remove(root / "val"), "val' is missing"),
        (lambda root: _empty_dir(root / "val"), "has no class folders"),
        (lambda root: _empty_dir(root / "train" / "dog"), "hold no images"),
        (
            lambda root: _png(root / "val" / "fox" / "0.png", (1, 2, 3)),
            "val/ has class folder(s) that train/ lacks: fox",
        ),
        (lambda root: _write(root / "train" / "cat" / "0.png", b"<html>not found</html>"), "0.png"),
        (lambda root: _write(root / "val" / "dog" / "1.jpg", b""), "1.jpg"),
    ],
)
def test_a_bad_image_folder_is_one_data_error_naming_the_folder_or_file(tree, damage, says):
    root = damage(tree) or tree
    with pytest.raises(DataError) as info:
        folder_data(root)
    message = str(info.value)
    assert says in message and "\n" not in message, message
    assert "data.root" in message


def _file(path: Path) -> Path:
    path.write_text("x")
    return path


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def _empty_dir(path: Path) -> None:
    _remove(path)
    path.mkdir()


def _write(path: Path, content: bytes) -> None:
    path.write_bytes(content)


def test_every_unreadable_file_is_named_at_once(tree):
    for name in ("a.png", "b.png"):
        (tree / "train" / "dog" / name).write_bytes(b"junk")
    with pytest.raises(DataError, match=r"2 file\(s\) cannot be read as images: .*a\.png.*b\.png"):
        folder_data(tree)


def _truncated_png(path: Path) -> None:
    pixels = (np.random.default_rng(0).random((64, 64, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    path.write_bytes(buffer.getvalue()[:2000])  # a valid header, half the pixel data


def test_damaged_pixels_pass_the_header_check_and_fail_on_first_read_naming_the_file(tree):
    _truncated_png(tree / "val" / "cat" / "0.png")
    data = folder_data(tree)  # the header is fine
    with pytest.raises(DataError, match=r"image '.*val/cat/0\.png' cannot be decoded"):
        list(data.val)


def test_verify_false_skips_the_header_check(tree):
    (tree / "train" / "cat" / "0.png").write_bytes(b"junk")
    data = folder_data(tree, verify=False)
    assert data.info["train_images"] == 18
    with pytest.raises(DataError, match=r"cat/0\.png"):
        list(data.train)


def test_too_few_training_images_for_a_batch_says_what_to_change(tree):
    with pytest.raises(DataError, match=r"18 images, fewer than one batch of data\.batch_size=32"):
        folder_data(tree, batch_size=32)


def test_image_folder_fingerprint_changes_when_a_file_changes(tree):
    data = folder_data(tree)
    base = data.fingerprint
    assert folder_data(tree).fingerprint == base and data.info["fingerprint"] == base
    path = tree / "train" / "dog" / "3.png"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten (same size, later)
    touched = folder_data(tree).fingerprint
    assert touched != base
    _png(tree / "val" / "eel" / "0.png", (1, 2, 3))
    assert folder_data(tree).fingerprint not in (base, touched)


def test_missing_torchvision_names_the_extra_to_install(tree, monkeypatch):
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision raises ImportError
    for build in (lambda: folder_data(tree), lambda: images()):
        with pytest.raises(DataError, match=r"pip install 'ortflow\[vision\]'"):
            build()
