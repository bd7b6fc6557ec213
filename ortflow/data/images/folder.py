"""`data=image_folder data.root=DIR`: the user's images in torchvision's ImageFolder layout,
DIR/train/<class>/<image> and DIR/val/<class>/<image> (subfolders of a class folder count too).

The layout is checked before anything trains, and each problem is one DataError naming the folder or file: a
missing or empty folder, no train/ or val/, a class folder without images, a class in val/ that train/ lacks. With
`data.verify=true` (the default) every image's header is read up front (PIL opens it without decoding the pixels:
about a tenth of a millisecond a file, a minute or two for a million), so a file that is not an image (a zero-byte
copy, an HTML page saved as .jpg) stops the run at start-up with every such file named, rather than hours in. An
image whose pixel data is damaged past its header fails when it is first read, naming the file. Hidden files and
folders (.DS_Store, .ipynb_checkpoints) and files without an image extension are skipped, as ImageFolder skips them.
"""

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ortflow.data import Data
from ortflow.data.images.splits import split_loaders
from ortflow.data.images.transforms import Transforms, require_torchvision
from ortflow.errors import DataError

log = logging.getLogger(__name__)

# torchvision.datasets.folder.IMG_EXTENSIONS, the files ImageFolder takes.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
LAYOUT = "DIR/train/<class>/<image> and DIR/val/<class>/<image> (torchvision's ImageFolder layout)"
_SHOWN = 5  # files or folders named in one message


@dataclass
class Split:
    """One split's images: paths, class ids, and what the fingerprint needs (relative path, size, mtime)."""

    paths: list[Path] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    stats: list[str] = field(default_factory=list)
    skipped: int = 0  # files that are hidden or have no image extension


def _listing(folder: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "")
    return shown or "nothing"


def _class_folders(folder: Path, root: Path) -> list[str]:
    """The class names under train/ or val/: its visible subfolders, sorted (ImageFolder's class order)."""
    if not folder.is_dir():
        raise DataError(
            f"data.root={root}: '{folder}' is missing (the folder holds {_listing(root)}). Lay the images out as "
            f"{LAYOUT}."
        )
    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DataError(
            f"data.root={root}: '{folder}' has no class folders (it holds {_listing(folder)}). Put each class's "
            f"images in a folder named for the class: {LAYOUT}."
        )
    return classes


def class_names(root: str | Path) -> list[str]:
    """The class names of an image folder in class-id order (train/'s subfolders, sorted)."""
    folder = Path(root).expanduser()
    return _class_folders(folder / "train", folder)


def _scan(root: Path, split: str, class_ids: dict[str, int], classes: list[str]) -> Split:
    """Every image file under root/split/<class>/, in a fixed order."""
    found = Split()
    empty = []
    for name in classes:
        before = len(found.paths)
        for directory, subdirs, files in os.walk(root / split / name, followlinks=True):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
            for file in sorted(files):
                path = Path(directory, file)
                if file.startswith(".") or not file.lower().endswith(IMAGE_EXTENSIONS):
                    found.skipped += 1
                    continue
                stat = path.stat()
                found.paths.append(path)
                found.labels.append(class_ids[name])
                found.stats.append(f"{path.relative_to(root).as_posix()}\t{stat.st_size}\t{stat.st_mtime_ns}")
        if len(found.paths) == before:
            empty.append(str(root / split / name))
    if empty:
        raise DataError(
            f"data.root={root}: {len(empty)} class folder(s) hold no images ({', '.join(empty[:_SHOWN])}); images are "
            f"files ending in {', '.join(IMAGE_EXTENSIONS)}. Add images or remove the empty folders."
        )
    return found


def _verify(paths: list[Path], root: Path) -> None:
    """Open every image's header (no pixel decoding); one DataError naming every file that is not an image."""
    from PIL import Image

    bad = []
    for path in paths:
        try:
            with Image.open(path) as image:
                image.size  # noqa: B018  (the header is parsed by open; size proves it named one)
        except Exception as err:
            bad.append(f"{path} ({type(err).__name__}: {str(err).strip() or 'unreadable'})")
    if bad:
        raise DataError(
            f"data.root={root}: {len(bad)} file(s) cannot be read as images: {'; '.join(bad[:_SHOWN])}"
            f"{' ...' if len(bad) > _SHOWN else ''}. Replace or remove them (data.verify=false skips this check; a "
            "bad file then stops the run when it is read)."
        )


