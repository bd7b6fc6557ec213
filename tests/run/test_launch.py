"""How `ortflow ... distributed=ddp` starts its ranks (ortflow/run/launch.py, ortflow/run/rank_server.py): forked by a
fork server that has one thread at every fork, never by the command whose agent runs threads; the rank's
environment is the command's plus the agent's; and two-rank launches under CPU load, many times in a row
(`pytest tests/run/test_launch.py --launches=30`; 5 by default)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ortflow.run import launch, rank_server
from tests.conftest import make_cfg
from tests.helpers import ranks

LINUX = Path("/proc/self/task").is_dir()


def test_a_rank_forked_from_a_process_with_two_threads_stops_as_a_bug(monkeypatch):
    monkeypatch.setattr(rank_server, "SERVER_PID", os.getpid() + 1)  # as in a rank: the server is another process
    monkeypatch.setattr(rank_server, "_at_fork", [2])
    with pytest.raises(RuntimeError, match="had 2 threads when it forked this rank"):
        rank_server.check_forked_alone()
    monkeypatch.setattr(rank_server, "_at_fork", [1])
    rank_server.check_forked_alone()


@pytest.mark.parametrize("status", ["running", "interrupted", "preempted", "failed", "completed"])
def test_a_failed_rank_leaves_the_run_recorded_as_failed(tmp_path, status):
    before = {"status": status, "checkpoint": "checkpoints/step-3.pt", "error": "rank 0's own"}
    (tmp_path / "run.json").write_text(json.dumps(before))
    launch.record_rank_failure(tmp_path, {1: 1, 0: -15})
    after = json.loads((tmp_path / "run.json").read_text())
    if status in ("failed", "completed"):  # rank 0's own record of how the run ended
        assert after == before
    else:  # how the agent stopped rank 0 is not how the run ended
        assert after["status"] == "failed" and after["checkpoint"] == before["checkpoint"]
        assert after["error"] == "a rank failed: rank 0 exited with status -15, rank 1 exited with status 1"
    launch.record_rank_failure(tmp_path / "elsewhere", {1: 1})  # no run.json there (another node's): nothing


def test_a_ranks_environment_is_the_commands_plus_what_the_agent_set(monkeypatch):
    monkeypatch.setattr(rank_server, "BASE_ENVIRON", {"HOME": "/h", "STALE": "server's", "RANK": "0"})
    monkeypatch.setattr(os, "environ", {"HOME": "/h", "STALE": "server's", "RANK": "1", "MASTER_PORT": "29500"})
    merged = rank_server.rank_environ({"HOME": "/h", "STALE": "command's", "NEW": "set after the server started"})
    assert merged == {
        "HOME": "/h",
        "STALE": "command's",
        "NEW": "set after the server started",
        "RANK": "1",
        "MASTER_PORT": "29500",
    }


@pytest.fixture
def cpu_load():
    """Every core kept busy by another process while the test runs."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    yield
    for burner in burners:
        burner.kill()
        burner.wait()


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="counts a process's threads in /proc")
def test_two_rank_launches_under_cpu_load_fork_every_rank_from_one_thread(tmp_path, cpu_load, request):
    """Each launch runs torchrun's agent in this process (its threads started: the TCPStore server, the rendezvous
    heartbeat) and asks the fork server for two ranks, which meet in a gloo all-reduce. Every rank records the
    threads the server had when it forked it: 1, each time. A variable the command sets after the server started
    reaches the ranks (a sweep's later jobs reuse the server)."""
    launches = request.config.getoption("--launches")
    cfg = make_cfg("distributed=ddp", "distributed.nproc_per_node=2")
    launch.start_rank_server(cfg, ranks.meet)
    times = []
    for n in range(launches):
        folder = tmp_path / str(n)
        folder.mkdir()
        os.environ["ORTFLOW_TEST_LAUNCH"] = str(n)
        try:
            started = time.monotonic()
            status = launch.run_torchrun(cfg, folder, [str(folder)], [], ranks.meet)
            times.append(time.monotonic() - started)
        finally:
            del os.environ["ORTFLOW_TEST_LAUNCH"]
        assert status == 0, f"launch {n} failed"
        reports = [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(2)]
        assert [r["threads_at_fork"] for r in reports] == [1, 1], reports
        assert {r["parent"] for r in reports} == {reports[0]["server"]} != {os.getpid()}  # not this process
        assert [r["sum"] for r in reports] == [1.0, 1.0] and {r["launch"] for r in reports} == {str(n)}
        # The agent's variables are there, the server's own OPENBLAS_NUM_THREADS=1 is not (unless the command's)
        assert all(r["master_port"] and r["openblas"] == os.environ.get("OPENBLAS_NUM_THREADS") for r in reports)
    print(f"{launches} two-rank launches under load: {min(times):.2f}-{max(times):.2f} s each")


@pytest.mark.slow
def test_ranks_that_all_stop_on_a_users_error_end_the_launch_with_2(tmp_path):
    """Exit status 2 is a user's error, its paragraph printed by each rank (a token file changed since it was
    prepared stops every rank at the same step): the command ends with 2 too, as a single process would. Any other
    failure is 1."""
    cfg = make_cfg("distributed=ddp", "distributed.nproc_per_node=2")
    assert launch.run_torchrun(cfg, tmp_path, ["2"], [], ranks.exit_with) == 2
    assert launch.run_torchrun(cfg, tmp_path, ["3"], [], ranks.exit_with) == 1


SERVER_FROM_A_THREAD = """
import os, sys, threading, time
from multiprocessing import forkserver
from ortflow.run import rank_server
def start_and_return_later():
    rank_server.start([])
    time.sleep(1.5)  # the server has set itself up meanwhile

started = threading.Thread(target=start_and_return_later)
started.start()
started.join()  # the thread that started the server has ended
time.sleep(1.0)
pid = forkserver._forkserver._forkserver_pid
try:  # a zombie (state Z) is a dead process its parent has not reaped
    alive = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
except OSError:
    alive = False
print(pid, alive, flush=True)
"""


def test_a_rank_server_started_from_a_thread_lives_until_the_command_ends(tmp_path):
    """The parent-death signal fires when the thread that forked a process ends: a server started from a thread
    other than the main one (a sweep's launcher thread) does not take it, and ends with the command's process
    instead (multiprocessing's end-of-file on the command's pipe)."""
    done = subprocess.run(
        [sys.executable, "-c", SERVER_FROM_A_THREAD], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    pid, alive = done.stdout.split()
    assert alive == "True", "the server died with the thread that started it"
    deadline = time.monotonic() + 20
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # ended with the command
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "(Z)" in Path(f"/proc/{pid}/stat").read_text()
