"""`finetune eval`: the metrics of a saved model, one path for a run's model, a model folder, and one task of a
multi-task model (`task=<name>`: its own head or prompt prefix, its own data).

The data is the run's own evaluation data (the task's, for a task of a multi-task run), or `dataset=…`, read whole
with the labels the model was trained with. The metrics are the task kind's, computed as training computes them
(`finetune.engine.metrics.evaluate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune import registry
from finetune.config.schema import Config, ConfigError, from_dict, parse_overrides, read_yaml
from finetune.config.tasks import TaskSpec, single_task_values
from finetune.data.encoding import Encoded, encode
from finetune.data.load import load_data, load_table, resolve_columns
from finetune.data.mixing import load_task, with_prefix
from finetune.engine.metrics import evaluate
from finetune.engine.recurrence import Recurrence
from finetune.models.heads import read_tasks_file, task_model_dir
from finetune.models.pretrained import (
    load_model,
    load_tokenizer,
    load_trained,
    resolve_model_dir,
    resolve_model_path,
    saved_label_names,
    task_of,
)
from finetune.registry import configured, entry


@dataclass(frozen=True)
class Target:
    """What is evaluated: a model folder, the config its data is read with, and its labels (and prompt prefix)."""

    folder: Path
    config: Config
    labels: list[str] | None
    task: str | None = None  # the task's name, for a task of a multi-task model
    prefix: str | None = None  # a causal LM task's prompt prefix
    run: Config | None = None  # the multi-task run, when the task's own evaluation data is read
    spec: TaskSpec | None = None


def evaluate_target(target: str, overrides: list[str]) -> dict[str, Any]:
    """Metrics of a run's model (on its own evaluation data), a model folder (on `dataset=…`), or task
    `task=<name>` of a multi-task model."""
    model_dir, run_dir = resolve_model_dir(target)
    extra = parse_overrides(overrides)
    t = _task_target(model_dir, run_dir, extra) if read_tasks_file(model_dir) is not None else \
        _model_target(model_dir, run_dir, extra)
    return measure(t, lambda: load_trained(t.folder, t.config.task), given="dataset" in extra)


def evaluate_base(run_dir: Path, overrides: list[str], *, seed: int | None = None) -> dict[str, Any]:
    """The same metrics of the model a run started from (its config's `model`), on `dataset=…`, with the run's
    labels: a classifier's or a regressor's head is then new, random from `seed` (the run's by default), the
    untrained baseline; an embedding model is the base encoder with its pooling."""
    model_dir = run_dir / "model"
    extra = parse_overrides(overrides)
    values = read_yaml(run_dir / "config.yaml")
    # The base as it is, in full: not the run's adapter, not quantized.
    values.update(extra, resume=False, overwrite=False, lora="false", quantization="none")
    c = from_dict(_whole(values, extra))
    labels = saved_label_names(model_dir) if entry(c.task).has_labels else None

    def load() -> Any:
        torch.manual_seed(c.seed if seed is None else seed)  # the new head's weights
        return load_model(c, labels)

    return measure(Target(Path(resolve_model_path(c.model)), c, labels), load, given=True)


def measure(t: Target, load: Any, *, given: bool) -> dict[str, Any]:
    """The kind's metrics of the model `load()` returns on the target's data (read, and checked, before it loads)."""
    c = t.config
    tokenizer = load_tokenizer(c)
    data = _data(t, tokenizer, given=given)
    from accelerate import Accelerator

    model = load()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = accelerator.prepare(model)
    metrics = evaluate(model, data, kind=configured(c), label_names=t.labels, batch_size=64,
                       pad_id=tokenizer.pad_token_id, accelerator=accelerator, recurrence=Recurrence.of(c))
    if t.task is not None:
        return {"model": str(t.folder), "task": t.task, "samples": len(data), **metrics}
    counts = data.segmentation  # None for whole documents read segment by segment
    split = {"documents": counts.documents, "long_documents": counts.mode} if counts is not None else {}
    return {"model": str(t.folder), "samples": len(data), **split, **metrics}


def _whole(values: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A new dataset is evaluated whole, not split like the training data was."""
    if "dataset" in extra:
        values.update(eval_dataset=None, eval_fraction=0.0, eval_split=extra.get("eval_split"))
    return values


def _model_target(model_dir: Path, run_dir: Path | None, extra: dict[str, Any]) -> Target:
    values = read_yaml(run_dir / "config.yaml") if run_dir else {"task": task_of(model_dir)}
    if run_dir and _takes_reference(values) and not values.get("reference_model") and values.get("model"):
        # The run's reference was its starting model (the default): keep it, or the trained model, which takes
        # `model`'s place below, would be its own reference (a DPO loss of log 2, margins of 0).
        values["reference_model"] = values["model"]
    values.update(extra, model=str(model_dir), resume=False, overwrite=False)
    if "chat_template" not in extra:  # the saved tokenizer carries the run's template; its file may be gone
        values["chat_template"] = None
    c = from_dict(_whole(values, extra))
    if c.dataset is None:
        raise ConfigError(["Nothing to evaluate on: add dataset=<file or hub id>."])
    return Target(model_dir, c, saved_label_names(model_dir) if entry(c.task).has_labels else None)


def _takes_reference(values: dict[str, Any]) -> bool:
    """Whether the run's kind scores against a reference model (it declares `reference_model`)."""
    task = values.get("task")
    return task in registry.names() and any(o.name == "reference_model" for o in entry(task).declares)


def _task_target(model_dir: Path, run_dir: Path | None, extra: dict[str, Any]) -> Target:
    name = extra.pop("task", None)
    folder, saved = task_model_dir(model_dir, name)
    run = spec = None
    if run_dir is not None:
        run = from_dict({**read_yaml(run_dir / "config.yaml"), "resume": False, "overwrite": False})
        spec = next(s for s in run.tasks if s.name == name)
        values = single_task_values(run, spec)
    elif "dataset" not in extra:
        raise ConfigError([f"Nothing to evaluate task {name!r} on: add dataset=<file or hub id>."])
    else:
        values = {"task": task_of(folder)}
    c = from_dict({**_whole(values, extra), **extra, "model": str(folder), "resume": False, "overwrite": False,
                   "output_dir": None})
    return Target(folder, c, saved.get("labels"), task=name, prefix=saved.get("prompt_prefix"), run=run, spec=spec)


def _data(t: Target, tokenizer: Any, *, given: bool) -> Encoded:
    """The evaluation rows: `dataset=…` read whole (behind the task's prompt prefix), or the run's own."""
    c = t.config
    if given:
        table = load_table(c.dataset, c.dataset_config, c.eval_split or c.train_split)
        cols = resolve_columns(c, list(table.column_names))
        if t.prefix:
            table, cols = with_prefix(table, cols, t.prefix)
        return encode(table, cols, c, tokenizer, t.labels, c.dataset)
    if t.task is not None:
        data = load_task(t.run, t.spec, tokenizer).eval
        if data is None:
            raise ConfigError([f"Task {t.task!r} had no evaluation data: add dataset=<file or hub id>."])
        return data
    data = load_data(c, tokenizer)[1]
    if data is None:
        raise ConfigError(["The run had no evaluation data: add dataset=<file or hub id>."])
    return data
