"""The page through its own controls, as a person uses it, in headless Chromium driven by Playwright: pick a text
file, click Train, watch the loss table grow and the curve draw, read the held-out loss, type a prompt and continue
it, download the parameters and import them with ortflow-import-artifacts; pick a folder of images (a broken file,
one of another size, one beside the label folders), train, label new images (one broken). The controls have labels
and are reached by keyboard. Nothing leaves the page: the page is opened with URL parameters that point at a
listener on another loopback port, and the listener receives nothing (nor does any request leave the page's
origin). Bad data picked gets its message on the page."""

import http.server
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from ortflow.cli import export_artifacts, import_artifacts
from ortflow.run.reload import rebuild
from ortflow.step import loss as losses
from tests.device import page as browser
from tests.device.conftest import require
from tests.device.test_export import _export, _train, exported  # noqa: F401 (the sets: once per session)
from tests.device.test_page import TEXT, _image

pytestmark = [pytest.mark.device, pytest.mark.browser]

STEPS = 30
READY = "Ready."
# The controls a person uses, by their labels (the accessible names Playwright finds them by).
TEXT_CONTROLS = ("text-file", "steps", "train", "download", "prompt", "continue", "temperature")


class _Listener(http.server.BaseHTTPRequestHandler):
    """Another origin: it records whatever reaches it."""

    got: list[str]

    def _record(self) -> None:
        self.got.append(f"{self.command} {self.path}")
        self.send_response(204)
        self.send_header("Access-Control-Allow-Origin", "*")
        self.end_headers()

    do_GET = do_POST = do_PUT = do_OPTIONS = _record

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def chromium():
    require("npm", "the page's onnxruntime-web comes from npm")
    with browser.chromium() as found:
        yield found


def _status(page, says: str) -> str:
    """The status line once it holds `says` (it says what the page is doing, or what is wrong)."""
    page.wait_for_function(
        "says => document.getElementById('status').textContent.includes(says)", arg=says, timeout=120_000
    )
    return page.locator("#status").inner_text()


def _screenshot(page, name: str) -> None:
    """The page as it stands, into $ORTFLOW_SCREENSHOTS (docs/images/ holds docs/devices.md's, made so) if set."""
    if folder := os.environ.get("ORTFLOW_SCREENSHOTS"):
        page.screenshot(path=Path(folder) / name, full_page=True)


def _tab_order(page) -> list[str]:
    """The ids of the elements Tab reaches from the top of the page, in order, once round."""
    page.locator("h1").click()  # Tab goes on from here: the top
    reached: list[str] = []
    for _ in range(40):
        page.keyboard.press("Tab")
        found = page.evaluate("document.activeElement ? document.activeElement.id : ''")
        if found in reached:
            break
        reached.append(found)
    return reached


def _watch(page) -> None:
    """Record the loss table's rows and the curve's points each time the page changes them."""
    page.evaluate(
        """() => {
        window.seen = { rows: [], points: [] };
        const body = document.querySelector('#losses tbody'), curve = document.getElementById('curve');
        new MutationObserver(() => seen.rows.push(body.rows.length)).observe(body, { childList: true });
        new MutationObserver(() => {
          const line = curve.querySelector('polyline');
          if (line) seen.points.push(line.getAttribute('points').trim().split(/\\s+/).length);
        }).observe(curve, { childList: true });
      }"""
    )


