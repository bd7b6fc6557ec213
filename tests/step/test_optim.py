"""The torch optimizer the engines that step with torch build from the optim group."""

import copy

import torch

from ortflow.config import OptimConfig, OptimName
from ortflow.step.optim import build_torch_optimizer, restore_kernel_choice


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32, generator=g)), torch.nn.Parameter(torch.randn(32, generator=g))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def test_adamw_steps_with_torchs_fused_kernel_the_update_of_its_default_loop():
    fused_params, loop_params = _params(), _params()
    fused = build_torch_optimizer(fused_params, OptimConfig(weight_decay=0.1))
    loop = build_torch_optimizer(loop_params, OptimConfig(weight_decay=0.1, fused=False))
    assert fused.defaults["fused"] is True and not loop.defaults["fused"]
    before = copy.deepcopy(loop_params)
    for _ in range(3):
        fused.step()
        loop.step()
    for f, lp, b in zip(fused_params, loop_params, before, strict=True):
        assert not torch.equal(lp, b)  # it stepped
        torch.testing.assert_close(f, lp, rtol=1e-6, atol=1e-7)


def test_adamw_falls_back_to_torchs_loop_where_no_fused_kernel_applies():
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))]  # torch's fused AdamW takes real floats only
    assert not build_torch_optimizer(params, OptimConfig()).defaults["fused"]


def test_sgd_ignores_the_adamw_setting():
    assert isinstance(build_torch_optimizer(_params(), OptimConfig(name=OptimName.sgd)), torch.optim.SGD)


def test_a_resumed_optimizer_steps_with_this_runs_kernel_not_the_checkpoints():
    saved = build_torch_optimizer(_params(), OptimConfig(fused=False)).state_dict()
    resumed = build_torch_optimizer(_params(), OptimConfig())
    resumed.load_state_dict(saved)
    restore_kernel_choice(resumed)
    assert all(group["fused"] is True for group in resumed.param_groups)
