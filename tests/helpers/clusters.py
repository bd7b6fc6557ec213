"""Real clusters on this machine for the tests: a Ray head and a second Ray node (`ray start`), and a one-node SLURM
(slurmctld, slurmd and munged from Debian's slurm-wlm and munge), each started by the test and stopped after it.

Ray's processes talk to the address they resolve for their node, which on a machine with a network card is that
card's address, not loopback. The Ray cluster therefore runs in a network namespace of its own that has only the
loopback interface (`unshare -n`, entered with `nsenter`), so every connection stays on 127.0.0.1. Everything is
stopped by process id: the processes each `ray start --block` started end with it.

Outside CI a missing tool (ray, slurm-wlm, unshare) skips the tests with the reason; under CI=true, and in `make
test-cluster` (ORTFLOW_TESTS_REQUIRE_TOOLS=1) whatever the environment, it fails them."""

import contextlib
import json
import os
import re
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


def deselect_marked(config: pytest.Config, items: list[pytest.Item], marker: str) -> None:
    """Deselect the tests carrying `marker` (reported as deselected): a phase's own tests (device, cluster,
    deepspeed) outside that phase, whatever `-m` a command gives."""
    deselected = [item for item in items if item.get_closest_marker(marker) is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker(marker) is None]


def require(ok: bool, reason: str) -> None:
    """Skip (or, under CI, fail) a test whose cluster cannot be started here."""
    if ok:
        return
    if tools_required():
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


