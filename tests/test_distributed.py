"""distributed=ddp: wrapper order validated before any process starts, DDP around ORTModule under torchrun (started
by ortflow, or by hand), 2 ranks x batch B == 1 process x batch 2B, replicas in sync, ORT on every rank, a dead rank
ends the run, two "nodes" on loopback, and sweeps of DDP jobs."""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ortflow import accel, distributed
from tests.conftest import COMPILE_REFUSED, USER_ENV, custom_model, make_cfg, run_cli, start_cli

# dropout=0 and a constant LR: the 1-process and 2-process runs then compute the same thing in another order.
SMALL = [
    "model.d_model=32",
    "model.nhead=2",
    "model.num_layers=1",
    "model.dim_feedforward=64",
    "model.dropout=0",
    "data.block_size=16",
    "trainer.max_steps=10",
    "trainer.eval_every=5",
    "trainer.eval_batches=2",
    "trainer.log_every=1",
    "logger.progress=false",
]
# Measured (10 AdamW steps): 2 ranks vs 1 process, relative parameter difference (norm) 3e-6, loss 2e-7.
RTOL_PARAMS = 1e-4
RTOL_LOSS = 1e-5


def problems(*overrides: str) -> list[str]:
    cfg = make_cfg(*overrides)
    return distributed.problems(cfg.distributed) + accel.problems(cfg)  # the wrappers' rules and the engine's


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["accel=ortmodule", "distributed.wrappers=[accel,dp]"], "Use distributed=ddp"),
        (["accel=ortmodule", "distributed=ddp", "distributed.wrappers=[ddp,accel]"], "innermost"),
        (["accel=artifacts", "distributed=ddp"], "no data parallelism"),
        (["distributed.wrappers=[accel,horovod]"], "unknown ['horovod']"),
        (["distributed.nproc_per_node=2"], "need a multi-process wrapper"),
        (["distributed=ddp", "distributed.wrappers=[accel]"], "needs ddp in distributed.wrappers"),
        (["distributed=ddp", "distributed.backend=nccl"], "needs CUDA GPUs"),
        (["distributed=ddp", "distributed.nnodes=2", "distributed.node_rank=2"], "distributed.node_rank=2"),
        # distributed=deepspeed (tests/deepspeed/test_deepspeed.py trains with it)
        (["accel=ortmodule", "distributed=deepspeed", "distributed.zero_stage=3"], "ZeRO-3 partitions the parameters"),
        (["distributed=deepspeed", "distributed.wrappers=[deepspeed,accel]"], "the outermost wrapper"),
        (["accel=ortmodule", "distributed=deepspeed", "distributed.wrappers=[deepspeed,accel]"], "inside ORTModule"),
        (["distributed=deepspeed", "distributed.wrappers=[accel,ddp,deepspeed]"], "choose one"),
        (["accel=artifacts", "distributed=deepspeed"], "DeepSpeed steps a torch optimizer"),
        (["accel=compile", "distributed=deepspeed"], "accel=compile with distributed=deepspeed is not offered"),
        (["distributed=deepspeed", "distributed.nproc_per_node=1"], "with one process"),
    ],
)
def test_wrapper_order_and_launch_settings_are_checked(overrides, says):
    found = problems(*overrides)
    assert any(says in p for p in found), found


def test_deepspeed_not_installed_says_how_to_install_it():
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("DeepSpeed is installed in this venv (.venv-deepspeed)")
    found = problems("distributed=deepspeed")  # the default venv: DeepSpeed is an optional extra
    assert any("pip install 'ortflow[deepspeed]'" in p for p in found), found


def test_the_shipped_orders_are_accepted():
    assert problems("accel=ortmodule", "distributed=ddp") == []
    assert problems("accel=none", "distributed=ddp") == []
    assert problems("accel=artifacts") == []


def test_a_refused_order_stops_before_any_process_starts(tmp_path):
    result = run_cli("accel=ortmodule", "distributed=ddp", "distributed.wrappers=[ddp,accel]", cwd=tmp_path)
    assert result.returncode == 2 and "innermost" in result.stderr
    assert "torch.distributed.run" not in result.stderr and not list(tmp_path.rglob("run.json"))


