"""What a device must do to its raw data before the set trains on it, read from the run's data config: the
tokenizer and its file for text, the crop and normalisation for images, the scaling of the bundled tables; for a
user's own data builder, only what the example batch shows."""

from typing import Any

from omegaconf import DictConfig

from ortflow.data import Data

TEXT = "ortflow.data.text.build_text_data"
IMAGES = ("ortflow.data.images.embedded.build_images_data", "ortflow.data.images.folder.build_image_folder_data")
DIGITS = "ortflow.data.digits.build_digits_data"
DIABETES = "ortflow.data.diabetes.build_diabetes_data"
TOKENIZER_FILE = "tokenizer.json"


def describe(data_cfg: DictConfig, data: Data) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest's `preprocessing` entry, and the files it names (name -> content) to write beside it."""
    target = str(data_cfg.get("_target_"))
    if target == TEXT:
        return _text(data_cfg, data)
    if target in IMAGES:
        return {**_images(data_cfg), "classes": class_names(target, data_cfg)}, {}
    if target == DIGITS:
        return {
            "kind": "table",
            "input": "the 64 pixel intensities (0..16) of an 8x8 digit, row by row, divided by 16: float32 (batch, 64)",
            "targets": "the digit, int64 0..9",
        }, {}
    if target == DIABETES:
        return {
            "kind": "table",
            "input": "the 10 standardised features of load_diabetes(scaled=True): float32 (batch, 10)",
            "targets": "disease progression standardised as (y - target_mean) / target_std: float32 (batch, 1)",
            "target_mean": data.info.get("target_mean"),
            "target_std": data.info.get("target_std"),
        }, {}
    return {
        "kind": "custom",
        "data_target": target,
        "note": "the run's own data builder made the inputs; the example batch shows their shapes and dtypes",
    }, {}


def _text(data_cfg: DictConfig, data: Data) -> tuple[dict[str, Any], dict[str, bytes]]:
    files: dict[str, bytes] = {}
    tokenizer_object = data.tokenizer_object
    kind = getattr(tokenizer_object, "kind", "bytes")
    tokenizer: dict[str, Any] = {"kind": kind, "identity": data.tokenizer}
    if kind == "bytes":
        tokenizer["encode"] = "the text's UTF-8 bytes are the token ids (0..255)"
    elif TOKENIZER_FILE in data.run_files:
        files[TOKENIZER_FILE] = data.run_files[TOKENIZER_FILE]
        tokenizer["file"] = TOKENIZER_FILE
        tokenizer["encode"] = "Hugging Face tokenizers' tokenizer.json (tokenizers, or transformers.js in a browser)"
    return {
        "kind": "text",
        "tokenizer": tokenizer,
        "vocab_size": data.info.get("vocab_size"),
        "block_size": int(data_cfg.block_size),
        "input": "int64 token ids (batch, block_size): windows of block_size tokens",
        "targets": "int64 (batch, block_size): each position's next token (the window shifted by one)",
    }, files


def class_names(target: str, data_cfg: DictConfig) -> list[str]:
    """The class names in class-id order: the embedded shapes', or the image folder's train/ subfolders (sorted)."""
    if target == IMAGES[0]:
        from ortflow.data.images import shapes

        return list(shapes.CLASSES)
    from ortflow.data.images import folder

    return folder.class_names(data_cfg.root)


def _images(data_cfg: DictConfig) -> dict[str, Any]:
    size = int(data_cfg.image_size)
    return {
        "kind": "image",
        "layout": "float32 (batch, 3, image_size, image_size), RGB, channels first",
        "image_size": size,
        "eval_resize": data_cfg.get("resize") or size,
        "eval_crop": "the shorter side resized to eval_resize, then a center crop of image_size",
        "scale": "pixel values / 255 (0..1)",
        "normalize": {"mean": [float(m) for m in data_cfg.mean], "std": [float(s) for s in data_cfg.std]},
        "formula": "(pixel / 255 - mean[c]) / std[c]",
        "training_augmentation_not_in_set": {
            "crop": str(getattr(data_cfg.crop, "value", data_cfg.crop)),
            "hflip": float(data_cfg.hflip),
        },
        "targets": "int64 class ids (batch,)",
    }
