"""The bf16 copies of frozen weights the ORT engines' bf16 GEMM nodes keep from step to step
(ortflow/accel/graph/bf16_weights.py): used, and never stale (a weight written in place, unfrozen, or replaced by a
resumed ORT state is cast again)."""

import pytest
import torch

from ortflow.accel.graph import bf16_weights
from ortflow.run.runner import build_data, build_engine, build_model
from tests.conftest import TINY, make_cfg

# The tiny transformer in bf16, its embedding and first layer frozen (the head and the last layer train).
FROZEN = [
    *TINY,
    "model.num_layers=2",
    "model.dropout=0.0",
    "trainer.precision=bf16-mixed",
    "model.freeze=[embedding,transformer.layers.0]",
]
CACHE = bf16_weights.CACHE


def engine_of(mode: str, tmp_path, *extra: str):
    cfg = make_cfg(*FROZEN, f"accel={mode}", *extra)
    data = build_data(cfg)
    model = build_model(cfg, data)
    engine = build_engine(cfg, model, data, tmp_path / mode)
    batches = iter(data.train)
    return engine, model, [next(batches) for _ in range(3)]


def frozen_linear(model: torch.nn.Module) -> tuple[str, torch.nn.Parameter]:
    """The frozen first layer's first feed-forward weight."""
    name = "transformer.layers.0.linear1.weight"
    return name, dict(model.named_parameters())[name]


def fresh_eval(engine, batch) -> float:
    """The evaluation loss with every frozen weight cast afresh."""
    CACHE.invalidate()
    return float(engine.eval_step(*batch).loss_sum)


def assert_copies_hold() -> None:
    copies = CACHE.copies()
    assert copies, "no frozen weight's bf16 copy is kept"
    for source, copy in copies:
        assert torch.equal(copy, source.to(torch.bfloat16)), "a kept bf16 copy differs from its weight's cast"


@pytest.mark.parametrize("mode", ["ortmodule", "artifacts"])
def test_frozen_weights_are_cast_once_and_their_copies_reused(mode, tmp_path):
    engine, _, batches = engine_of(mode, tmp_path)
    engine.train_step(*batches[0])
    before = CACHE.stats.reused, CACHE.stats.casts
    engine.train_step(*batches[1])
    engine.train_step(*batches[2])
    reused, casts = CACHE.stats.reused - before[0], CACHE.stats.casts - before[1]
    assert reused > 0 and casts == 0, (reused, casts)  # after the first step, no frozen weight is cast again
    assert_copies_hold()
    assert engine.describe()["graph_fixes"]["matmuls_run_by_torch_bf16"] >= 4


def test_ortmodule_casts_a_frozen_weight_again_after_an_in_place_write_and_after_unfreezing(tmp_path):
    engine, model, batches = engine_of("ortmodule", tmp_path)
    engine.train_step(*batches[0])
    engine.train_step(*batches[1])
    start = float(engine.eval_step(*batches[2]).loss_sum)
    name, weight = frozen_linear(model)
    assert not weight.requires_grad
    # load_state_dict writes in place (the same storage, the version counter moves)
    state = model.state_dict()
    state[name] = state[name] * 1.5
    model.load_state_dict(state)
    served = float(engine.eval_step(*batches[2]).loss_sum)
    assert served != start  # the write matters to the loss
    assert served == fresh_eval(engine, batches[2])  # and the next step used it, not the copy made before
    assert_copies_hold()
    # Unfrozen, the weight trains: every step changes it, and its copy must follow.
    weight.requires_grad_(True)
    engine.inner.optimizer.add_param_group({"params": [weight]})
    engine.train_step(*batches[0])
    engine.train_step(*batches[1])
    served = float(engine.eval_step(*batches[2]).loss_sum)
    assert served == fresh_eval(engine, batches[2])
    assert_copies_hold()


def test_artifacts_casts_frozen_weights_again_from_a_resumed_ort_state(tmp_path):
    # The state to resume from holds other frozen weights: another seed's model. ORT's state is resumed where ORT's
    # optimizer graph steps (optim.fused=false); torch's fused AdamW resumes only its moments.
    other, _, _ = engine_of("artifacts", tmp_path / "other", "seed=7", "optim.fused=false")
    resumed_state = other.optimizer_state()
    del other
    engine, _, batches = engine_of("artifacts", tmp_path, "optim.fused=false")
    engine.train_step(*batches[0])
    engine.train_step(*batches[1])
    start = float(engine.eval_step(*batches[2]).loss_sum)
    kept = len(CACHE.copies())
    assert engine.load_optimizer_state(resumed_state)
    served = float(engine.eval_step(*batches[2]).loss_sum)
    assert served != start  # other weights, another loss
    assert served == fresh_eval(engine, batches[2])  # the resumed state's weights, not the copies made before
    engine.train_step(*batches[0])
    assert_copies_hold()
    assert len(CACHE.copies()) == kept  # the old state's copies (and buffers) are let go


def test_no_copy_is_kept_unless_an_engine_said_whose_weights_they_are_and_none_outlives_a_write():
    cache = bf16_weights.FrozenWeights()
    weight = torch.nn.Parameter(torch.randn(4, 3), requires_grad=False)
    assert torch.equal(cache.bf16(weight), weight.to(torch.bfloat16))
    assert not cache.copies() and cache.stats.casts == 1  # nobody said these are frozen parameters: no copy kept
    cache.serve_torch_parameters([weight])
    first = cache.bf16(weight)
    assert cache.bf16(weight) is first  # the same parameter, unchanged: the same copy
    with torch.no_grad():
        weight.mul_(2)  # the parameter's version counter moves
    assert torch.equal(cache.bf16(weight), weight.to(torch.bfloat16))
    weight.data.mul_(2)  # behind the version counter's back
    cache.invalidate()  # what code writing frozen weights that way must call
    assert torch.equal(cache.bf16(weight), weight.to(torch.bfloat16))
    weight.requires_grad_(True)  # unfrozen: never served from the cache again
    copy = cache.bf16(weight)
    assert cache.bf16(weight) is not copy and not cache.copies()