class ImageFiles:
    """Loads image `i` as an RGB PIL image; a file that cannot be decoded is a DataError naming it."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __call__(self, index: int) -> Any:
        from PIL import Image

        path = self.paths[index]
        try:
            with Image.open(path) as image:
                return image.convert("RGB")  # decodes the pixels; grey and RGBA images become RGB
        except Exception as err:
            raise DataError(
                f"data.root: image '{path}' cannot be decoded ({type(err).__name__}: {str(err).strip()}). Replace or "
                "remove the file."
            ) from None


def fingerprint(stats: list[str]) -> str:
    """A digest of every image's relative path, size and modification time: a changed, added or removed file
    changes it, and it costs one stat per file (no reading)."""
    return hashlib.sha256("\n".join(stats).encode()).hexdigest()[:16]


def build_image_folder_data(
    root: str,
    image_size: int,
    batch_size: int,
    seed: int,
    crop: Any,
    crop_scale: Sequence[float],
    hflip: float,
    mean: Sequence[float],
    std: Sequence[float],
    resize: int | None = None,
    num_workers: int = 0,
    verify: bool = True,
) -> Data:
    """The images under `root` as training and validation loaders, classes numbered by train/'s sorted folders.

    Batches are ((B, 3, image_size, image_size) float images, normalised; (B,) int64 class ids).

    Args:
        root: the folder holding train/ and val/.
        image_size: side of the square images the model gets.
        batch_size: images per batch.
        seed: seeds the training order and the augmentation.
        crop, crop_scale, hflip, mean, std, resize: the transforms (transforms.py).
        num_workers: DataLoader worker processes (decoding is the costly part: use the cores you have).
        verify: read every image's header before training.

    Raises:
        DataError: torchvision is missing; the folder, train/ or val/ is missing; a class folder is empty; val/ has
            a class train/ lacks; a file is not an image; too few training images for one batch.
    """
    require_torchvision("data=image_folder")
    transforms = Transforms.from_config(image_size, resize, crop, crop_scale, hflip, mean, std)
    folder = _root_folder(root)
    classes, val_classes = _split_classes(folder, root)
    class_ids = {name: i for i, name in enumerate(classes)}
    train_split, val_split = _scan(folder, "train", class_ids, classes), _scan(folder, "val", class_ids, val_classes)
    if len(train_split.paths) < batch_size:
        raise DataError(
            f"data.root={root}: train/ has {len(train_split.paths)} images, fewer than one batch of "
            f"data.batch_size={batch_size}; lower data.batch_size or add images."
        )
    if verify:
        _verify(train_split.paths + val_split.paths, folder)
    train, val = split_loaders(
        (ImageFiles(train_split.paths), torch.tensor(train_split.labels)),
        (ImageFiles(val_split.paths), torch.tensor(val_split.labels)),
        (transforms.train(), transforms.eval()),
        batch_size,
        seed,
        num_workers,
    )
    _log_found(root, folder, classes, val_classes, train_split, val_split)
    info = _info(folder, classes, train_split, val_split, transforms)
    return Data(train, val, info, fingerprint=info["fingerprint"])


def _root_folder(root: str) -> Path:
    """The folder `root` names, with ~ expanded; a DataError when it is missing or is a file."""
    folder = Path(root).expanduser()
    if not folder.exists():
        raise DataError(f"data.root={root}: folder '{folder}' does not exist. Give the folder that holds {LAYOUT}.")
    if not folder.is_dir():
        raise DataError(f"data.root={root}: '{folder}' is a file; give the folder that holds {LAYOUT}.")
    return folder


def _split_classes(folder: Path, root: str) -> tuple[list[str], list[str]]:
    """The class names of train/ and of val/; a DataError when val/ has a class that train/ lacks."""
    classes = _class_folders(folder / "train", folder)
    val_classes = _class_folders(folder / "val", folder)
    if unknown := [c for c in val_classes if c not in classes]:
        raise DataError(
            f"data.root={root}: val/ has class folder(s) that train/ lacks: {', '.join(unknown[:_SHOWN])}. The model "
            f"learns only train/'s classes ({len(classes)}: {', '.join(classes[:_SHOWN])}"
            f"{', ...' if len(classes) > _SHOWN else ''}); add training images for them or remove them from val/."
        )
    return classes, val_classes


def _log_found(
    root: str, folder: Path, classes: list[str], val_classes: list[str], train_split: Split, val_split: Split
) -> None:
    """Warn of train/'s classes that val/ lacks, and log the image and class counts and the files skipped."""
    missing = [c for c in classes if c not in val_classes]
    if missing:
        log.warning("data.root=%s: val/ has no images of %d class(es): %s", root, len(missing), ", ".join(missing[:5]))
    skipped = train_split.skipped + val_split.skipped
    log.info(
        "image folder %s: %d train / %d val images, %d classes%s",
        folder,
        len(train_split.paths),
        len(val_split.paths),
        len(classes),
        f" ({skipped} hidden or non-image files skipped)" if skipped else "",
    )


def _info(
    folder: Path, classes: list[str], train_split: Split, val_split: Split, transforms: Transforms
) -> dict[str, Any]:
    """The data's description for the run's records: the folder, the image and class counts, the files skipped,
    the transforms and the fingerprint."""
    return {
        "source": str(folder),
        "train_images": len(train_split.paths),
        "val_images": len(val_split.paths),
        "classes": len(classes),
        "class_names": ", ".join(classes[:20]) + (", ..." if len(classes) > 20 else ""),
        "skipped_files": train_split.skipped + val_split.skipped,
        **transforms.info(),
        "fingerprint": fingerprint(train_split.stats + val_split.stats),
    }
