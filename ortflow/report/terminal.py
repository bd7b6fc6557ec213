"""What a person sees. One rich Console (stdout) is shared by the log handler, the progress bar and the closing
summary, so log lines print above the bar instead of breaking it. The terminal gets ortflow's warnings and errors
(each distinct message once), the run's header, its evaluations and the summary; everything else (ortflow's own
INFO lines, other libraries' messages and warnings, ONNX Runtime's native log lines) goes to <run dir>/ortflow.log
only. `logger.verbose=true` (or debug=verbose) shows all of it on the terminal too.
"""

import contextlib
import importlib
import io
import logging
import logging.config
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from rich.console import Console

_console: Console | None = None
_verbose = False
native_log = logging.getLogger("ortflow.native")  # other libraries' output captured from the process's stderr


def console() -> Console:
    """The one Console of this process (it writes to whatever sys.stdout is when it prints)."""
    global _console
    if _console is None:
        _console = Console(highlight=False, soft_wrap=True)
    return _console


def set_verbose(verbose: bool) -> None:
    """Show other libraries' messages (and ortflow's INFO lines) on the terminal, and stop capturing them."""
    global _verbose
    _verbose = verbose


def is_verbose() -> bool:
    return _verbose


class ConsoleHandler(logging.Handler):
    """The terminal's logging handler (conf/hydra/job_logging/ortflow.yaml): ortflow's warnings once each, every
    error; with set_verbose(True), every record at INFO and above."""

    STYLES: ClassVar[dict[int, str]] = {
        logging.WARNING: "yellow",
        logging.ERROR: "bold red",
        logging.CRITICAL: "bold red",
    }

    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if _verbose:
            return record.levelno >= logging.INFO
        if record.levelno >= logging.ERROR:
            return True
        if record.levelno < logging.WARNING or not record.name.startswith("ortflow"):
            return False
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.levelno >= logging.WARNING:
                text = f"{record.levelname.lower()}: {text}"
            elif _verbose:
                text = f"[{record.name}] {text}"
            console().print(text, style=self.STYLES.get(record.levelno), markup=False, highlight=False)
        except Exception:
            self.handleError(record)


class LogFile(logging.FileHandler):
    """The run's log file (ortflow.log). When the file system refuses a write (a full disk), the handler says so once
    on stderr and stops writing, instead of printing logging's error block for every later record; the error that
    stops the run names the file that could not be written."""

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            print(
                f"ortflow: the log file {self.baseFilename} cannot be written ({error.strerror}); it stops here.",
                file=sys.stderr,
                flush=True,
            )
            self.emit = lambda record: None  # type: ignore[method-assign]
            with contextlib.suppress(OSError):  # closing flushes what the full disk refused
                self.close()
            return
        super().handleError(record)


def _log_lines(text: str, source: str) -> None:
    for line in text.splitlines():
        if line.strip():
            native_log.info("%s: %s", source, line.rstrip())


def quiet_import(module: str) -> None:
    """Import `module`, sending what it prints at import time to ortflow.log (torch.utils.cpp_extension prints
    "No CUDA runtime is found, using CUDA_HOME=..." on every machine without CUDA)."""
    if _verbose or module in sys.modules:
        importlib.import_module(module)
        return
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        importlib.import_module(module)
    _log_lines(out.getvalue() + err.getvalue(), module)


@contextlib.contextmanager
def native_stderr(source: str) -> Iterator[None]:
    """Send what native code writes to the process's stderr (file descriptor 2) inside the block to ortflow.log:
    ONNX Runtime logs its graph transformers there at INFO while it builds training graphs and sessions, whatever
    its logger severity. Exceptions still propagate; with set_verbose(True) nothing is captured."""
    if _verbose:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            _log_lines(captured.read().decode(errors="replace"), source)


@contextlib.contextmanager
def job_logging(log_file: Path) -> Iterator[None]:
    """While inside: the logging an `ortflow` job gets from Hydra (conf/hydra/job_logging/ortflow.yaml: this module's
    terminal handler and a log file, here `log_file`), with other libraries' warnings captured into it; afterwards
    the root logger's handlers and level, and warnings' display, are as they were. For the Python API and the
    commands Hydra does not start (ortflow-check, ortflow-bench)."""
    from omegaconf import OmegaConf

    from ortflow.paths import config_dir

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    spec = OmegaConf.to_container(OmegaConf.load(config_dir() / "hydra" / "job_logging" / "ortflow.yaml"))
    spec["handlers"]["file"]["filename"] = str(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    root.handlers = []
    logging.config.dictConfig(spec)
    showwarning = warnings.showwarning
    logging.captureWarnings(True)
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers, root.level = handlers, level
        if warnings.showwarning is not showwarning:
            logging.captureWarnings(False)
