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


def cache_folder() -> Path:
    """Inductor's caches (its FX graph cache and the C++ kernels it builds) under ortflow's cache, as the extensions
    are: `$ORTFLOW_CACHE_DIR/inductor`, else `$XDG_CACHE_HOME/ortflow/inductor`, else `~/.cache/ortflow/inductor`.
    A TORCHINDUCTOR_CACHE_DIR the user set wins."""
    if given := os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(given)
    base = os.environ.get("ORTFLOW_CACHE_DIR")
    if base:
        return Path(base) / "inductor"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ortflow" / "inductor"


def use_cache_folder() -> Path:
    """Point inductor at cache_folder() (read by inductor when it first compiles) and return it."""
    folder = cache_folder()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


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
    """Whether `err` is dynamo giving up on a function past its recompile limit (under fullgraph)."""
    return type(err).__name__ == "FailOnRecompileLimitHit" or "recompile limit" in str(err).lower()


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