@pytest.fixture(scope="module")
def text_run(exported, chromium, tmp_path_factory):  # noqa: F811
    """The transformer set trained through the page's controls on a text file, the page opened with `report=` and
    `data=` pointing at a listener on another loopback port. What the page showed, the downloaded parameters, every
    request the page made and what the listener received."""
    run_dir, manifest = exported["transformer"]
    folder = run_dir / export_artifacts.FOLDER
    check_set = folder / manifest["check"]["set"]
    tmp = tmp_path_factory.mktemp("controls")
    mine = tmp / "mine.txt"
    mine.write_text(TEXT)
    got: list[str] = []
    listener = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("L", (_Listener,), {"got": got}))
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    elsewhere = f"http://127.0.0.1:{listener.server_address[1]}"
    try:
        with browser.served(folder) as base:
            page = chromium.new_page(accept_downloads=True)
            requests: list[str] = []
            page.on("request", lambda request: requests.append(request.url))
            # The dropout-off set (its check's): step 1's loss is then torch's on the first batch, exactly.
            params = {"set": f"../{manifest['check']['set']}", "report": f"{elsewhere}/r", "data": f"{elsewhere}/m.txt"}
            page.goto(browser.url(base, **params))
            refused = browser.result(page)["error"]  # data= refused at load, with its message
            assert refused in page.locator("#status").inner_text()
            page.get_by_label("A text file").set_input_files(mine)
            _status(page, READY)
            about = page.locator("#data-about").inner_text()
            page.get_by_label("Steps").fill(str(STEPS))
            _watch(page)
            page.get_by_role("button", name="Train", exact=True).click()
            shown = browser.result(page)
            seen = page.evaluate("window.seen")
            evaluation = page.locator("#evaluation").inner_text()
            page.locator("summary", has_text="Losses").click()  # the table, folded under "Losses"
            rows = page.locator("#losses tbody tr").all_inner_texts()
            tab_order = _tab_order(page)
            # The person's own prompt, typed, and Continue pressed from the keyboard.
            prompt = page.get_by_label("Prompt")
            prompt.fill("")
            prompt.press_sequentially("the lazy")
            prompt.press("Tab")
            page.keyboard.press("Enter")
            continued = browser.result(page)
            continuation = page.locator("#continuation").inner_text()
            _screenshot(page, "device-page.png")
            with page.expect_download() as download:
                page.get_by_role("button", name="Download trained parameters").click()
            parameters = tmp / "parameters.bin"
            download.value.save_as(parameters)
            # The page's Content-Security-Policy: even a script in the page cannot reach another origin.
            attempt = "url => fetch(url, { method: 'POST', body: 'x' }).then(() => 'sent', () => 'refused')"
            sent = page.evaluate(attempt, f"{elsewhere}/post")
            page.close()
    finally:
        listener.shutdown()
        listener.server_close()
    return {
        "run_dir": run_dir, "folder": check_set, "manifest": manifest, "tmp": tmp, "refused": refused, "about": about,
        "shown": shown, "seen": seen, "evaluation": evaluation, "rows": rows, "tab_order": tab_order,
        "continued": continued, "continuation": continuation, "parameters": parameters, "requests": requests,
        "origin": base, "got": got, "sent": sent,
    }  # fmt: skip


def test_nothing_the_page_trains_on_leaves_it(text_run):
    assert text_run["got"] == []  # report= and data= named the listener: it received nothing
    assert text_run["sent"] == "refused"  # a fetch to it from inside the page is refused by the browser
    assert "is on another server" in text_run["refused"], text_run["refused"]
    elsewhere = [u for u in text_run["requests"] if not u.removeprefix("blob:").startswith(text_run["origin"] + "/")]
    assert text_run["requests"] and not elsewhere, elsewhere
    assert text_run["shown"]["mode"] == "text"  # it trained: on the picked file, with the listener named


def test_the_controls_have_labels_and_are_reached_by_keyboard(text_run):
    assert set(TEXT_CONTROLS) <= set(text_run["tab_order"]), text_run["tab_order"]
    # Continue was pressed with Enter after Tab from the prompt: the prompt typed was continued.
    assert text_run["continued"]["prompt"] == "the lazy", text_run["continued"]


def test_a_picked_text_file_trains_with_the_loss_shown_step_by_step(text_run):
    shown, seen = text_run["shown"], text_run["seen"]
    assert shown["status"] == "done" and shown["mode"] == "text", shown
    tokens = len(TEXT.encode())
    assert re.match(rf"mine\.txt: {tokens} tokens; training on the first \d+, \d+ windows", text_run["about"])
    # The table grew a row a step, and the curve a point a step, while it trained.
    assert seen["rows"] == list(range(1, STEPS + 1)), seen["rows"]
    assert seen["points"] == list(range(1, STEPS + 1)), seen["points"]
    assert [r.split()[0] for r in text_run["rows"]] == [str(s) for s in range(1, STEPS + 1)]
    assert [float(r.split()[1]) for r in text_run["rows"]] == pytest.approx(shown["losses"], abs=1e-6)
    assert np.mean(shown["losses"][-5:]) < np.mean(shown["losses"][:5]) - 0.2, shown["losses"]


