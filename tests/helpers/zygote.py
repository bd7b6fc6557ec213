"""`python -m ortflow ...` for the tests without paying the interpreter's start-up each time.

A test worker starts one server (`python -m tests.helpers.zygote SOCKET`) that imports torch, Hydra and ortflow's
command once, does no work (no torch kernel has run, no thread is started), and forks a child per command. The child
is a separate process like `python -m ortflow` would be: its own pid (signals reach it alone), working directory,
environment, argv, stdin/stdout/stderr (the caller's pipes), and the interpreter's normal exit (atexit handlers,
finalization). What it shares with the server is only what the imports did. ONNX Runtime is not imported in the
server, nor anything that reads the environment at import time beyond torch's thread count (set again from
OMP_NUM_THREADS); `run_cli` (tests/conftest.py) starts a real interpreter when a test sets other variables.

`fork_cli(args, cwd, env, timeout)` returns what `subprocess.run(..., capture_output=True, text=True)` would;
`Forked(args, cwd, env)` starts one and returns at once (several run side by side)."""

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Environment variables a forked child honours like a fresh interpreter; any other difference from the caller's
# environment makes run_cli start a real interpreter.
HONOURED = {"PYTHONPATH", "OMP_NUM_THREADS"}


# ------------------------------------------------------------------------------------------------------ server
def _child(request: dict, fds: list[int], server_paths: list[str], threads: int) -> None:
    """In the forked child: become `python -m ortflow ARGS` in `cwd` with `env`, then exit as that would."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR is read again on first use
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *(p for p in server_paths if p not in extra)]
    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        del sys.modules[name]  # importable again only through the child's own sys.path
    import torch

    torch.set_num_threads(int(request["env"].get("OMP_NUM_THREADS") or threads))
    import runpy

    sys.argv = ["ortflow", *request["args"]]
    runpy.run_module("ortflow", run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def serve(path: str) -> None:
    import hydra  # noqa: F401
    import omegaconf  # noqa: F401
    import torch
    import torch._dynamo  # torch's optimizers import it on first use
    import torch.utils.tensorboard

    import ortflow.cli.train
    import ortflow.data.digits  # scikit-learn: a second a run, and the digits are the tests' most common data
    import ortflow.run.runner  # noqa: F401

    threads = torch.get_num_threads()
    server_paths = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    parent = os.getppid()
    me = os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        for _key, _ in selector.select(timeout=0.05):
            conn, _ = listener.accept()
            message, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
            pid = os.fork()
            if pid == 0:
                try:
                    listener.close()
                    conn.close()
                    for other in children.values():
                        other.close()
                    selector.close()
                    _child(json.loads(message), fds, server_paths, threads)
                finally:
                    if os.getpid() != me:  # the child ends here whatever happened, as its own interpreter
                        sys.stdout.flush()
                        sys.stderr.flush()
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()


# ------------------------------------------------------------------------------------------------------ client
_server: dict[str, object] = {}
_lock = threading.Lock()


def _socket_path() -> str:
    with _lock:
        if "path" not in _server:
            folder = tempfile.mkdtemp(prefix="ortflow-zygote-")
            path = os.path.join(folder, "socket")
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.zygote", path], cwd=REPO, stdout=subprocess.PIPE, text=True
            )
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the test zygote did not start")
            atexit.register(proc.kill)
            _server.update(path=path, proc=proc)
        return str(_server["path"])


class Forked:
    """One `python -m ortflow ARGS` forked by the server, started at once; `communicate` reads its output to the end
    and its exit status (as subprocess.Popen's, with stdout and stderr piped and text=True)."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.args = [sys.executable, "-m", "ortflow", *args]
        self.returncode: int | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(_socket_path())
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        request = {"args": list(args), "cwd": str(cwd), "env": dict(env)}
        socket.send_fds(self._sock, [json.dumps(request).encode()], [null, out_w, err_w])
        for fd in (null, out_w, err_w):
            os.close(fd)
        self._replies = self._sock.makefile("r")
        self.pid = int(self._replies.readline())
        self._pipes = (out_r, err_r)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        chunks: dict[int, list[bytes]] = {fd: [] for fd in self._pipes}
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        with selectors.DefaultSelector() as selector:
            for fd in chunks:
                selector.register(fd, selectors.EVENT_READ)
            open_fds = set(chunks)
            while open_fds:
                left = deadline - time.monotonic()
                if left <= 0:
                    os.kill(self.pid, signal.SIGKILL)
                    self._close()
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(timeout=min(left, 1.0)):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
                        open_fds.discard(key.fd)
        self.returncode = int(self._replies.readline())
        self._close()
        # As text=True would: decoded, universal newlines.
        return tuple(  # type: ignore[return-value]
            b"".join(chunks[fd]).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
            for fd in self._pipes
        )

    def _close(self) -> None:
        for fd in self._pipes:
            os.close(fd)
        self._replies.close()
        self._sock.close()


def fork_cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    proc = Forked(args, cwd, env)
    stdout, stderr = proc.communicate(timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


if __name__ == "__main__":
    serve(sys.argv[1])
