"""distributed=deepspeed's settings come from ortflow's, never from DeepSpeed's defaults (ortflow/step/deepspeed.py;
the 2-rank runs are in tests/deepspeed/)."""

import pytest

from ortflow.step.deepspeed import ds_config
from tests.conftest import make_cfg


@pytest.mark.parametrize(
    ("stage", "grad_clip", "clipping", "accumulation"),
    # stage 0: torch clips and the gradients add up in place, as under DDP; ZeRO: DeepSpeed's own
    [(2, None, 0.0, 3), (2, 0.5, 0.5, 3), (1, 1.0, 1.0, 3), (0, 0.5, 0.0, 1)],
)
def test_deepspeed_gets_ortflows_settings_and_nothing_of_its_own(stage, grad_clip, clipping, accumulation):
    cfg = make_cfg("distributed=deepspeed", f"distributed.zero_stage={stage}").distributed
    config = ds_config(cfg, 16, grad_clip, accumulate=3)
    assert config["gradient_clipping"] == clipping  # DeepSpeed 0.17+ would clip at 1.0 when left alone
    assert config["zero_optimization"]["stage"] == stage
    assert config["train_micro_batch_size_per_gpu"] == 16
    assert config["gradient_accumulation_steps"] == accumulation
    assert not config["bf16"]["enabled"] and not config["fp16"]["enabled"]  # bf16-mixed is torch's autocast
    assert "optimizer" not in config and "scheduler" not in config  # ortflow's optimizer and schedule
