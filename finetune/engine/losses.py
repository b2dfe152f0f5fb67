"""The training loss, summed exactly so that any split into micro-batches or processes agrees."""

from __future__ import annotations

from typing import Any

import torch

from finetune.kinds.base import TaskKind


def loss_sum(model: Any, batch: dict[str, torch.Tensor], kind: TaskKind) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum of the batch's losses as the task kind defines them (per sample, per target token, …), and the logits.

    The sum, not the mean: the caller divides by the whole window's count, which is what makes accumulation exact.
    """
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    # Packed rows come with position ids and no attention mask. transformers builds the block-diagonal mask from
    # them only without a cache, and a causal LM makes one by default (config.use_cache), even in training.
    if "position_ids" in inputs:
        inputs["use_cache"] = False
    return kind.loss_sum(model, inputs, labels)
