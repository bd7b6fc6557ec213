"""The loop, unit-tested with a fake engine: lr schedule, log/eval/checkpoint cadence, non-finite losses, SIGTERM,
resumed counters; and the pieces it relies on (lr_at, ResumableBatches)."""

import math
import os
import signal

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from ortflow.accel.engine import EvalResult
from ortflow.config import OptimConfig, SchedulerConfig, SchedulerName, TrainerConfig
from ortflow.data.resumable import ResumableBatches
from ortflow.errors import OrtflowError
from ortflow.run.signals import Preempted
from ortflow.run.trainer import Feed, Loop, LoopSettings, LoopState
from ortflow.step.scheduler import lr_at


class FakeEngine:
    """Returns scripted losses and records what the loop asked of it."""

    name = "fake"

    def __init__(self, losses: list[float]) -> None:
        self.losses = iter(losses)
        self.lrs: list[float] = []
        self.trained: list[torch.Tensor] = []
        self.evals = 0

    def train_step(self, inputs, targets) -> float:
        self.trained.append(inputs)
        return next(self.losses)

    def eval_step(self, inputs, targets) -> EvalResult:
        self.evals += 1
        return EvalResult(loss_sum=2.0 * len(targets), count=len(targets), sums={"accuracy": len(targets) // 2})

    def set_lr(self, lr: float) -> None:
        self.lrs.append(lr)


class Recorder:
    """A RunLogger stand-in keeping every logged point."""

    def __init__(self) -> None:
        self.points: list[tuple[int, dict]] = []

    def scalars(self, step, values) -> None:
        self.points.append((step, values))

    def advance(self, step, loss, lr) -> None:
        pass

    def steps_with(self, key: str) -> list[int]:
        return [step for step, values in self.points if key in values]


def batches(n: int = 100, batch: int = 4):
    x = torch.arange(n * batch, dtype=torch.float32).reshape(n, batch)
    return iter([(row.unsqueeze(0), torch.zeros(1, dtype=torch.long)) for row in x])


VAL = [(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))] * 5


def trainer(**kw) -> TrainerConfig:
    """The loop's config; the divergence guard off unless asked for (the fake engines' losses are made up)."""
    return OmegaConf.merge(OmegaConf.structured(TrainerConfig), {"divergence_factor": None}, kw)


def run(engine, tr, *, sched=None, state=None, save=None, optim_lr=1.0):
    optim = OmegaConf.merge(OmegaConf.structured(OptimConfig), {"lr": optim_lr})
    sched = sched or OmegaConf.structured(SchedulerConfig)
    logger = Recorder()
    metrics = Loop(engine, Feed(batches(), VAL), LoopSettings(tr, optim, sched), logger).run(state, save=save)
    return metrics, logger


def test_cadence_of_logging_eval_and_checkpoints():
    saved = []
    engine = FakeEngine([float(i) for i in range(1, 11)])
    tr = trainer(max_steps=10, log_every=4, eval_every=5, eval_batches=2, checkpoint={"every": 3})
    metrics, logger = run(engine, tr, save=lambda s: saved.append(s.step) or f"ckpt-{s.step}")
    assert logger.steps_with("train/loss") == [4, 8, 10]
    assert logger.steps_with("eval/loss") == [5, 10]
    assert saved == [3, 6, 9, 10]
    assert engine.evals == 4  # eval_batches=2 at each of the two evaluations
    # train/loss at a log point is the mean of the losses since the previous one
    assert dict(logger.points)[8]["train/loss"] == pytest.approx((5 + 6 + 7 + 8) / 4)
    assert metrics["train/loss"] == pytest.approx((9 + 10) / 2)
    assert metrics["eval/loss"] == 2.0 and metrics["eval/accuracy"] == 0.5 and metrics["steps"] == 10


def test_each_step_gets_the_scheduled_lr():
    engine = FakeEngine([1.0] * 8)
    sched = OmegaConf.structured(SchedulerConfig(name=SchedulerName.cosine, warmup_steps=2, min_lr_ratio=0.1))
    run(engine, trainer(max_steps=8, eval_every=0), sched=sched, optim_lr=0.5)
    assert engine.lrs == [lr_at(step, 0.5, sched, 8) for step in range(8)]


def test_a_nan_loss_stops_the_run_naming_its_step():
    engine = FakeEngine([1.0, 1.0, math.nan, 1.0])
    with pytest.raises(OrtflowError, match="at step 3"):
        run(engine, trainer(max_steps=4))


def test_skipped_nan_steps_are_counted_and_bounded():
    metrics, _ = run(FakeEngine([1.0, math.nan, 2.0, 3.0]), trainer(max_steps=4, on_nonfinite="skip"))
    assert metrics["skipped_steps"] == 1 and metrics["train/loss"] == pytest.approx((1 + 2 + 3) / 3)
    engine = FakeEngine([1.0, math.nan, math.inf, math.nan, 1.0])
    with pytest.raises(OrtflowError, match="max_skipped_steps=2"):
        run(engine, trainer(max_steps=5, on_nonfinite="skip", max_skipped_steps=2))


def test_a_resumed_loop_continues_from_its_state():
    engine = FakeEngine([1.0] * 4)
    state = LoopState(step=6, window_loss=3.0, window_n=2)
    _, logger = run(engine, trainer(max_steps=10, log_every=4, eval_every=0), state=state)
    assert len(engine.trained) == 4 and len(engine.lrs) == 4
    assert logger.steps_with("train/loss") == [8, 10]
    assert dict(logger.points)[8]["train/loss"] == pytest.approx((3.0 + 1.0 + 1.0) / 4)  # carried-over window counts


def test_sigterm_checkpoints_after_the_current_step_and_stops():
    class Signalling(FakeEngine):
        def train_step(self, inputs, targets):
            if len(self.trained) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().train_step(inputs, targets)

    saved = []
    with pytest.raises(Preempted) as stopped:
        run(Signalling([1.0] * 10), trainer(max_steps=10), save=lambda s: saved.append(s.step) or "ckpt")
    assert saved == [3] and stopped.value.step == 3


def test_submitits_sigusr2_checkpoints_first_then_the_scheduler_requeues(monkeypatch):
    """submitit's SIGUSR2 handler requeues the job and exits at once: inside the loop the signal stops the run after
    its step's checkpoint, and the handler gets the preemption only then (hand_over_preemption)."""
    from ortflow.run import signals

    requeued = []

    def submitit_handler(signum, frame):
        requeued.append(signum)

    class Signalling(FakeEngine):
        def train_step(self, inputs, targets):
            if len(self.trained) == 2:
                os.kill(os.getpid(), signal.SIGUSR2)
            return super().train_step(inputs, targets)

    previous = signal.signal(signal.SIGUSR2, submitit_handler)
    try:
        saved = []
        with pytest.raises(Preempted) as stopped:
            run(Signalling([1.0] * 10), trainer(max_steps=10), save=lambda s: saved.append(s.step) or "ckpt")
        assert saved == [3] and stopped.value.step == 3 and requeued == []  # the checkpoint came first
        assert signal.getsignal(signal.SIGUSR2) is submitit_handler
        signals.hand_over_preemption()
        assert requeued == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN  # a late SIGUSR2 cannot requeue the job twice
        signals.hand_over_preemption()  # nothing left to hand over
        assert requeued == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize(
    ("name", "warmup", "expected"),
    [
        ("constant", 0, [1.0, 1.0, 1.0, 1.0]),
        ("constant", 2, [0.5, 1.0, 1.0, 1.0]),
        (
            "cosine",
            0,
            [1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55, 0.1 + 0.9 * (1 - math.cos(math.pi / 4)) / 2],
        ),
    ],
)
def test_lr_at(name, warmup, expected):
    cfg = SchedulerConfig(name=SchedulerName(name), warmup_steps=warmup, min_lr_ratio=0.1)
    assert [lr_at(step, 1.0, cfg, 4) for step in range(4)] == pytest.approx(expected)


def test_cosine_ends_at_min_lr_ratio():
    cfg = SchedulerConfig(name=SchedulerName.cosine, warmup_steps=10, min_lr_ratio=0.2)
    assert lr_at(100, 3.0, cfg, 100) == pytest.approx(0.6)
    assert lr_at(9, 3.0, cfg, 100) == pytest.approx(3.0)  # warmup reaches the peak


def _loader(seed: int) -> DataLoader:
    data = TensorDataset(torch.arange(10), torch.arange(10))
    return DataLoader(data, batch_size=3, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed))


