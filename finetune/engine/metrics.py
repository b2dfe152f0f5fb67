"""Evaluation: the task kind's metrics, summed exactly over all processes (during training, and for `finetune eval`:
`finetune.use.evaluate`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from finetune.data.load import Encoded, collate
from finetune.engine.losses import loss_sum
from finetune.engine.recurrence import Recurrence, document_loss_sum
from finetune.kinds.base import TaskKind


@torch.inference_mode()
def evaluate(model: Any, data: Encoded, *, kind: TaskKind, label_names: list[str] | None, batch_size: int,
             pad_id: int, accelerator: Any, recurrence: Recurrence | None = None) -> dict[str, float]:
    """The task kind's metrics (accuracy and macro-F1, loss and perplexity, …) over all processes; with
    `recurrence`, documents are read segment by segment as in training."""
    was_training = model.training
    model.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = np.arange(rank, len(data), world)
    mine = mine[np.argsort(-data.lengths[mine], kind="stable")].tolist()  # longest first, as sorted() would
    device = accelerator.device
    metrics = kind.metrics(label_names, device)
    for s in range(0, len(mine), batch_size):
        idx = mine[s: s + batch_size]
        batch = {k: v.to(device) for k, v in collate(data, idx, pad_id, kind).items()}
        if recurrence:
            loss, logits = document_loss_sum(model, batch, recurrence), None
        else:
            loss, logits = loss_sum(model, batch, kind)
        if (generated := kind.generate_batch(model, batch)) is not None:  # scored on what it generates (seq2seq)
            batch = {**batch, "generated_ids": generated}
        metrics.add(batch, logits, loss)
    result = metrics.result(AcrossProcesses(accelerator))
    model.train(was_training)
    return result


class AcrossProcesses:
    """A metric accumulator's reductions over accelerate's processes (`finetune.kinds.base.Reduce`)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor summed over all processes."""
        return self.accelerator.reduce(tensor, "sum")

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's 1-D tensor (of any length), concatenated in process order."""
        a = self.accelerator
        if a.num_processes == 1:
            return tensor
        sizes = a.gather(torch.tensor([len(tensor)], device=tensor.device)).tolist()
        padded = a.pad_across_processes(tensor, dim=0)
        rows = a.gather(padded).view(a.num_processes, -1)
        return torch.cat([rows[i, :n] for i, n in enumerate(sizes)])
