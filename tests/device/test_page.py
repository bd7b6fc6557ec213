"""The page (and ortflow-device.js under it) trains a set on a person's own data in headless Chromium: a text file for
the language model, a folder of images (one folder per label) for the classifier. The loss falls, the model's
continuation or labels appear, and the parameters it hands back import into torch and evaluate the held-out part
as the page said. Bad data gets a message on the page."""

import base64
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ortflow.cli import export_artifacts, import_artifacts
from ortflow.device import serve
from ortflow.run.reload import rebuild
from ortflow.step import loss as losses
from tests.device import page as browser
from tests.device.conftest import require
from tests.device.test_export import _export, _train, exported  # noqa: F401 (the sets: once per session)

pytestmark = [pytest.mark.device, pytest.mark.browser]

# Mostly ASCII, with multi-byte characters (UTF-8 bytes, or BPE words of byte-level symbols) in every line.
TEXT = " ".join(["the quick brown fox jumps over the lazy dog, and the dog sleeps on. café naïve 😀 —"] * 40)
COLOURS = {"cats": 0, "dogs": 2}  # each label's dominant channel


def _imported(run_dir: Path, folder: Path, page: dict, tmp_path: Path) -> torch.nn.Module:
    """The run's model holding the parameters the page handed back (through ortflow-import-artifacts)."""
    params = tmp_path / "parameters.bin"
    params.write_bytes(base64.b64decode(page["parameters"]))
    out = tmp_path / "device.pt"
    import_artifacts.main([str(params), str(run_dir), "--set", str(folder), "--out", str(out)])
    cfg, _, model, _ = rebuild(run_dir, "final")
    model.load_state_dict(torch.load(out, weights_only=True))
    return model.eval(), cfg


def _falls(values: list[float]) -> bool:
    return np.mean(values[-5:]) < np.mean(values[:5]) - 0.2


@pytest.fixture(scope="module")
def bpe_set(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny transformer trained 3 steps on ortflow's own byte-level BPE (vocabulary 300), exported with the page."""
    run_dir = _train(tmp_path_factory.mktemp("bpe"), "transformer-bpe", "data.tokenizer=bpe", "data.bpe_vocab_size=300")
    return run_dir, _export(run_dir, "--web")


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_the_page_trains_the_language_model_on_a_text_file_and_continues_a_prompt(
    exported,  # noqa: F811
    bpe_set,
    tokenizer,
    tmp_path,
):
    require("npm", "the page's onnxruntime-web comes from npm")
    run_dir, manifest = exported["transformer"] if tokenizer == "bytes" else bpe_set
    assert manifest["preprocessing"]["tokenizer"]["kind"] == tokenizer
    folder = run_dir / export_artifacts.FOLDER
    (folder / "data").mkdir(exist_ok=True)
    (folder / "data" / "mine.txt").write_text(TEXT)
    page = browser.run(
        folder, autorun=None, dump=None, steps=40, data="../data/mine.txt", prompt="the quick", tokens=24
    )
    assert page["status"] == "done" and page["mode"] == "text", page
    assert _falls(page["losses"]), page["losses"]
    assert page["prompt"] == "the quick" and page["continuation"], page
    # The held-out windows, made here as the manifest prescribes (UTF-8 bytes, or the set's tokenizer.json read by
    # Hugging Face tokenizers: the page's own BPE must encode as it does), windows of block_size, next tokens.
    if tokenizer == "bytes":
        ids = list(TEXT.encode())
    else:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(folder / manifest["preprocessing"]["tokenizer"]["file"])).encode(TEXT).ids
    block, held = manifest["preprocessing"]["block_size"], page["heldOut"]
    tokens = torch.tensor(ids)
    assert held["tokens"] == len(tokens) and held["windows"] == (len(tokens) - held["fromToken"] - 1) // block
    starts = [held["fromToken"] + i * block for i in range(held["windows"])]
    inputs = torch.stack([tokens[s : s + block] for s in starts])
    targets = torch.stack([tokens[s + 1 : s + block + 1] for s in starts])
    model, cfg = _imported(run_dir, folder, page, tmp_path)
    with torch.no_grad():
        output = model(inputs)
    loss = float(losses.build(cfg.loss)(output, targets))
    accuracy = float((output.argmax(-1) == targets).float().mean())
    assert page["eval"]["count"] == targets.numel()
    assert abs(loss - page["eval"]["loss"]) <= 1e-5 * loss, (loss, page["eval"])
    assert abs(accuracy - page["eval"]["accuracy"]) <= 1.5 / targets.numel(), (accuracy, page["eval"])


def _image(path: Path, size: int, channel: int, rng: np.random.Generator) -> None:
    pixels = rng.integers(0, 90, (size, size, 3), dtype=np.uint8)
    pixels[..., channel] = rng.integers(150, 256, (size, size))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def _pixels(path: Path, prep: dict) -> torch.Tensor:
    """An image as the manifest prescribes (at the set's size already: no resize), channels first, normalised."""
    array = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255
    mean, std = (np.array(prep["normalize"][k], dtype=np.float32) for k in ("mean", "std"))
    return torch.from_numpy(((array - mean) / std).transpose(2, 0, 1).copy())


class _Losing(serve.Handler):
    """A server that lists a file it then cannot serve (HTTP 500)."""

    def do_GET(self) -> None:
        if self.path.endswith("/00-gone.png"):
            return self.send_error(500)
        return super().do_GET()


