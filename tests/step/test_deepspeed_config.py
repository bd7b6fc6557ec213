"""distributed=deepspeed's settings come from ortflow's, never from DeepSpeed's defaults (ortflow/step/deepspeed.py;
the 2-rank runs are in tests/deepspeed/)."""

import pytest

from ortflow.step.deepspeed import ds_config
from tests.conftest import make_cfg


@pytest.mark.parametrize(
    ("stage", "grad_clip", "clipping"),
    [(2, None, 0.0), (2, 0.5, 0.5), (1, 1.0, 1.0), (0, 0.5, 0.0)],  # stage 0: torch clips, as under DDP
)
def test_deepspeed_gets_ortflows_clipping_and_nothing_of_its_own(stage, grad_clip, clipping):
    cfg = make_cfg("distributed=deepspeed", f"distributed.zero_stage={stage}").distributed
    config = ds_config(cfg, 16, grad_clip)
    assert config["gradient_clipping"] == clipping  # DeepSpeed 0.17+ would clip at 1.0 when left alone
    assert config["zero_optimization"]["stage"] == stage
    assert config["train_micro_batch_size_per_gpu"] == 16 and config["gradient_accumulation_steps"] == 1
    assert not config["bf16"]["enabled"] and not config["fp16"]["enabled"]  # bf16-mixed is torch's autocast
    assert "optimizer" not in config and "scheduler" not in config  # ortflow's optimizer and schedule
