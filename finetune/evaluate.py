"""Losses and evaluation metrics, summed exactly so that any split into micro-batches or processes agrees."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from finetune.data import IGNORE_INDEX, Encoded, collate


def loss_sum(model: Any, batch: dict[str, torch.Tensor], causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of per-sample (classification) or per-target-token (causal LM) losses, and the logits.

    The sum, not the mean: the caller divides by the whole window's count, which is what makes accumulation exact.
    """
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits.float()
    if causal:
        # Position t predicts token t+1. Shift the labels, not the logits: slicing the (b, s, vocab) logits would
        # copy the largest tensor of a small LM's step.
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="sum"), logits
    return F.cross_entropy(logits, labels, reduction="sum"), logits


@torch.inference_mode()
def evaluate(model: Any, data: Encoded, *, causal: bool, num_labels: int, batch_size: int, pad_id: int,
             accelerator: Any) -> dict[str, float]:
    """Accuracy and macro-F1 (classification) or loss and perplexity (causal LM) over all processes."""
    was_training = model.training
    model.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = sorted(range(rank, len(data), world), key=lambda i: -len(data.input_ids[i]))
    device = accelerator.device
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, count
    confusion = torch.zeros((num_labels, num_labels), dtype=torch.float64, device=device)
    for s in range(0, len(mine), batch_size):
        idx = mine[s: s + batch_size]
        batch = {k: v.to(device) for k, v in collate(data, idx, pad_id, causal).items()}
        loss, logits = loss_sum(model, batch, causal)
        total[0] += loss.double()
        if causal:
            total[1] += (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        else:
            total[1] += len(idx)
            flat = batch["labels"] * num_labels + logits.argmax(-1)
            confusion += torch.bincount(flat, minlength=num_labels * num_labels).view(num_labels, -1).double()
    total = accelerator.reduce(total, "sum")
    model.train(was_training)
    loss = (total[0] / total[1].clamp(min=1)).item()
    if causal:
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
    confusion = accelerator.reduce(confusion, "sum")
    return {"loss": loss, **classification_metrics(confusion)}


def classification_metrics(confusion: torch.Tensor) -> dict[str, float]:
    """Accuracy and macro-F1 from a confusion matrix (rows: true class, columns: predicted)."""
    tp = confusion.diag()
    accuracy = (tp.sum() / confusion.sum().clamp(min=1)).item()
    precision = tp / confusion.sum(0).clamp(min=1)
    recall = tp / confusion.sum(1).clamp(min=1)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall), torch.zeros_like(tp))
    present = (confusion.sum(1) + confusion.sum(0)) > 0  # classes absent from truth and predictions don't count
    return {"accuracy": accuracy, "macro_f1": f1[present].mean().item() if present.any() else 0.0}
