"""`finetune eval` of one task of a multi-task model (`task=<name>`): its own head or prompt prefix, its data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from finetune.config.multitask import single_task_values
from finetune.config.schema import ConfigError, from_dict, parse_overrides, read_yaml
from finetune.data.encoding import encode
from finetune.data.load import load_table, resolve_columns
from finetune.data.multitask import load_task, with_prefix
from finetune.engine.evaluate import evaluate, evaluate_saved
from finetune.kinds.registry import kind as kind_named
from finetune.models.heads import read_tasks_file, task_model_dir
from finetune.models.load import load_tokenizer, load_trained, resolve_model_dir, task_of


def evaluate_target(target: str, overrides: list[str]) -> dict[str, Any]:
    """`finetune eval`: a multi-task model's task (`task=<name>`), or any other model as `evaluate_saved` does."""
    model_dir, run_dir = resolve_model_dir(target)
    if read_tasks_file(model_dir) is None:
        return evaluate_saved(target, overrides)
    return evaluate_task(model_dir, run_dir, parse_overrides(overrides))


def evaluate_task(model_dir: Path, run_dir: Path | None, extra: dict[str, Any]) -> dict[str, Any]:
    """Metrics of task `extra['task']` of a multi-task model: on the run's evaluation data of that task, or on
    `dataset=…` (read whole, its labels those the task was trained with)."""
    name = extra.pop("task", None)
    folder, entry = task_model_dir(model_dir, name)
    kind = task_of(folder)
    if run_dir is not None:
        run = from_dict({**read_yaml(run_dir / "config.yaml"), "resume": False, "overwrite": False})
        spec = next(t for t in run.tasks if t.name == name)
        values = single_task_values(run, spec)
    elif "dataset" not in extra:
        raise ConfigError([f"Nothing to evaluate task {name!r} on: add dataset=<file or hub id>."])
    else:
        run, spec, values = None, None, {"task": kind}
    if "dataset" in extra:  # a new dataset is evaluated whole, not split like the training data was
        values.update(eval_dataset=None, eval_fraction=0.0, eval_split=extra.get("eval_split"))
    cfg = from_dict({**values, **extra, "model": str(folder), "resume": False, "overwrite": False,
                     "output_dir": None})
    tokenizer = load_tokenizer(cfg)
    labels = entry.get("labels")
    prefix = entry.get("prompt_prefix")
    if "dataset" in extra:
        table = load_table(cfg.dataset, cfg.dataset_config, cfg.eval_split or cfg.train_split)
        cols = resolve_columns(cfg, list(table.column_names))
        if prefix:
            table, cols = with_prefix(table, cols, prefix)
        data = encode(table, cols, cfg, tokenizer, labels, cfg.dataset)
    else:
        data = load_task(run, spec, tokenizer).eval
        if data is None:
            raise ConfigError([f"Task {name!r} had no evaluation data: add dataset=<file or hub id>."])
    from accelerate import Accelerator

    model = load_trained(folder, kind)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = accelerator.prepare(model)
    metrics = evaluate(model, data, kind=kind_named(kind), label_names=labels, batch_size=64,
                       pad_id=tokenizer.pad_token_id, accelerator=accelerator)
    return {"model": str(folder), "task": name, "samples": len(data), **metrics}
