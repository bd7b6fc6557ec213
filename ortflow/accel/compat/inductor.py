"""The door to torch.compile's inductor backend for accel=compile: a backend that counts the runs of the graphs
inductor compiled (the proof that a step ran compiled, as ORT's run counters are for the ORT engines), dynamo's
own count of graph breaks, and inductor's cache folder under ortflow's cache."""

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ortflow.accel.compat.torch_patches import major_minor
from ortflow.paths import ortflow_cache


def cache_folder() -> Path:
    """Inductor's caches (its FX graph cache and the C++ kernels it builds) under ortflow's cache, as the extensions
    are: `$ORTFLOW_CACHE_DIR/inductor`, else `$XDG_CACHE_HOME/ortflow/inductor`, else `~/.cache/ortflow/inductor`.
    A TORCHINDUCTOR_CACHE_DIR the user set wins."""
    if given := os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(given)
    return ortflow_cache() / "inductor"


def use_cache_folder() -> Path:
    """Point inductor at cache_folder() (read by inductor when it first compiles) and return it."""
    folder = cache_folder()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def stop_compile_workers() -> None:
    """End inductor's compile worker processes (torch starts them when it first compiles, one per core).

    Why: on a warm cache the compilation is done long before the workers have finished starting (each imports torch),
    and their start-up then runs beside the first training steps: the vision recipe's compiled step took 41 ms instead
    of 20 ms for its first ~25 steps on a 2-core Zen 5, which is what auto's probe and ortflow-bench timed. Ending them
    waits for that start-up (~2 s there), inside the step that compiled, where the compile time is counted; a later
    compilation (the evaluation's graph) starts them again."""
    from torch._inductor import async_compile

    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if shutdown is not None:
        shutdown()


def cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU code generation calls ($CXX, else g++ or clang++ on PATH), or None."""
    given = os.environ.get("CXX")
    if given:
        return shutil.which(given)
    return shutil.which("g++") or shutil.which("clang++")


@dataclass
class CountingBackend:
    """torch.compile's `backend`: inductor, with a count of each run of a graph it compiled (forward graphs; the
    backward of a compiled forward is compiled with it). `mode` is torch.compile's (its inductor options);
    `graphs` counts the graphs compiled, `compile_s` their compile time."""

    mode: str = "default"
    runs: int = 0
    graphs: int = 0
    compile_s: float = 0.0
    _inductor: Callable[..., Any] | None = field(default=None, repr=False)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        from torch._dynamo import lookup_backend

        self._inductor = self._inductor or lookup_backend("inductor")
        options = torch._inductor.list_mode_options(self.mode)
        start = time.perf_counter()
        compiled = (
            self._inductor(gm, example_inputs, config_patches=options)
            if options
            else self._inductor(gm, example_inputs)
        )
        self.compile_s += time.perf_counter() - start
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run


def compile_errors() -> tuple[type[BaseException], ...]:
    """The errors by which torch.compile says it cannot trace or compile a model (graph breaks under fullgraph,
    data-dependent branches, ops inductor cannot lower, a C++ build that failed, the recompile limit hit under
    fullgraph)."""
    exc = torch._dynamo.exc
    return (exc.TorchDynamoException, *(getattr(exc, n) for n in ("FailOnRecompileLimitHit",) if hasattr(exc, n)))


def is_recompile_limit(err: BaseException) -> bool:
    """Whether `err` is dynamo giving up on a function past its recompile limit (under fullgraph; torch 2.6 calls it
    the cache size limit)."""
    text = str(err).lower()
    return type(err).__name__ == "FailOnRecompileLimitHit" or any(
        words in text for words in ("recompile limit", "recompile_limit", "cache_size_limit", "cache size limit")
    )


# torch.compile trains as eager PyTorch does from this torch on (verified by the tests on 2.14 and 2.15). On torch 2.6
# it does not: ortflow's causal transformer (nn.TransformerEncoder, is_causal with its mask) gets a step-1 gradient
# norm 0.2% off eager's with an identical forward (the same model non-causal, and MLPs and CNNs, agree to 1e-7).
VERIFIED_FROM = (2, 14)


def unverified_torch() -> str | None:
    """Why accel=compile is refused on the installed torch (None: it is not)."""
    version = major_minor(torch.__version__)
    if version == (0, 0) or version >= VERIFIED_FROM:  # (0, 0): a version it cannot read, left to torch
        return None
    return (
        f"accel=compile: torch {torch.__version__}'s torch.compile does not train every model as eager PyTorch does "
        "(on torch 2.6 a causal transformer's gradients come out 0.2% off eager's with the same forward), and ortflow "
        f"offers it from torch {VERIFIED_FROM[0]}.{VERIFIED_FROM[1]} on, where its tests hold it to eager's results. "
        "Upgrade torch (ortflow's default is 2.14.1), or train with accel=none."
    )


def graph_breaks() -> int:
    """Dynamo's process-wide count of graph breaks (where it ran part of a function in eager PyTorch)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def recompile_limit() -> int:
    """How many graphs dynamo compiles for one function before it runs it in eager PyTorch instead."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name before torch 2.7
        with contextlib.suppress(AttributeError):
            return int(getattr(config, name))
    return 8


def reset() -> None:
    """Forget every compiled frame (a new engine in the same process compiles its own model afresh)."""
    torch._dynamo.reset()
