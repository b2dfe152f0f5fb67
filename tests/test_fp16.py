"""fp16 overflow handling: a step with inf/NaN gradients is skipped (weights unchanged, scheduler not advanced,
counted); many in a row end the run. accelerate makes no loss scaler on CPU, so these tests give the loop torch's
CPU GradScaler through accelerate's own scaler hooks; the GPU path (real autocast) is exercised on a GPU only."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from conftest import run_train

from finetune.engine.losses import loss_sum
from finetune.engine.runtime import resolve_precision
from finetune.errors import ConfigError, TrainingError
from finetune.train.loop import MAX_SKIPPED_IN_A_ROW


class CpuFp16Accelerator(Accelerator):
    """An Accelerator whose optimizer steps go through `torch.amp.GradScaler("cpu")` as they do in fp16 on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)

    def prepare(self, *args):
        prepared = super().prepare(*args)  # the AcceleratedOptimizer picks up self.scaler here
        self.native_amp = True  # after prepare: no autocast wrapping of the forward, only the scaler path
        return prepared

    @property
    def mixed_precision(self) -> str:
        return "fp16"


@pytest.fixture
def fp16_cpu(monkeypatch):
    made: list[CpuFp16Accelerator] = []

    def make(precision):
        made.append(CpuFp16Accelerator())
        return made[-1]

    monkeypatch.setattr("finetune.train.loop.make_accelerator", make)
    return made


def _overflow_on(monkeypatch, calls_to_poison):
    """Make the loss infinite on the given micro steps (0-based), and snapshot a weight at each micro step."""
    snapshots = []

    def poisoned(model, batch, kind):
        call = len(snapshots)
        snapshots.append(next(model.parameters()).detach().clone())
        loss, logits = loss_sum(model, batch, kind)
        return (loss * float("inf") if calls_to_poison(call) else loss), logits

    monkeypatch.setattr("finetune.engine.step.loss_sum", poisoned)
    return snapshots


def test_overflow_step_is_skipped_and_scheduler_holds(tmp_path, monkeypatch, fp16_cpu, tiny_bert, cls_csv):
    snapshots = _overflow_on(monkeypatch, lambda call: call == 4)  # first micro-batch of step 2
    _, events, result = run_train(tmp_path / "r", model=tiny_bert, dataset=cls_csv, effective_batch_size=16,
                                  micro_batch_size=4, epochs=1, optimizer="adamw", learning_rate=1e-3,
                                  warmup_ratio=0.0, max_grad_norm=1.0, precision="fp32")
    steps = [e for e in events if e["event"] == "step"]
    assert events[0]["precision"] == "fp16"
    assert [e["skipped"] for e in steps] == [0, 1, 1]
    assert torch.equal(snapshots[8], snapshots[4])  # weights before step 3 == before the skipped step 2
    assert not torch.equal(snapshots[4], snapshots[0])  # step 1 did change them
    assert steps[1]["lr"] == steps[2]["lr"]  # the scheduler did not advance on the skipped step
    assert steps[0]["lr"] > steps[1]["lr"]  # but it does on real steps (linear decay)
    assert fp16_cpu[0].scaler.get_scale() == 2.0**8 * 0.5  # the scaler backed off once
    assert result.metrics["skipped_steps"] == 1


def test_many_overflows_in_a_row_end_the_run(tmp_path, monkeypatch, fp16_cpu, tiny_bert, cls_csv):
    _overflow_on(monkeypatch, lambda call: True)
    with pytest.raises(TrainingError, match=f"overflowed on {MAX_SKIPPED_IN_A_ROW} optimizer steps in a row"):
        run_train(tmp_path / "r", model=tiny_bert, dataset=cls_csv, effective_batch_size=16, micro_batch_size=8,
                  epochs=10)


def test_fp16_without_a_gpu_is_a_clear_config_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="fp16 needs a CUDA GPU"):
        resolve_precision("fp16")
    assert resolve_precision("auto") == "fp32"