def _mulberry32(seed: int):
    """The page's seeded generator (ortflow-device.js), in uint32 arithmetic."""
    state = seed & MASK

    def draw() -> float:
        nonlocal state
        state = (state + 0x6D2B79F5) & MASK
        t = (state ^ (state >> 15)) * (state | 1) & MASK
        t ^= (t + ((t ^ (t >> 7)) * (t | 61) & MASK)) & MASK
        return ((t ^ (t >> 14)) & MASK) / 2**32

    return draw


MASK = 0xFFFFFFFF


def _first_batch(count: int, batch: int, seed: int = 0) -> list[int]:
    """The training windows of the page's first batch: a Fisher-Yates shuffle drawn from the seeded generator."""
    draw, order = _mulberry32(seed), list(range(count))
    for i in range(count - 1, 0, -1):
        j = int(draw() * (i + 1))
        order[i], order[j] = order[j], order[i]
    return order[:batch]


def _model(text_run, state: Path | None = None) -> tuple[torch.nn.Module, object]:
    cfg, _, model, _ = rebuild(text_run["run_dir"], "final")
    if state is not None:
        model.load_state_dict(torch.load(state, weights_only=True))
    return model.eval(), cfg


def test_the_train_button_trains_on_the_picked_file(text_run):
    """Step 1's loss in the page's table is the set's first model's (the run's, dropout off) on the first batch of
    the picked file's windows, made here as the page draws them: not on the set's example batch, nor on other data."""
    held = re.search(r"training on the first (\d+), \d+ windows of (\d+) held out", text_run["about"])
    split, block = int(held[1]), int(held[2])
    tokens = torch.tensor(list(TEXT.encode()))
    starts = _first_batch(split - block, text_run["manifest"]["batch_size"])
    inputs = torch.stack([tokens[s : s + block] for s in starts])
    targets = torch.stack([tokens[s + 1 : s + block + 1] for s in starts])
    model, cfg = _model(text_run)
    with torch.no_grad():
        loss = float(losses.build(cfg.loss)(model(inputs), targets))
    step_1 = float(text_run["rows"][0].split()[1])
    assert abs(step_1 - loss) <= 1e-5 * loss, (step_1, loss)


def test_a_typed_prompt_is_continued(text_run):
    continuation = text_run["continuation"]
    assert continuation.startswith("the lazy") and len(continuation) > len("the lazy"), continuation
    assert text_run["continued"]["continuation"] == continuation[len("the lazy") :]


def test_the_downloaded_parameters_import_and_evaluate_to_the_loss_the_page_showed(text_run):
    """The held-out loss read from the page is what the downloaded parameters, imported into the run's model with
    ortflow-import-artifacts, give on the held-out windows of the picked file (made here as the manifest says)."""
    found = re.fullmatch(r"held out \((\d+) tokens\): loss ([\d.]+), accuracy ([\d.]+)%", text_run["evaluation"])
    assert found, text_run["evaluation"]
    count, shown_loss = int(found[1]), float(found[2])
    held = re.search(r"training on the first (\d+), (\d+) windows of (\d+) held out", text_run["about"])
    start, windows, block = (int(g) for g in held.groups())
    tokens = torch.tensor(list(TEXT.encode()))
    starts = [start + i * block for i in range(windows)]
    inputs = torch.stack([tokens[s : s + block] for s in starts])
    targets = torch.stack([tokens[s + 1 : s + block + 1] for s in starts])
    assert count == targets.numel()
    out = text_run["tmp"] / "device.pt"
    import_artifacts.main(
        [str(text_run["parameters"]), str(text_run["run_dir"]), "--set", str(text_run["folder"]), "--out", str(out)]
    )
    model, cfg = _model(text_run, out)
    with torch.no_grad():
        loss = float(losses.build(cfg.loss)(model(inputs), targets))
    assert abs(loss - shown_loss) <= 6e-6 + 1e-5 * loss, (loss, text_run["evaluation"])


def _pictures(root: Path, size: int, names: dict[str, int]) -> None:
    rng = np.random.default_rng(0)
    for name, channel in names.items():
        _image(root / name, size, channel, rng)