def test_the_page_trains_the_classifier_on_a_folder_of_images_and_labels_them(exported, tmp_path):  # noqa: F811
    require("npm", "the page's onnxruntime-web comes from npm")
    run_dir, manifest = exported["vision"]
    folder = run_dir / export_artifacts.FOLDER
    prep, size = manifest["preprocessing"], manifest["preprocessing"]["image_size"]
    assert prep["classes"][:2] == ["disk", "ring"]  # the run's class names, in class-id order
    data = folder / "data" / "mine"
    shutil.rmtree(data, ignore_errors=True)
    rng = np.random.default_rng(0)
    for label, channel in COLOURS.items():
        for i in range(1, 9):
            _image(data / label / f"{i:02d}.png", size, channel, rng)
    _image(data / "cats" / "00-large.png", 2 * size + 3, 0, rng)  # another size: resized (and trained on)
    (data / "dogs" / "00-broken.png").write_bytes(b"not an image")
    _image(data / "cats" / "00-gone.png", size, 0, rng)  # listed, then refused by the server: left out, named
    (data / "notes.txt").write_text("beside the label folders: in none")
    page = browser.run(folder, handler=_Losing, autorun=None, dump=None, steps=30, data="../data/mine/")
    assert page["status"] == "done" and page["mode"] == "image", page
    assert _falls(page["losses"]), page["losses"]
    assert page["labels"] == {"cats": 0, "dogs": 1}  # not the set's class names: classes 0, 1 in sorted order
    assert page["skipped"] == ["notes.txt", "cats/00-gone.png", "dogs/00-broken.png"] and page["resized"] == 1
    held = page["heldOut"]
    assert [h["name"] for h in held] == ["cats/07.png", "cats/08.png", "dogs/07.png", "dogs/08.png"]
    assert [p["name"] for p in page["predictions"]] == [h["name"] for h in held]
    assert all(p["label"] in COLOURS for p in page["predictions"])
    model, cfg = _imported(run_dir, folder, page, tmp_path)
    inputs = torch.stack([_pixels(data / h["name"], prep) for h in held])
    targets = torch.tensor([h["target"] for h in held])
    with torch.no_grad():
        output = model(inputs)
    loss = float(losses.build(cfg.loss)(output, targets))
    assert abs(loss - page["eval"]["loss"]) <= 1e-5 * max(loss, 1e-3), (loss, page["eval"])
    assert [COLOURS_BY_ID[int(i)] for i in output.argmax(-1)] == [p["label"] for p in page["predictions"]]


COLOURS_BY_ID = dict(enumerate(COLOURS))


@pytest.mark.parametrize(
    ("recipe", "data", "says"),
    [
        ("transformer", {"mine.txt": b""}, "the text file is empty"),
        ("transformer", {"mine.txt": b"abc\x00\x01\x02" * 40}, "looks binary"),
        ("transformer", {"mine.txt": b"\xff\xfe" + b"x" * 200}, "not UTF-8 text"),
        ("transformer", {"mine.txt": b"too short"}, "needs at least"),
        ("vision", {"mine/only/a.png": "image", "mine/only/b.png": "image"}, "one label (only)"),
        ("vision", {"mine/a/x.png": "image", "mine/b/x.png": b"junk"}, "no readable image to train on for label b"),
        ("vision", {"checkpoint": None}, "checkpoint"),
    ],
    ids=["empty-text", "binary-text", "not-utf8", "short-text", "one-label", "unreadable-images", "missing-set-file"],
)
def test_bad_data_gets_a_message_on_the_page(exported, recipe, data, says, tmp_path):  # noqa: F811
    require("npm", "the page's onnxruntime-web comes from npm")
    run_dir, manifest = exported[recipe]
    folder = tmp_path / "set"
    shutil.copytree(run_dir / export_artifacts.FOLDER, folder, ignore=shutil.ignore_patterns("check", "data"))
    for name, content in data.items():
        path = folder / ("data" if name != "checkpoint" else "") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.unlink()
        elif content == "image":
            _image(path, manifest["preprocessing"]["image_size"], 0, np.random.default_rng(1))
        else:
            path.write_bytes(content)
    source = next(iter(data)).split("/")[0]
    params = {"data": f"../data/{source}{'/' if source != 'mine.txt' else ''}"} if source != "checkpoint" else {}
    page = browser.run(folder, autorun=None, steps=2, **params)
    assert page["status"] == "error" and page["kind"] == "data", page
    assert says in page["error"], page["error"]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ("../data/missing.txt", "data=../data/missing.txt could not be loaded (HTTP 404)"),
        ("../web/", "data=../web/: the folder cannot be listed (HTTP 404)"),
        ("../data/../../", "cannot be listed (HTTP 404)"),
    ],
    ids=["missing-file", "folder-outside-data", "parent-folder"],
)
def test_data_the_server_does_not_serve_is_named_on_the_page(exported, data, says):  # noqa: F811
    require("npm", "the page's onnxruntime-web comes from npm")
    run_dir, _ = exported["vision"]
    page = browser.run(run_dir / export_artifacts.FOLDER, autorun=None, steps=2, data=data)
    assert page["status"] == "error" and page["kind"] == "data", page
    assert says in page["error"], page["error"]
