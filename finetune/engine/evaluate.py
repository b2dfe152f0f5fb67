"""Evaluation: metrics summed exactly over all processes, during training and for `finetune eval`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from finetune.config.schema import ConfigError, from_dict, parse_overrides, read_yaml
from finetune.data.load import Encoded, collate, encode, load_data, load_table, resolve_columns
from finetune.engine.losses import loss_sum
from finetune.engine.recurrence import Recurrence, document_loss_sum
from finetune.kinds.base import TaskKind
from finetune.kinds.registry import entry, kind
from finetune.models.load import load_tokenizer, load_trained, resolve_model_dir, saved_label_names, task_of


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
    labels = saved_label_names(model_dir) if entry(cfg.task).has_labels else None
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
    metrics = evaluate(model, eval_data, kind=kind(cfg.task), label_names=labels, batch_size=64,
                       pad_id=tokenizer.pad_token_id, accelerator=accelerator,
                       recurrence=Recurrence.of(cfg))
    counts = eval_data.segmentation  # None for whole documents read segment by segment
    split = {"documents": counts.documents, "long_documents": counts.mode} if counts is not None else {}
    return {"model": str(model_dir), "samples": len(eval_data), **split, **metrics}