def test_a_picked_folder_of_images_trains_and_new_images_are_labelled(exported, chromium, tmp_path):  # noqa: F811
    run_dir, manifest = exported["vision"]
    size = manifest["preprocessing"]["image_size"]
    pictures = tmp_path / "pictures"
    colours = {"cats": 0, "dogs": 2}  # each label's dominant channel
    _pictures(pictures, size, {f"{label}/{i:02d}.png": c for label, c in colours.items() for i in range(1, 7)})
    _image(pictures / "cats" / "00-large.png", 2 * size + 3, 0, np.random.default_rng(1))  # another size: resized
    (pictures / "dogs" / "00-broken.png").write_bytes(b"not an image")
    (pictures / "notes.txt").write_text("beside the label folders")
    (pictures / "cats" / ".DS_Store").write_bytes(b"\0")  # hidden: ignored
    new = tmp_path / "new"
    _pictures(new, size, {"red.png": 0, "blue.png": 2})
    (new / "broken.png").write_bytes(b"\x89PNG broken")
    with browser.served(run_dir / export_artifacts.FOLDER) as base:
        page = chromium.new_page()
        page.goto(browser.url(base))
        _status(page, READY)
        page.get_by_label("A folder of images, one folder per label").set_input_files(pictures)
        _status(page, READY)
        about = page.locator("#data-about").inner_text()
        page.get_by_label("Steps").fill("20")
        page.get_by_role("button", name="Train", exact=True).click()
        shown = browser.result(page)
        evaluation = page.locator("#evaluation").inner_text()
        page.get_by_label("Images to label").set_input_files([new / "red.png", new / "broken.png", new / "blue.png"])
        labelled = browser.result(page)
        rows = page.locator("#predictions tbody tr").all_inner_texts()
        note = page.locator("#classify-about").inner_text()
        _screenshot(page, "device-page-images.png")
        page.close()
    assert about.startswith("pictures: 11 images to train on, 2 held out; labels cats -> 0"), about
    assert "1 resized" in about and "2 left out" in about, about
    assert "notes.txt (beside the label folders" in about and "dogs/00-broken.png (not an image" in about, about
    assert shown["status"] == "done" and shown["mode"] == "image", shown
    assert re.fullmatch(r"held out \(2 images\): loss [\d.]+, accuracy [\d.]+%", evaluation), evaluation
    assert [p["name"] for p in labelled["predictions"]] == ["red.png", "broken.png", "blue.png"]
    assert [p["label"] for p in labelled["predictions"]][1] is None
    assert {p["label"] for p in labelled["predictions"]} - {None} <= {"cats", "dogs"}, labelled["predictions"]
    assert len(rows) == 3 and "left out" in rows[1] and re.search(r"(cats|dogs) \d+%", rows[0]), rows
    assert note == "1 left out: broken.png (not an image the browser can read).", note


@pytest.mark.parametrize(
    ("recipe", "picks"),
    [
        (
            "transformer",
            [
                ({"mine.txt": b""}, "the text file is empty"),
                ({"mine.txt": b"abc\x00\x01\x02" * 40}, "looks binary"),
                ({"mine.txt": b"\xff\xfe" + b"x" * 200}, "not UTF-8 text"),
                ({"mine.txt": b"too short"}, "needs at least"),
            ],
        ),
        (
            "vision",
            [
                ({"only/a.png": "image", "only/b.png": "image"}, "one label (only)"),
                ({"a.png": "image", "b.png": "image"}, "no label"),
                ({"a/x.png": "image", "b/x.png": b"junk"}, "no readable image to train on for label b"),
            ],
        ),
    ],
    ids=["text", "images"],
)
def test_bad_data_picked_gets_its_message_on_the_page(exported, chromium, recipe, picks, tmp_path):  # noqa: F811
    run_dir, manifest = exported[recipe]
    with browser.served(run_dir / export_artifacts.FOLDER) as base:
        page = chromium.new_page()
        page.goto(browser.url(base))
        _status(page, READY)
        for k, (files, says) in enumerate(picks):
            folder = tmp_path / f"pick{k}"
            for name, content in files.items():
                path = folder / name
                path.parent.mkdir(parents=True, exist_ok=True)
                if content == "image":
                    _image(path, manifest["preprocessing"]["image_size"], 0, np.random.default_rng(1))
                else:
                    path.write_bytes(content)
            if recipe == "transformer":
                page.get_by_label("A text file").set_input_files(folder / "mine.txt")
            else:
                page.get_by_label("A folder of images, one folder per label").set_input_files(folder)
            shown = browser.result(page)
            assert shown["status"] == "error" and shown["kind"] == "data", shown
            assert says in shown["error"] and says in page.locator("#status").inner_text(), (says, shown)
            assert page.locator("#status.error").count() == 1
        page.close()
