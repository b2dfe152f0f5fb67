"""Which distributed mode a run reports, and the sentence when it is not what the launcher asked for: detection
from accelerate's state and the variables `accelerate launch` sets, without launching (test_multiprocess.py has the
real `accelerate launch --use_fsdp` on CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from finetune.engine.runtime import distributed_mode, fallback_note, is_sharded, requested_mode


def _accelerator(kind: DistributedType, n: int) -> SimpleNamespace:
    return SimpleNamespace(distributed_type=kind, num_processes=n)


@pytest.mark.parametrize(("kind", "n", "mode"), [
    (DistributedType.NO, 1, "single"), (DistributedType.MULTI_CPU, 2, "ddp"), (DistributedType.MULTI_GPU, 4, "ddp"),
    (DistributedType.FSDP, 2, "fsdp"), (DistributedType.DEEPSPEED, 2, "deepspeed")])
def test_mode_from_accelerate_state(kind, n, mode):
    assert distributed_mode(_accelerator(kind, n)) == mode


def test_fsdp_only_when_the_prepared_model_is_sharded():
    plain = torch.nn.Linear(2, 2)
    assert not is_sharded(plain)
    assert distributed_mode(_accelerator(DistributedType.FSDP, 2), plain) == "ddp"


@pytest.mark.parametrize(("env", "asked"), [
    ({}, None), ({"ACCELERATE_USE_FSDP": "true"}, "fsdp"), ({"ACCELERATE_USE_FSDP": "false"}, None),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "deepspeed"), ({"ACCELERATE_USE_FSDP": "True"}, "fsdp")])
def test_requested_mode_reads_what_accelerate_launch_sets(env, asked):
    assert requested_mode(env) == asked


def test_fallback_note_in_one_sentence():
    assert fallback_note(None, "ddp", 2, "cpu") is None
    assert fallback_note("fsdp", "fsdp", 2, "cuda") is None
    note = fallback_note("fsdp", "ddp", 2, "cpu")
    assert note.startswith("FSDP was asked for, but accelerate ")
    assert note.endswith("this run is plain DDP over 2 CPU processes (every process holds the whole model).")
    assert note.count(". ") == 0
    assert "a single process holding the whole model" in fallback_note("fsdp", "single", 1, "cpu")
