"""ONNX Runtime's own random generator (dropout inside ORT graphs), seeded without importing ORT where a run never
needs it: an eager run does not import onnxruntime at all."""

import sys

_BINDING = "onnxruntime.capi._pybind_state"
_pending_seed: list[int] = []  # a seed given before ONNX Runtime was imported


def set_ort_seed(seed: int) -> None:
    """Seed ONNX Runtime's own generator (dropout inside ORT graphs); ORT exposes it only in its private binding.
    Before ORT is imported (an eager run never imports it) the seed is kept, and given to ORT by `seed_on_import`,
    which every ORT path runs first (versions.prepare)."""
    binding = sys.modules.get(_BINDING)
    if binding is None:
        _pending_seed[:] = [seed]
        return
    binding.set_seed(seed)


def seed_on_import() -> None:
    """Import ONNX Runtime's binding and give it the last seed set before (set_ort_seed)."""
    from onnxruntime.capi import _pybind_state

    if _pending_seed:
        _pybind_state.set_seed(_pending_seed.pop())