def shown(stderr: str) -> str:
    """What a failed assertion shows of a command's stderr: from a fatal error's report (the signal, each thread's
    stack) where there is one, since its tail is only the list of extension modules; else the tail."""
    start = stderr.find("Fatal Python error")
    return stderr[start : start + 3000] if start >= 0 else stderr[-3000:]


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["train/loss"] for x in lines if "train/loss" in x]


@pytest.mark.slow
@pytest.mark.parametrize("accel", ["ortmodule", "compile"])  # eager's 2 ranks: the sweep test below
def test_two_ranks_with_batch_b_match_one_process_with_batch_2b(accel, tmp_path):
    two = run_cli(*SMALL, f"accel={accel}", "distributed=ddp", "data.batch_size=8", "hydra.run.dir=two", cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    # A rank aborted at interpreter exit ("terminate called") while the teardown was left to interpreter shutdown;
    # the cause is checked exactly by the thread test below, every DDP run here guards the exit itself.
    assert "terminate called" not in two.stderr, two.stderr[-3000:]
    one = run_cli(
        *SMALL,
        f"accel={accel}",
        "distributed=ddp",
        "distributed.nproc_per_node=1",
        "data.batch_size=16",
        "hydra.run.dir=one",
        cwd=tmp_path,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    info = record(tmp_path / "two")["engine"]
    assert info["world_size"] == 2 and info["replicas_identical"]  # parameters bitwise equal on both ranks
    assert info["ranks_started_by"] == "forkserver"  # by the rank fork server, whose imports were done
    expected = {"ortmodule": "onnxruntime", "compile": "inductor"}[accel]
    assert info["ranks_executed_by"] == [expected, expected]
    a, b = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(a) == len(b) == 10
    worst_loss = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
    wa = torch.load(tmp_path / "two" / "checkpoints" / "final.pt", weights_only=True)
    wb = torch.load(tmp_path / "one" / "checkpoints" / "final.pt", weights_only=True)
    diff = torch.cat([(wa[k] - wb[k]).flatten() for k in wa]).norm() / torch.cat([wb[k].flatten() for k in wb]).norm()
    print(f"{accel}: 2 ranks vs 1 process: loss {worst_loss:.2g}, parameters {float(diff):.2g} (relative)")
    assert worst_loss <= RTOL_LOSS and diff <= RTOL_PARAMS
    # Only rank 0 wrote into the shared run dir.
    assert not (tmp_path / "two" / "onnx").exists() or not list((tmp_path / "two" / "onnx").glob("rank-*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]


@pytest.mark.slow
def test_sigterm_to_the_command_checkpoints_every_rank_and_exits_0(tmp_path):
    """A scheduler's SIGTERM reaches the command, whose agent passes it to the ranks: they stop after the current
    step (rank 0 writes the checkpoint) and exit by themselves, not killed after the agent's 30 s wait; the record
    says preempted, exit status 0."""
    args = [*SMALL, "trainer.max_steps=100000", "trainer.log_every=50", "distributed=ddp", "hydra.run.dir=run"]
    proc = start_cli(*args, cwd=tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.stat().st_size):
        assert time.monotonic() < deadline, "the run never logged a step"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, shown(stderr)
    assert "forcefully exiting" not in stderr and stderr.count("Continue with") == 1, shown(stderr)
    assert record(tmp_path / "run")["status"] == "preempted"
    assert list((tmp_path / "run" / "checkpoints").glob("step-*.pt"))


@pytest.mark.slow
def test_a_callback_that_stops_one_rank_stops_every_rank_at_that_step(tmp_path):
    """A user's callback says stop on rank 1 only: every rank stops after that evaluation (agreed like a SIGTERM), the
    run ends by the callback with its checkpoint written, where rank 0 alone would have waited in DDP's next
    all-reduce until torchrun's timeout."""
    stop = ["+callbacks.stop._target_=tests.helpers.callbacks.StopOnRank", "+callbacks.stop.rank=1"]
    result = run_cli(*SMALL, *stop, "distributed=ddp", "hydra.run.dir=run", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, shown(result.stderr)
    run = record(tmp_path / "run")
    assert run["ended_by"] == "callback" and run["metrics"]["steps"] == 5, run["metrics"]


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_run_with_an_error_naming_it(tmp_path):
    env = USER_ENV
    model = custom_model("build_dies_on_rank", rank=1, step=3)
    start = time.monotonic()
    result = run_cli(*model, *SMALL[5:], "distributed=ddp", "hydra.run.dir=run", cwd=tmp_path, env=env, timeout=300)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "rank: 1" in result.stderr or "rank 1" in result.stderr, result.stderr[-3000:]
    # Usually rank 0 sees gloo's closed connection at once and records "failed". Otherwise torchrun's agent stops it
    # (SIGTERM), inside a collective (its record still "running"), outside its steps ("interrupted") or after a step
    # ("preempted", its checkpoint written): the launch then records the failure (launch.record_rank_failure).
    assert record(tmp_path / "run")["status"] == "failed"
    print(f"a dead rank ended the run after {elapsed:.1f} s (start-up included)")
    assert elapsed < 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    common = [
        *SMALL,
        "accel=ortmodule",
        "distributed=ddp",
        "distributed.nnodes=2",
        "distributed.nproc_per_node=1",
        f"distributed.rdzv_endpoint={endpoint}",
        "logger.progress=false",
    ]
    nodes = [start_cli(*common, f"distributed.node_rank={n}", f"hydra.run.dir=node{n}", cwd=tmp_path) for n in (0, 1)]
    errors = [node.communicate(timeout=300)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    info = record(tmp_path / "node0")["engine"]
    assert info["world_size"] == 2 and info["ranks_executed_by"] == ["onnxruntime"] * 2 and info["replicas_identical"]
    assert not (tmp_path / "node1" / "run.json").exists()  # rank 1 lives on node 1 and writes nothing


# Runs ortflow's command under torchrun in-process, then reports the threads each rank has left when the interpreter
# is about to shut down (Linux: /proc/self/task).
THREAD_PROBE = """
import os, sys
def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
before = threads()
sys.argv = ["ortflow", *sys.argv[1:]]
from ortflow.cli.train import main
main()
print(f"rank {os.environ['RANK']}: before {before} after {threads()}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads a process's threads from /proc")
def test_a_ddp_ortmodule_run_leaves_no_threads_to_interpreter_shutdown(tmp_path):
    """ORT's sessions and the gloo process group go when the run ends, not in interpreter shutdown: left there, the
    sessions outlived the ORT environment ORT's atexit handler deletes, and gloo's 3 threads (pinned by
    torch.distributed.nn's default arguments) ran on through finalization and exit()."""
    probe = tmp_path / "probe.py"
    probe.write_text(THREAD_PROBE)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(probe)]
    args = [*SMALL, "accel=ortmodule", "accel.intra_op_threads=2", "distributed=ddp", "hydra.run.dir=run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # no OpenMP pool threads, which live as long as the process
    result = subprocess.run([*command, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert record(tmp_path / "run")["engine"]["ranks_executed_by"] == ["onnxruntime"] * 2  # ORT sessions existed
    reports = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert len(reports) == 2, result.stdout[-2000:]
    for line in reports:
        before, after = line.split(" before ")[1].split(" after ")
        after = after[: after.index("]") + 1]  # another rank's output may follow on the same line
        assert after == before, line  # e.g. before the fix: + gloo_tcp_loop, 2 pt_gloo_runloop, 2 ORT pool threads


@pytest.mark.slow
def test_a_sweep_of_ddp_jobs_makes_one_dir_per_job(tmp_path):
    """Job 0 trains in the command's process (one rank) with two intra-op threads, so torch's OpenMP threads start
    there; job 1's ranks are still forked by the rank fork server, a process with one thread, never by the command,
    and run with the thread pools OMP_NUM_THREADS asks for, not the server's one-thread OpenBLAS."""
    sweep = ["distributed.nproc_per_node=1,2", "hydra.sweep.dir=sweep"]
    args = ["-m", *SMALL, "distributed=ddp", "data.batch_size=8", *sweep]
    result = run_cli(*args, cwd=tmp_path, env={"OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    assert all(record(tmp_path / "sweep" / job)["status"] == "completed" for job in jobs)
    two = record(tmp_path / "sweep" / "1")["engine"]
    assert two["world_size"] == 2 and two["ranks_started_by"] == "forkserver" and two["replicas_identical"]
    # Every pool of a forked rank (torch's OpenMP, numpy's OpenBLAS) as OMP_NUM_THREADS asks (rank 0's record).
    pools = record(tmp_path / "sweep" / "1")["host"]["thread_pools"]
    assert pools and set(pools.values()) == {2}, pools
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no stray run dirs


@pytest.mark.slow
def test_a_ddp_run_resumed_from_a_checkpoint_matches_the_uninterrupted_run(tmp_path):
    """Dropout on: a resumed rank's first step creates a fresh loader iterator (which draws from torch's generator);
    its masks must still be the uninterrupted run's. With ORTModule, whose dropout masks are drawn by ortflow and fed
    to ORT: the resume logic (checkpoint, loader, generators per rank) is the engines' shared code, and eager resume
    is tested on one process (tests/run/test_resume.py)."""
    args = [
        *SMALL,
        "model.dropout=0.1",
        "accel=ortmodule",
        "distributed=ddp",
        "data.batch_size=8",
        "trainer.checkpoint.every=5",
    ]
    full = run_cli(*args, "hydra.run.dir=full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    ckpt = tmp_path / "full" / "checkpoints" / "step-00000005.pt"
    resumed = run_cli(*args, f"trainer.resume={ckpt}", "hydra.run.dir=resumed", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert record(tmp_path / "resumed")["engine"]["replicas_identical"]
    assert losses(tmp_path / "resumed") == losses(tmp_path / "full")[5:]  # dropout masks per (step, rank) again
    wa = torch.load(tmp_path / "full" / "checkpoints" / "final.pt", weights_only=True)
    wb = torch.load(tmp_path / "resumed" / "checkpoints" / "final.pt", weights_only=True)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_slurm_launcher_preset_composes_with_ddp_settings():
    from hydra import compose, initialize_config_dir

    from ortflow.paths import config_dir

    overrides = ["hydra/launcher=slurm", "distributed=ddp", "distributed.nnodes=2", "distributed.nproc_per_node=4"]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides, return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.cpus_per_task) == (2, 1, 4)
    assert cfg.distributed.node_rank == 0 and cfg.distributed.rdzv_endpoint == "127.0.0.1:29500"  # outside SLURM


@pytest.mark.slow
def test_torchrun_started_by_hand_shares_one_run_dir(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "ortflow",
        *SMALL,
        "accel=ortmodule",
        "distributed=ddp",
        "data.batch_size=8",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/torchrun-*")  # one dir for both ranks, named after the run id
    info = record(run_dir)["engine"]
    assert info["ranks_executed_by"] == ["onnxruntime"] * 2 and info["replicas_identical"]
    assert info["ranks_started_by"] == "torchrun"
    assert sorted(p.name for p in (tmp_path / "outputs").rglob("*") if p.parent.parent == tmp_path / "outputs") == [
        run_dir.name
    ]


@pytest.mark.slow
def test_under_ddp_rank_0_probes_for_accel_auto_and_every_rank_trains_with_its_choice_in_bf16(tmp_path):
    args = [*SMALL, "trainer.max_steps=3", "accel=auto", "accel.probe_steps=1", "trainer.precision=bf16-mixed"]
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = run_cli(*args, "distributed=ddp", "hydra.run.dir=run", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    info = record(tmp_path / "run")["engine"]
    choice = info["auto"]["choice"]
    candidates = {"none", "ortmodule"} | ({"compile"} if COMPILE_REFUSED is None else set())  # artifacts: no DDP
    assert choice["precision"] == "bf16-mixed" and choice["accel"] in candidates
    assert {p["engine"] for p in info["auto"]["probes"]} == candidates
    executed = {"none": "pytorch", "ortmodule": "onnxruntime", "compile": "inductor"}[choice["accel"]]
    assert info["ranks_executed_by"] == [executed, executed] and info["replicas_identical"]
    assert result.stdout.count("accel=auto chose") + result.stderr.count("accel=auto chose") == 1  # one probe