def test_resumable_batches_continue_exactly_across_epochs():
    reference = ResumableBatches(_loader(0))
    expected = [next(reference)[0].tolist() for _ in range(8)]  # 3 batches per epoch: crosses two epoch ends
    first = ResumableBatches(_loader(0))
    taken = [next(first)[0].tolist() for _ in range(4)]
    state = first.state_dict()
    assert (state["epoch"], state["index"]) == (1, 1)
    resumed = ResumableBatches(_loader(123))  # another generator state: restoring must override it
    resumed.load_state_dict(state)
    assert taken + [next(resumed)[0].tolist() for _ in range(4)] == expected
    assert resumed.exact


def test_resumable_batches_refuse_empty_data_and_know_when_they_are_not_exact():
    empty = DataLoader(TensorDataset(torch.arange(2), torch.arange(2)), batch_size=3, drop_last=True)
    with pytest.raises(ValueError, match="no batches"):
        next(ResumableBatches(empty))
    unseeded = DataLoader(TensorDataset(torch.arange(6), torch.arange(6)), batch_size=2, shuffle=True)
    assert not ResumableBatches(unseeded).exact


class MicroEngine(FakeEngine):
    """Also accumulates: records how many micro-batches each optimizer step got."""

    def __init__(self, losses: list[float]) -> None:
        super().__init__(losses)
        self.micro: list[int] = []
        self.last_grad_norm = 0.5

    def train_micro(self, micro) -> float:
        self.micro.append(len(micro))
        self.trained += [inputs for inputs, _ in micro]
        return next(self.losses)


