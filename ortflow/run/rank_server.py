"""The process the ranks of `ortflow ... distributed=ddp` are forked from: Python's multiprocessing fork server, which
preloads this module.

Forking is safe only from a process with one thread: a lock another thread holds at the fork stays held forever in
the child, which hangs when it takes it (and Python 3.12 warns on such a fork). The command itself runs torchrun's
agent, whose TCPStore server and rendezvous heartbeat are threads, so the ranks are not forked from it:
multiprocessing starts a fresh interpreter (fork + exec, safe from any process) that imports this module first, then
what a rank needs (torch, Hydra, ortflow's command and runner: `launch.start_rank_server`'s preload list), then forks
one child per rank on request. Nothing there starts a thread: numpy's OpenBLAS pool, the one these imports would
start, is kept to the calling thread (OPENBLAS_NUM_THREADS=1 in this process's environment); torch's and ONNX
Runtime's pools start on first use, which never comes here.

`start` starts it (the command calls it as early as it can: `ortflow/__main__.py` before the command imports torch
when its arguments ask for distributed=ddp, `launch.start_rank_server` in any case). Imported in the server, this
module sets it to end with the command (the parent-death signal where the command's main thread started it, and
multiprocessing's own end-of-file on a pipe from the command; each rank has the signal set on the server in turn) and
records for each fork the threads the server had (`threads_at_fork`, checked by the rank that fork made:
`check_forked_alone`). A rank also finds here the server's process id (its parent) and environment (to tell the
variables torchrun's agent set for it from those the server started with).
"""

import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

PARENT = "ORTFLOW_RANK_SERVER_PARENT"  # in the fork server's environment: the pid of the command that started it
# In the fork server's environment: "1" where the command's main thread started it. The parent-death signal fires
# when the *thread* that forked a process ends, so the server sets it only then; started from another thread (a
# sweep's launcher thread) it ends with the command by the end-of-file multiprocessing's fork server reads on its
# pipe from the command (the command's process, whichever thread started it).
FROM_MAIN_THREAD = "ORTFLOW_RANK_SERVER_FROM_MAIN_THREAD"
SERVER_PID = os.getpid()
BASE_ENVIRON = dict(os.environ)
_at_fork: list[int | None] = []  # the threads this process had when it last forked (set in the fork server)


def threads() -> int | None:
    """This process's threads (Linux: /proc/self/task), None where that cannot be read."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _before_fork() -> None:
    _at_fork[:] = [threads()]


def _serve() -> None:
    """In the fork server, as it imports this module: end with the command that started it (the parent-death
    signal; its ranks end with it in turn), and count threads at every fork."""
    if sys.platform.startswith("linux") and os.environ.get(FROM_MAIN_THREAD) == "1":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(os.environ[PARENT]):  # the command died before the signal was set up
        os._exit(0)
    os.register_at_fork(before=_before_fork)


if PARENT in os.environ and "multiprocessing.forkserver" in sys.modules:  # the fork server, preloading this module
    _serve()


def threads_at_fork() -> int | None:
    """In a rank: the threads of the fork server when it forked this rank (None: not forked by the fork server
    with this module preloaded, or no /proc)."""
    return _at_fork[0] if _at_fork and os.getpid() != SERVER_PID else None


def check_forked_alone() -> None:
    """In a rank: raise if the process it was forked from had another thread at the fork.

    Raises:
        RuntimeError: a bug in ortflow (something the fork server imports started a thread): never a user's error.
    """
    count = threads_at_fork()
    if count is not None and count != 1:
        raise RuntimeError(
            f"ortflow's rank fork server had {count} threads when it forked this rank (pid {os.getpid()}); ranks must "
            "be forked from a process with one thread. This is a bug in ortflow."
        )


def rank_environ(command: dict[str, str]) -> dict[str, str]:
    """The environment a rank runs with: the launching command's (`command`) plus what torchrun's agent set for this
    rank (RANK, WORLD_SIZE, MASTER_PORT, ...: what differs from this server's own environment)."""
    agent = {k: v for k, v in os.environ.items() if BASE_ENVIRON.get(k) != v}
    return {**command, **agent}


def wanted(args: list[str]) -> bool:
    """Whether the command line `ortflow ARGS` asks for ranks this command starts (distributed=ddp or deepspeed,
    not under a torchrun started by hand): a guess made before the config is composed, to start the server early. A
    wrong guess (distributed.nproc_per_node=1) leaves a server idle; a missed one (ddp set by a recipe) starts it
    later."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    return not under_torchrun and bool({"distributed=ddp", "distributed=deepspeed"} & set(args))


def start(preload: list[str]) -> None:
    """Start multiprocessing's fork server unless it runs: a fresh interpreter (fork + exec: safe from any process,
    threads or not) that imports this module and then `preload`, then waits for requests. Returns at once. numpy's
    OpenBLAS pool, the one thread those imports would start, is kept to the calling thread there
    (OPENBLAS_NUM_THREADS=1, in the server's environment only)."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__, *preload])
    import threading

    from_main = "1" if threading.current_thread() is threading.main_thread() else "0"
    server_environ = {"OPENBLAS_NUM_THREADS": "1", PARENT: str(os.getpid()), FROM_MAIN_THREAD: from_main}
    with _environ_set(server_environ):  # the server copies the environment
        forkserver.ensure_running()


@contextmanager
def _environ_set(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
