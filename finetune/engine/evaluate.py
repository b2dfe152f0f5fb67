"""Evaluation: metrics summed exactly over all processes, during training and for `finetune eval`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from finetune.config.schema import ConfigError, from_dict, parse_overrides, read_yaml
from finetune.data.load import IGNORE_INDEX, Encoded, collate, encode, load_data, load_table, resolve_columns
from finetune.engine.losses import loss_sum
from finetune.engine.recurrence import Recurrence, document_loss_sum
from finetune.models.load import load_tokenizer, load_trained, resolve_model_dir, saved_label_names, task_of


@torch.inference_mode()
def evaluate(model: Any, data: Encoded, *, causal: bool, num_labels: int, batch_size: int, pad_id: int,
             accelerator: Any, recurrence: Recurrence | None = None) -> dict[str, float]:
    """Accuracy and macro-F1 (classification) or loss and perplexity (causal LM) over all processes; with
    `recurrence`, documents are read segment by segment as in training."""
    was_training = model.training
    model.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = np.arange(rank, len(data), world)
    mine = mine[np.argsort(-data.lengths[mine], kind="stable")].tolist()  # longest first, as sorted() would
    device = accelerator.device
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, count
    confusion = torch.zeros((num_labels, num_labels), dtype=torch.float64, device=device)
    for s in range(0, len(mine), batch_size):
        idx = mine[s: s + batch_size]
        batch = {k: v.to(device) for k, v in collate(data, idx, pad_id, causal).items()}
        if recurrence:
            loss = document_loss_sum(model, batch, recurrence)
        else:
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


def evaluate_saved(target: str, overrides: list[str]) -> dict[str, Any]:
    """`finetune eval`: metrics of a run's model (on its own evaluation data) or a model folder (on `dataset=…`)."""
    from accelerate import Accelerator

    model_dir, run_dir = resolve_model_dir(target)
    extra = parse_overrides(overrides)
    values = read_yaml(run_dir / "config.yaml") if run_dir else {"task": task_of(model_dir)}
    values.update(extra, model=str(model_dir), resume=False, overwrite=False)
    if "chat_template" not in extra:  # the saved tokenizer carries the run's template; its file may be gone
        values["chat_template"] = None
    if "dataset" in extra:  # a new dataset is evaluated whole, not split like the training data was
        values.update(eval_dataset=None, eval_fraction=0.0, eval_split=extra.get("eval_split"))
    cfg = from_dict(values)
    if cfg.dataset is None:
        raise ConfigError(["Nothing to evaluate on: add dataset=<file or hub id>."])
    tokenizer = load_tokenizer(cfg)
    labels = saved_label_names(model_dir) if cfg.task == "classification" else None
    if "dataset" in extra:
        table = load_table(cfg.dataset, cfg.dataset_config, cfg.eval_split or cfg.train_split)
        cols = resolve_columns(cfg, list(table.column_names))
        eval_data = encode(table, cols, cfg, tokenizer, labels, cfg.dataset)
    else:
        eval_data = load_data(cfg, tokenizer)[1]
        if eval_data is None:
            raise ConfigError(["The run had no evaluation data: add dataset=<file or hub id>."])
    model = load_trained(model_dir, cfg.task)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = accelerator.prepare(model)
    metrics = evaluate(model, eval_data, causal=cfg.task == "causal_lm", num_labels=len(labels or []),
                       batch_size=64, pad_id=tokenizer.pad_token_id, accelerator=accelerator,
                       recurrence=Recurrence.of(cfg))
    counts = eval_data.segmentation  # None for whole documents read segment by segment
    split = {"documents": counts.documents, "long_documents": counts.mode} if counts is not None else {}
    return {"model": str(model_dir), "samples": len(eval_data), **split, **metrics}