def test_accumulation_draws_n_batches_per_step_and_logs_the_grad_norm():
    engine = MicroEngine([1.0] * 5)
    saved = []
    tr = trainer(max_steps=5, log_every=5, eval_every=0, accumulate_grad_batches=3, checkpoint={"every": 2})
    _, logger = run(engine, tr, save=lambda s: saved.append(s.step) or "ckpt")
    assert engine.micro == [3] * 5 and len(engine.trained) == 15  # 3 micro-batches for each optimizer step
    assert saved == [2, 4, 5]  # checkpoints on optimizer-step boundaries only
    (point,) = [values for step, values in logger.points if "train/loss" in values]
    assert point["train/grad_norm"] == 0.5


def test_accumulation_is_refused_for_an_engine_that_cannot_accumulate():
    with pytest.raises(OrtflowError, match="cannot accumulate gradients"):
        run(FakeEngine([1.0]), trainer(max_steps=1, accumulate_grad_batches=2))


def test_early_stopping_ends_the_run_and_a_resume_does_not_train_further_unless_the_limits_rise():
    rule = {"metric": "eval/loss", "patience": 2}
    tr = trainer(max_steps=10, eval_every=1, early_stopping=rule)
    states = []
    metrics, _ = run(FakeEngine([1.0] * 10), tr, save=lambda s: states.append(s) or "ckpt")
    # eval/loss is 2.0 every time: best at step 1, no improvement at 2 and 3 -> stopped after step 3
    assert metrics["ended_by"] == "early_stopping" and metrics["steps"] == 3
    assert states[-1].stopped_early_at == 3 and metrics["best/step"] == 1
    stopped = LoopState(**{**states[-1].__dict__})
    engine = FakeEngine([1.0] * 10)
    metrics, _ = run(engine, trainer(max_steps=20, eval_every=1, early_stopping=rule), state=stopped)
    assert engine.trained == [] and metrics["steps"] == 3  # raising max_steps alone does not restart it
    engine = FakeEngine([1.0] * 10)
    raised = trainer(max_steps=20, eval_every=1, early_stopping={**rule, "patience": 4})
    metrics, _ = run(engine, raised, state=LoopState(**{**states[-1].__dict__}))
    assert len(engine.trained) == 2 and metrics["steps"] == 5  # two more evaluations without improvement


def test_min_delta_and_max_mode():
    tr = trainer(max_steps=10, eval_every=1, early_stopping={"metric": "eval/accuracy", "mode": "max", "patience": 1})
    metrics, _ = run(FakeEngine([1.0] * 10), tr)
    assert metrics["steps"] == 2  # accuracy stays 0.5: no improvement at step 2
