"""What a person sees: the CLI in a pseudo-terminal for each accel mode (a header, the bar, evals, the summary,
nothing from other libraries, within a line budget), plain lines without a terminal, everything in ortflow.log,
and the PNG of ortflow-compare."""

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from ortflow.report.plots import COLORS, DPI, PANEL_SIZE
from tests.conftest import run_cli, run_dirs

FOREIGN = ("onnxruntime:Default", "GraphTransformer", "No CUDA runtime", "Warning:", "warnings.warn", "Traceback")
DIGITS = ["+recipe=digits", "trainer.max_steps=8", "trainer.eval_every=4", "trainer.log_every=4"]
LINE_BUDGET = 20  # header, 2 evals, the bar, a warning, the summary table (~13 lines)


def run_in_pty(*args: str, cwd: Path, columns: int = 140) -> tuple[int, str]:
    """`python -m ortflow ARGS` with a pseudo-terminal as its stdin/stdout/stderr, as a person runs it."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE")}
    env |= {"TERM": "xterm-256color", "COLUMNS": str(columns)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ortflow", *args], cwd=cwd, stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=600), b"".join(chunks).decode(errors="replace")


def screen_lines(raw: str, columns: int = 140) -> list[str]:
    """The non-blank lines left on a terminal of that width after it played `raw` (pyte, a VT100 emulator): what a
    person sees once the run is over."""
    import pyte

    screen = pyte.Screen(columns, 400)
    pyte.Stream(screen).feed(raw)
    return [line.rstrip() for line in screen.display if line.strip()]


@pytest.mark.parametrize("mode", ["none", "ortmodule", "artifacts"])
def test_a_run_in_a_terminal_shows_header_bar_evals_and_summary_only(mode, tmp_path):
    status, raw = run_in_pty(*DIGITS, f"accel={mode}", cwd=tmp_path)
    lines = screen_lines(raw)
    shown = "\n".join(lines)
    assert status == 0, shown
    assert not [line for line in lines if any(f in line for f in FOREIGN)], shown
    header = next(line for line in lines if not line.startswith("warning: "))  # start-up warnings come before it
    assert header.startswith("ortflow  recipe digits") and f"accel={mode}" in header, shown
    assert len([line for line in lines if re.match(r"train .*━.* 8/8 ", line)]) == 1, shown  # the bar, whole
    assert [line for line in lines if line.startswith("eval  step")] == [
        line for line in lines if re.match(r"eval  step [48]/8  loss \d\.\d{4}  accuracy \d\.\d{4}$", line)
    ] and sum(line.startswith("eval  step") for line in lines) == 2, shown
    warnings = [line for line in lines if line.startswith("warning: scheduler.warmup_steps=10")]
    assert len(warnings) == 1, shown  # ortflow's own warning, once
    assert "run summary" in shown and "tensorboard --logdir" in shown, shown
    proof = "pytorch" if mode == "none" else "onnxruntime (ORT ran 8/8 training steps"
    assert any("executed by" in line and proof in line for line in lines), shown
    assert len(lines) <= LINE_BUDGET, f"{len(lines)} lines:\n{shown}"
    # The run's log keeps what the terminal did not show.
    (run_dir,) = run_dirs(tmp_path)
    log = (run_dir / "ortflow.log").read_text()
    assert "No CUDA runtime is found" in log
    if mode == "artifacts":
        assert "GraphTransformer" in log


def test_without_a_terminal_there_is_no_bar_and_a_plain_line_every_log_every_steps(tmp_path):
    result = run_cli(*DIGITS, "accel=artifacts", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "━" not in out and "\r" not in out
    plain = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in plain] == ["4/8", "8/8"], out
    assert all(re.search(r"loss \d\.\d{4}  lr \S+ .* eta \d+s$", line) for line in plain), out
    assert "run summary" in out and "ORT ran 8/8 training steps" in out
    assert not any(f in out + result.stderr for f in FOREIGN), out + result.stderr


def test_logger_verbose_shows_other_libraries_output(tmp_path):
    result = run_cli(*DIGITS, "accel=artifacts", "logger.verbose=true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "GraphTransformer" in result.stderr  # ORT's native INFO lines, left on the terminal
    assert "[ortflow.data.digits] digits: 1347 train" in result.stdout  # ortflow's own INFO lines too


def curve_colours(png: Path, panel: tuple[int, int] = (0, 0)) -> int:
    """How many of the run colours (COLORS) draw a curve in a panel (column, row) of a plots.py PNG."""
    with Image.open(png) as opened:
        image = opened.convert("RGB")
    width, height = int(PANEL_SIZE[0] * DPI), int(PANEL_SIZE[1] * DPI)
    x0, y0 = panel[0] * width, panel[1] * height
    pixels = Counter(image.crop((x0, y0, x0 + width, y0 + height)).get_flattened_data())
    rgb = [tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in COLORS]
    return sum(1 for colour in rgb if pixels[colour] >= 100)  # a curve, not a stray anti-aliased pixel


def test_compare_writes_a_png_with_one_curve_per_run_and_the_eager_difference(tmp_path, capsys):
    from ortflow.cli.compare import main

    runs = []
    for mode in ("none", "artifacts"):
        result = run_cli(*DIGITS, f"accel={mode}", f"hydra.run.dir={tmp_path / mode}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(str(tmp_path / mode))
    png = tmp_path / "compare.png"
    main([*runs, "--png", str(png)])
    assert f"curves: {png}" in capsys.readouterr().out
    with Image.open(png) as image:  # train/loss, eval/loss, eval/accuracy and the ORT - eager difference: 2 x 2
        assert image.size == (int(2 * PANEL_SIZE[0] * DPI), int(2 * PANEL_SIZE[1] * DPI))
    assert curve_colours(png) == 2
    assert curve_colours(png, panel=(1, 1)) == 1  # the difference panel: one curve (artifacts - none)


def test_the_summary_of_a_preempted_run_gives_the_command_that_continues_it(tmp_path):
    from rich.console import Console

    from ortflow.report.summary import summary_table

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000040.pt").write_bytes(b"")
    record = {
        "status": "preempted",
        "overrides": ["+recipe=digits", "accel=artifacts"],
        "metrics": {"eval/loss": 0.5, "best/eval/loss": 0.4, "best/step": 30, "steps": 40},
        "engine": {"executed_by": "onnxruntime", "ort_train_steps": 40, "ort_eval_batches": 8},
    }
    console = Console(width=200, record=True)
    console.print(summary_table(record, tmp_path, 12.0))
    text = console.export_text()
    assert f"ortflow +recipe=digits accel=artifacts trainer.resume=auto hydra.run.dir={tmp_path}" in text
    assert "loss 0.4000 at step 30" in text and "ORT ran 40/40 training steps, 8 eval batches" in text
    record["status"] = "completed"
    console.print(summary_table(record, tmp_path, 12.0))
    assert console.export_text().count("continue with") == 0
