"""Real clusters on this machine for the tests: a Ray head and a second Ray node (`ray start`), and a one-node SLURM
(slurmctld, slurmd and munged from Debian's slurm-wlm and munge), each started by the test and stopped after it.

Ray's processes talk to the address they resolve for their node, which on a machine with a network card is that
card's address, not loopback. The Ray cluster therefore runs in a network namespace of its own that has only the
loopback interface (`unshare -n`, entered with `nsenter`), so every connection stays on 127.0.0.1. Everything is
stopped by process id: the processes each `ray start --block` started end with it.

Outside CI a missing tool (ray, slurm-wlm, unshare) skips the tests with the reason; under CI=true it fails them."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def require(ok: bool, reason: str) -> None:
    """Skip (or, under CI, fail) a test whose cluster cannot be started here."""
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (.ci/run installs it)")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_gone(process: subprocess.Popen, timeout: float = 30) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _started_at(pid: int) -> str | None:
    """The process's start time (/proc/PID/stat), which tells it from a later process given the same pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _stop(node: subprocess.Popen, seen: dict[int, str | None]) -> None:
    """A `ray start --block` and every process it started, also those seen earlier that outlived it (orphaned when
    their raylet was killed): by pid, each checked to be the same process."""
    left = {pid: _started_at(pid) for pid in _descendants(node.pid)} | seen
    _wait_gone(node)
    for pid, started in left.items():
        if started is not None and _started_at(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------------------- Ray
class RayCluster:
    """A head and a second node (with the custom resource `second_node`), 1 CPU each, in a loopback-only network
    namespace. `command(...)` runs a command inside it; `raylet_pid(node_id)` finds a node's raylet."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen] = []
        self.seen: dict[subprocess.Popen, dict[int, str | None]] = {}  # each node's processes, as last seen
        self.namespace = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
        time.sleep(0.2)
        subprocess.run(self.command("ip", "link", "set", "lo", "up"), check=True)
        # Ray's session files: a short path (unix socket paths are limited to 107 characters).
        self.temp = Path(f"/tmp/ortflow-ray-{os.getpid()}-{self.port}")
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        }

    def command(self, *args: str) -> list[str]:
        return ["nsenter", "-t", str(self.namespace.pid), "-n", *args]

    def _start(self, *args: str) -> None:
        log = (self.root / f"ray-node-{time.monotonic_ns()}.log").open("w")
        common = ["--num-cpus=1", "--object-store-memory=80000000", "--disable-usage-stats", "--block"]
        node = subprocess.Popen(
            self.command(str(BIN / "ray"), "start", "--node-ip-address=127.0.0.1", *common, *args),
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.nodes.append(node)

    def start(self) -> None:
        self._start("--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.temp}")
        self._wait_for_nodes(1)
        self._start_second()

    def _start_second(self) -> None:
        self._start(f"--address={self.address}", '--resources={"second_node": 1}')
        self._wait_for_nodes(2)

    def restart_second(self) -> None:
        """A new second node, after the last one was killed (what is left of it is stopped first)."""
        node = self.nodes.pop()
        _stop(node, self.seen.pop(node, {}))
        self._start_second()

    def nodes_alive(self) -> list[dict]:
        """ray.nodes() as a driver in the namespace sees it."""
        probe = (
            f"import json, ray; ray.init(address='{self.address}', logging_level='ERROR', log_to_driver=False); "
            "print('NODES', json.dumps([n for n in ray.nodes() if n['Alive']]))"
        )
        result = subprocess.run(
            self.command(sys.executable, "-c", probe), env=self.env, capture_output=True, text=True, timeout=120
        )
        for line in result.stdout.splitlines():
            if line.startswith("NODES "):
                return json.loads(line[6:])
        return []

    def _wait_for_nodes(self, count: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(node.poll() is not None for node in self.nodes):
                raise RuntimeError(f"a Ray node did not start: {self.logs()}")
            if len(self.nodes_alive()) >= count:
                for node in self.nodes:
                    self.seen[node] = {pid: _started_at(pid) for pid in _descendants(node.pid)}
                return
            time.sleep(1)
        raise RuntimeError(f"the Ray cluster did not reach {count} nodes: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(p.read_text()[-2000:] for p in sorted(self.root.glob("ray-node-*.log")))

    def raylet_pid(self, node_id: str) -> int:
        """The pid of the raylet of node `node_id` (one of the processes its `ray start` started)."""
        for node in self.nodes:
            for pid in _descendants(node.pid):
                line = _cmdline(pid)
                if "raylet" in line.split(" ", 1)[0] and f"--node_id={node_id}" in line:
                    return pid
        raise LookupError(f"no raylet of node {node_id}")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            _stop(node, self.seen.get(node, {}))
        _wait_gone(self.namespace)
        shutil.rmtree(self.temp, ignore_errors=True)


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return shutil.which("unshare") is not None and shutil.which("nsenter") is not None


@contextlib.contextmanager
def ray_cluster(root: Path) -> Iterator[RayCluster]:
    require(ray_available(), "the Ray cluster tests need ray (pip install 'ortflow[ray]') and util-linux's unshare")
    require(
        subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0,
        "the Ray cluster tests need a network namespace (unshare -n, as root)",
    )
    cluster = RayCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
