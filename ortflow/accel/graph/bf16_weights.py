"""bf16 copies of frozen weights, made once and reused by the bf16 GEMM nodes (accel/graph/aten_gemm.py) from step to
step (`trainer.precision=bf16-mixed` in the ORT engines).

Why: a bf16 GEMM node casts its weight to bf16 on every call, as torch's autocast does on every step. A frozen weight
(LoRA's base model, `model.freeze`) never changes, so its bf16 copy can be made once: on the GPT-2-shaped LoRA model
of docs/finetune.md that is 82M weights read in fp32 and written in bf16 each step that no longer are.

Which nodes: the graph pass that sets the gradient masks (aten_nodes.set_gradient_masks) flags each GEMM node whose
weight input is a frozen parameter of the exported model (a graph initializer or input that is no trainable
parameter); only those look here.

Never a stale copy. Each engine says, before each of its runs, whose buffers the weights are in, and a copy is served
only while all of these hold (else the weight is cast again):
- the fp32 tensor handed to the node lies at the same address, with the same shape, strides and dtype. Each kept copy
  holds that tensor (ORT's buffer, or the torch parameter's storage), so no other tensor can take the address while
  the copy is kept: an address that matches is the same buffer;
- ORTModule (`serve_torch_parameters`, which feeds the torch parameters to ORT without copying them): only the frozen
  parameters it names are kept, each while it still has that storage, still needs no gradient and its version
  counter (moved by every in-place write through the parameter: load_state_dict, an optimizer, `p.mul_(2)` under
  no_grad) is where it was when the copy was made. A write through `p.data` bypasses the version counter: code that
  writes frozen weights that way between steps calls `invalidate()`;
- the artifacts engine (`serve_ort_state`, whose ORT CheckpointState owns the weights and which writes them only by
  loading a new state): the copies hold while the state is the same object; a new state (a resumed run) or another
  engine's run forgets them all.
Between two engines' runs in one process the copies are forgotten too (engines alternating are correct, not fast).
"""

import threading
import weakref
from dataclasses import dataclass

import torch

MAX_ENTRIES = 4096  # more distinct weights than any graph has: beyond it the cache starts over (bounded memory)


@dataclass
class _Entry:
    source: torch.Tensor  # the fp32 tensor the copy was made from: kept alive, so its address is its own
    copy: torch.Tensor  # its bf16 copy
    version: int | None  # the parameter's version counter when the copy was made (None: ORT's buffer)


@dataclass
class Stats:
    casts: int = 0  # frozen weights cast (a first use, or a copy that no longer held)
    reused: int = 0  # copies served without a cast


class FrozenWeights:
    """The process's bf16 copies of frozen weights, by the address of the fp32 buffer each was made from."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._watched: dict[int, weakref.ref[torch.Tensor]] | None = None  # ORTModule's frozen parameters
        self._state: weakref.ref[object] | None = None  # the artifacts engine's ORT state
        self._lock = threading.RLock()
        self.stats = Stats()

    def invalidate(self) -> None:
        """Forget every copy: the next use of each weight casts it again."""
        with self._lock:
            self._entries.clear()

    def _forget(self) -> None:
        with self._lock:
            self._entries.clear()
            self._watched, self._state = None, None

    def serve_torch_parameters(self, parameters: list[torch.Tensor]) -> None:
        """Before an ORTModule run: the frozen weights are these torch parameters' storage (those needing a gradient
        are left out). Copies of any other buffer are forgotten."""
        watched = {p.data_ptr(): weakref.ref(p) for p in parameters if not p.requires_grad}
        with self._lock:
            if self._watched is None:
                self._forget()
            self._watched = watched
            for address in [a for a in self._entries if a not in watched]:
                del self._entries[address]

    def serve_ort_state(self, state: object) -> None:
        """Before an artifacts run: the frozen weights are buffers of ORT's CheckpointState `state`; copies made
        under any other state (or engine) are forgotten, and so are these once `state` is gone."""
        with self._lock:
            current = self._state() if self._state is not None else None
            if current is not state:
                self._forget()
                self._state = weakref.ref(state, lambda _: self._state_gone())

    def _state_gone(self) -> None:
        with self._lock:
            if self._state is not None and self._state() is None:
                self._forget()

    def _version(self, weight: torch.Tensor) -> tuple[bool, int | None]:
        """(whether a copy of `weight` may be kept and served, the version it is valid for)."""
        if self._state is not None:
            return self._state() is not None, None
        if self._watched is None:
            return False, None  # no engine said whose buffers these are
        ref = self._watched.get(weight.data_ptr())
        parameter = ref() if ref is not None else None
        if parameter is None or parameter.data_ptr() != weight.data_ptr() or parameter.requires_grad:
            return False, None
        return True, parameter._version

    def bf16(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` in bf16: the copy made before while it holds, else a fresh cast (kept when it may be)."""
        with self._lock:
            keep, version = self._version(weight)
            entry = self._entries.get(weight.data_ptr())
            if (
                keep
                and entry is not None
                and entry.version == version
                and entry.source.dtype == weight.dtype
                and entry.source.shape == weight.shape
                and entry.source.stride() == weight.stride()
            ):
                self.stats.reused += 1
                return entry.copy
            self.stats.casts += 1
            copy = weight.to(torch.bfloat16)
            if not keep:
                self._entries.pop(weight.data_ptr(), None)
                return copy
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
            self._entries[weight.data_ptr()] = _Entry(weight, copy, version)
            return copy

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(fp32 source, bf16 copy) of every copy kept (for tests: each copy must equal its source's cast)."""
        with self._lock:
            return [(e.source, e.copy) for e in self._entries.values()]


CACHE = FrozenWeights()
