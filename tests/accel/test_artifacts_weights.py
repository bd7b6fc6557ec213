"""accel=artifacts keeps one copy of the weights: the torch model's parameters are views of ORT's state's buffers."""

import gc

import numpy as np
import pytest
import torch

from ortflow.accel.compat.ort import buffer_view
from tests.accel.test_buffer_adamw import artifacts_engine, batches


def _shared(engine) -> bool:
    """Whether every torch parameter is a view of the ORT state's tensor of the same name."""
    state = engine.state._state
    return all(
        p.data_ptr() == buffer_view(state.get_parameter("model." + n).data).data_ptr()
        for n, p in engine.model.named_parameters()
    )


def _ort_weights(engine) -> dict[str, np.ndarray]:
    return {n: np.array(engine.state.parameters["model." + n].data) for n, _ in engine.model.named_parameters()}


@pytest.mark.parametrize("fused", [True, False], ids=["torch-adamw", "ort-optimizer-graph"])
def test_the_torch_model_holds_the_weights_ort_trains_without_a_copy(fused, tmp_path):
    data = batches()
    engine = artifacts_engine(fused, None, data[0], tmp_path)
    start = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    assert _shared(engine)
    for x, y in data[:3]:
        engine.train_step(x, y)
    ort_weights = _ort_weights(engine)
    for name, param in engine.model.named_parameters():
        assert (param.detach() - start[name]).abs().max() > 1e-4, name  # the update reached the torch model
        np.testing.assert_array_equal(param.detach().numpy(), ort_weights[name], err_msg=name)
    if not fused:  # a resume from ORT's own state opens a new one: the model follows it
        saved = engine.optimizer_state()
        engine.load_optimizer_state(saved)
        assert _shared(engine)
        engine.train_step(*data[3])
        ort_weights = _ort_weights(engine)
        for name, param in engine.model.named_parameters():
            np.testing.assert_array_equal(param.detach().numpy(), ort_weights[name], err_msg=name)
    state = engine.model_state_dict()
    assert all(state[n].data_ptr() != p.data_ptr() for n, p in engine.model.named_parameters())  # a copy


def test_the_models_weights_outlive_the_engine(tmp_path):
    """The views hold ORT's buffers (DLPack keeps the OrtValue): the model a run returns, or the one accel=auto goes on
    with after probing this engine, keeps its weights once the engine and its state are gone."""
    data = batches()
    engine = artifacts_engine(True, None, data[0], tmp_path)
    engine.train_step(*data[0])
    model = engine.model
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    del engine
    gc.collect()
    reused = [torch.full((64, 64), 7.0) for _ in range(256)]  # memory freed by the state would be handed out again
    assert reused and all(torch.equal(p.detach(), want[n]) for n, p in model.named_parameters())
