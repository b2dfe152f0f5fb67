"""The training loss, summed exactly so that any split into micro-batches or processes agrees."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from finetune.data.load import IGNORE_INDEX


def loss_sum(model: Any, batch: dict[str, torch.Tensor], causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of per-sample (classification) or per-target-token (causal LM) losses, and the logits.

    The sum, not the mean: the caller divides by the whole window's count, which is what makes accumulation exact.
    """
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    # Packed rows come with position ids and no attention mask. transformers builds the block-diagonal mask from
    # them only without a cache, and a causal LM makes one by default (config.use_cache), even in training.
    extra = {"use_cache": False} if "position_ids" in inputs else {}
    logits = model(**inputs, **extra).logits.float()
    if causal:
        # Position t predicts token t+1. Shift the labels, not the logits: slicing the (b, s, vocab) logits would
        # copy the largest tensor of a small LM's step.
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="sum"), logits
    return F.cross_entropy(logits, labels, reduction="sum"), logits
