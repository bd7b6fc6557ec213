"""The engine contract (ortflow/accel/engine.py): optional capabilities found with isinstance, and a wrapping engine
(accel=auto's AutoEngine, ortflow-bench's Timed) offering exactly those of the engine it wraps."""

from pathlib import Path

import pytest

from ortflow.accel import catalog
from ortflow.accel.auto import AutoEngine, auto_engine
from ortflow.accel.engine import CAPABILITIES, Chosen, Engine, GradNorm, MicroBatches, Shards, Wrapper, forwarding
from ortflow.bench.measure import timed_engine


class Bare:
    """The required methods only."""

    name = "bare"

    def train_step(self, inputs, targets):
        return 1.0

    def eval_step(self, inputs, targets):
        return None

    def set_lr(self, lr):
        self.lr = lr

    def model_state_dict(self):
        return {}

    def optimizer_state(self):
        return {"format": "bare"}

    def load_optimizer_state(self, state):
        return False

    def describe(self):
        return {"engine": self.name}


class Full(Bare):
    """Every loop capability: accumulation, the gradient norm, shards."""

    def __init__(self):
        self.last_grad_norm = 0.5
        self.shards: list[Path] = []

    def train_micro(self, micro):
        self.last_grad_norm = 2.0
        return float(len(micro))

    def save_shards(self, directory):
        self.shards.append(directory)


def test_an_engine_with_the_required_methods_only_offers_no_capability():
    assert isinstance(Bare(), Engine)
    assert not any(isinstance(Bare(), capability) for capability in CAPABILITIES)


def auto_of(engine):
    return auto_engine(engine, {"accel": engine.name, "precision": "32-true"}, [])


@pytest.mark.parametrize("wrap", [auto_of, timed_engine])
def test_a_wrapping_engine_offers_exactly_the_capabilities_of_the_engine_it_wraps(wrap):
    bare, full = wrap(Bare()), wrap(Full())
    for capability in (MicroBatches, GradNorm, Shards):
        assert not isinstance(bare, capability)
        assert isinstance(full, capability)
    assert full.train_micro([1, 2, 3]) == 3.0 and full.last_grad_norm == 2.0  # read through, at each step
    full.save_shards(Path("shards"))
    assert full.wrapped.shards == [Path("shards")]
    full.last_grad_norm = 7.0  # written through too (ortflow-check replaces an optimizer that way)
    assert full.wrapped.last_grad_norm == 7.0
    assert full.name == "bare" and full.optimizer_state() == {"format": "bare"}
    assert not hasattr(type(full), "__getattr__")


def test_auto_engine_records_its_own_choice_and_is_the_class_it_was():
    engine = auto_engine(Full(), {"accel": "bare", "precision": "32-true"}, [{"engine": "bare"}])
    assert isinstance(engine, AutoEngine) and isinstance(engine, Chosen)
    assert type(engine).__name__ == "AutoEngine"
    assert engine.describe()["auto"] == {"choice": engine.choice, "probes": [{"engine": "bare"}]}
    assert "choice" not in vars(Full())  # its own, not forwarded


def test_a_wrapper_defining_a_capability_keeps_its_own():
    class Micro(Wrapper):
        def train_micro(self, micro):
            return -1.0

    assert forwarding(Micro, Full())(Full()).train_micro([1]) == -1.0


def test_engine_module_declarations_are_read_in_one_place():
    none = catalog.engines()["none"]
    assert catalog.declared(none, "SIMPLICITY") == 0 and catalog.declared(none, "WHY_UNRUN", {}) == {}
    with pytest.raises(ValueError):
        catalog.declared(none, "train_step")