def descendants(pid: int, alive_only: bool = False) -> list[int]:
    """The processes below `pid` (read from /proc); with `alive_only`, not those that ended unreaped (zombies)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
                if not (alive_only and state == "Z"):
                    children.setdefault(int(ppid), []).append(int(entry.name))
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
    left = {pid: _started_at(pid) for pid in descendants(node.pid)} | seen
    _wait_gone(node)
    for pid, started in left.items():
        if started is not None and _started_at(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def cmdline(pid: int) -> str:
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

    def second_node(self) -> str:
        """The node id of a live second node, started again if its raylet was killed, once Ray lists it as the only
        live node offering `second_node` (a killed node stays listed alive until its missed heartbeats are noticed,
        and a job pinned to it would wait for it for ever)."""
        found = self._raylet(self.nodes[-1])
        if found is None:
            node = self.nodes.pop()
            _stop(node, self.seen.pop(node, {}))
            self._start_second()
            # Ray may still list the killed node alive, so two listed nodes need not include the new one yet: its
            # raylet can appear after `_start_second` returns.
            deadline = time.monotonic() + 60
            while (found := self._raylet(self.nodes[-1])) is None and time.monotonic() < deadline:
                time.sleep(0.5)
        if found is None:
            raise RuntimeError(f"the second Ray node has no raylet: {self.logs()}")
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            offering = [n["NodeID"] for n in self.nodes_alive() if n["Resources"].get("second_node")]
            if offering == [found[1]]:
                return found[1]
            time.sleep(1)
        raise RuntimeError(f"Ray still lists {offering} offering second_node, not only node {found[1]}")

    def _raylet(self, node: subprocess.Popen) -> tuple[int, str] | None:
        """The pid and node id of the raylet that `node`'s `ray start` started, if it still runs."""
        for pid in descendants(node.pid):
            line = cmdline(pid)
            found = re.search(r"--node_id=([0-9a-f]+)", line)
            if "raylet" in line.split(" ", 1)[0] and found:
                return pid, found.group(1)
        return None

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
                    self.seen[node] = {pid: _started_at(pid) for pid in descendants(node.pid)}
                return
            time.sleep(1)
        raise RuntimeError(f"the Ray cluster did not reach {count} nodes: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(p.read_text()[-2000:] for p in sorted(self.root.glob("ray-node-*.log")))

    def raylet_pid(self, node_id: str) -> int:
        """The pid of the raylet of node `node_id` (one of the processes its `ray start` started)."""
        for node in self.nodes:
            found = self._raylet(node)
            if found is not None and found[1] == node_id:
                return found[0]
        raise LookupError(f"no raylet of node {node_id}")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            _stop(node, self.seen.get(node, {}))
        _wait_gone(self.namespace)
        if not os.environ.get("ORTFLOW_KEEP_RAY_LOGS"):
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


# ------------------------------------------------------------------------------------------------------- SLURM
SLURM_CONF = """\
ClusterName=ortflowtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
UnkillableStepTimeout=180
JobRequeue=1
SchedulerType=sched/builtin
NodeName=ortflownode NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=test Nodes=ortflownode Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """One SLURM node on this machine (partition `test`, all its CPUs), its controller and munge, each a process of
    the test's own with its files in `root`; `env` points SLURM's commands (sbatch, squeue, scancel) at it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.processes: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        self.env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        self.env["PATH"] = f"{BIN}{os.pathsep}{os.environ['PATH']}"

    def _daemon(self, *command: str) -> None:
        log = (self.root / f"{Path(command[0]).name}.out").open("w")
        self.processes.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def start(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o755)
        for folder in ("state", "spool"):
            (self.root / folder).mkdir()
        subprocess.run(["mungekey", "--create", f"--keyfile={munge / 'munge.key'}"], check=True)
        files = [f"--{name}-file={munge / name}" for name in ("pid", "log", "seed")]
        self._daemon(
            "munged",
            "--foreground",
            "--force",
            f"--socket={munge / 'socket'}",
            f"--key-file={munge / 'munge.key'}",
            *files,
        )
        settings = {"host": socket.gethostname(), "root": self.root, "cpus": os.cpu_count() or 1}
        settings |= {"ctld_port": free_port(), "d_port": free_port()}
        (self.root / "slurm.conf").write_text(SLURM_CONF.format(**settings))
        self._wait(lambda: (munge / "socket").exists(), "munged")
        self._daemon("slurmctld", "-D", "-f", self.env["SLURM_CONF"])
        self._daemon("slurmd", "-D", "-f", self.env["SLURM_CONF"], "-N", "ortflownode")
        self._wait(lambda: self.sinfo() == "idle", "the node to be idle")

    def sinfo(self) -> str:
        result = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
        return result.stdout.strip()

    def _wait(self, ready, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.processes):
                logs = "\n".join(p.read_text()[-2000:] for p in sorted(self.root.glob("*.out")))
                raise RuntimeError(f"SLURM did not start ({what}):\n{logs}")
            time.sleep(0.5)

    def jobs(self) -> str:
        result = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self.env, capture_output=True, text=True)
        return result.stdout.strip()

    def diagnosis(self, job_id: str) -> str:
        """What SLURM says about `job_id` and the node, and its controller's and node daemon's logs (debug lines
        left out): for a test that timed out waiting on a job."""
        parts = []
        for command in (["scontrol", "show", "job", job_id], ["scontrol", "show", "node"], ["squeue", "-a"]):
            shown = subprocess.run(command, env=self.env, capture_output=True, text=True)
            parts.append(f"$ {' '.join(command)}\n{shown.stdout}{shown.stderr}")
        for name in ("slurmctld.log", "slurmd.log"):
            log = self.root / name
            lines = log.read_text().splitlines() if log.exists() else []
            parts.append(f"{name}:\n" + "\n".join([line for line in lines if "debug" not in line][-40:]))
        return "\n".join(parts)

    def start_requeued_now(self, job_id: str, timeout: float = 120) -> None:
        """SLURM holds a requeued job for about 2 minutes (its begin time); once `job_id` is back in the queue, its
        last run's step daemons are gone from the node and its revoked credential is seconds old, move that to now,
        so the test does not wait. A launch sooner fails the job at once ("Job N already running, do not launch
        second copy" while a step daemon ends; "Job credential revoked" within the revocation's second): the hold
        exists for these, and the test waits for them here."""
        internal: list[str] = []

        def pending_again() -> bool:
            shown = subprocess.run(["scontrol", "show", "job", job_id], env=self.env, capture_output=True, text=True)
            internal[:] = re.findall(r"\bJobId=(\d+)", shown.stdout)[:1]
            return "JobState=PENDING" in shown.stdout and "Restarts=0" not in shown.stdout

        def steps_gone() -> bool:  # slurmd's own test: a step daemon's socket in its spool dir, and the process
            number = internal[0]
            sockets = list((self.root / "spool").glob(f"*_{number}.*"))
            titles = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
            return not sockets and f"slurmstepd: [{number}." not in titles

        self._wait(pending_again, f"job {job_id} to be requeued", timeout)
        self._wait(steps_gone, f"job {job_id}'s last run to end on the node", timeout)
        # slurmd revoked the last run's credential as it ended, and takes a new one made within the same second for
        # that revoked one (it compares whole seconds): the job is then killed at once ("Killing non-startable batch
        # JobId=N: Job credential revoked", seen in CI). Two seconds on, the new credential is a later one.
        time.sleep(2.0)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=self.env, check=True)

    def stop(self) -> None:
        subprocess.run(["scancel", "--partition=test"], env=self.env, capture_output=True)
        with contextlib.suppress(RuntimeError):  # the jobs' processes end before slurmd does
            self._wait(lambda: not self.jobs(), "the jobs to end", timeout=60)
        for process in reversed(self.processes):
            _wait_gone(process)


def slurm_available() -> bool:
    return all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey"))


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    require(
        slurm_available(),
        "the SLURM tests need Debian's slurm-wlm and munge (apt-get install slurm-wlm munge) and submitit",
    )
    require(os.geteuid() == 0, "the SLURM tests start slurmd, which runs jobs as root here")
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def tools_required() -> bool:
    """A missing tool fails a test instead of skipping it: under CI, and in the phases that exist to run those tests
    (`make test-device`, `make test-cluster` set ORTFLOW_TESTS_REQUIRE_TOOLS=1), so no such suite quietly shrinks."""
    return os.environ.get("CI") == "true" or os.environ.get("ORTFLOW_TESTS_REQUIRE_TOOLS") == "1"
