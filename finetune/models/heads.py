"""Classification heads per task on one shared encoder, and how a multi-task model is saved and read back.

Each task is a plain Transformers `…ForSequenceClassification` model sized for its own labels; all of them hold the
*same* encoder module (one set of weights in memory and in the optimizer). Saved, each task is a folder of its own
(`model/<task>/`) that `AutoModelForSequenceClassification.from_pretrained` loads without this package.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from finetune.errors import ModelError

TASKS_FILE = "tasks.json"


class MultiHeadModel(nn.Module):
    """One `…ForSequenceClassification` model per task, all sharing the first one's encoder; `forward(task=…)`
    runs that task's model.

    While training, every other task's head joins the graph with weight zero, so every forward uses every parameter:
    the gradient is unchanged, and DDP (whose default `find_unused_parameters=False` expects each parameter in each
    backward) and FSDP see the same graph whichever task a micro-batch holds."""

    def __init__(self, models: dict[str, nn.Module]) -> None:
        super().__init__()
        # A ModuleDict's keys are attributes: a task named `half` or `train` would shadow the module's own method.
        taken = sorted(name for name in models if hasattr(nn.ModuleDict, name))
        if taken:
            raise ModelError(f"Task name {taken[0]!r} is the name of a torch module method: rename that task "
                             "(for example {taken[0]}_task).")
        self.tasks = nn.ModuleDict(models)
        first = next(iter(models.values()))
        self.body_name = first.base_model_prefix
        self.config = first.config  # what accelerate and the planner look at
        # The encoder is saved once, under the first task; loading puts it back under the others' names (the same
        # tensors), so checkpoints hold no duplicates and load strictly.
        self.register_state_dict_post_hook(self._drop_shared)
        self.register_load_state_dict_pre_hook(self._fill_shared)

    def _shared_prefixes(self, prefix: str) -> tuple[str, list[str]]:
        names = list(self.tasks)
        return (f"{prefix}tasks.{names[0]}.{self.body_name}.",
                [f"{prefix}tasks.{n}.{self.body_name}." for n in names[1:]])

    @staticmethod
    def _drop_shared(module: MultiHeadModel, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for other in module._shared_prefixes(prefix)[1]:
            for key in [k for k in state_dict if k.startswith(other)]:
                del state_dict[key]

    @staticmethod
    def _fill_shared(module: MultiHeadModel, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        first, others = module._shared_prefixes(prefix)
        for key in [k for k in state_dict if k.startswith(first)]:
            for other in others:
                state_dict.setdefault(other + key[len(first):], state_dict[key])

    def heads(self, task: str) -> list[nn.Module]:
        """Task `task`'s own modules: everything of its model but the shared encoder."""
        return [m for name, m in self.tasks[task].named_children() if name != self.body_name]

    def forward(self, task: str, **inputs: Any) -> Any:
        """The task's model output (logits for its own labels)."""
        out = self.tasks[task](**inputs)
        if self.training and torch.is_grad_enabled():
            others = [p.sum() for name in self.tasks if name != task for head in self.heads(name)
                      for p in head.parameters() if p.requires_grad]
            if others:
                out.logits = out.logits + torch.stack(others).sum() * 0.0
        return out


def add_body_lora(model: MultiHeadModel, c: Any) -> Any:
    """LoRA adapters on the shared encoder only (once: it is one module), every task head fully trainable."""
    from peft import LoraConfig, get_peft_model

    first = next(iter(model.tasks))
    prefix = f"tasks.{first}.{model.body_name}."
    wanted = None if c.lora_target_modules == "all-linear" else \
        {t.strip() for t in c.lora_target_modules.split(",") if t.strip()}
    # Full names, so that no head layer is adapted; named_modules() lists the shared encoder once, under `first`.
    targets = [name for name, m in model.named_modules() if name.startswith(prefix) and isinstance(m, nn.Linear)
               and (wanted is None or name.rsplit(".", 1)[-1] in wanted)]
    if not targets:
        raise ModelError(f"No linear layer of the shared encoder matches lora_target_modules="
                         f"{c.lora_target_modules!r}: name some (for example query,value) or use all-linear.")
    peft_model = get_peft_model(model, LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha, lora_dropout=c.lora_dropout,
                                                  target_modules=targets))
    for name in model.tasks:
        for head in model.heads(name):
            head.requires_grad_(True)
    return peft_model


def unwrap_multihead(model: Any) -> Any:
    """The `MultiHeadModel` inside a LoRA wrapper, or `model` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _resize_head(model: nn.Module, body: nn.Module, old: int, names: list[str]) -> None:
    """Give `model`'s head (a copy of another task's) an output layer for `names` and fresh initial weights."""
    body_modules = {id(m) for m in body.modules()}
    for parent in [m for m in model.modules() if id(m) not in body_modules]:
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.out_features == old:
                setattr(parent, child_name, nn.Linear(child.in_features, len(names), bias=child.bias is not None))
    model.config.num_labels = len(names)
    model.config.id2label = dict(enumerate(names))
    model.config.label2id = {n: i for i, n in enumerate(names)}
    for module in model.modules():
        if id(module) not in body_modules and module is not model:
            for p in module.parameters(recurse=False):
                p.requires_grad_(True)
            model._init_weights(module)


def build_multihead(first: nn.Module, label_names: dict[str, list[str]]) -> MultiHeadModel:
    """A `MultiHeadModel` from the first task's loaded model (its head kept), one new head per other task."""
    body = first.base_model
    if body is first:
        raise ModelError(f"{type(first).__name__} has no separate encoder to share between task heads.")
    names = list(label_names)
    models = {names[0]: first}
    for name in names[1:]:
        # deepcopy with the encoder in its memo: the copy's head is new, its encoder is the very same module.
        model = copy.deepcopy(first, memo={id(body): body})
        _resize_head(model, body, first.config.num_labels, label_names[name])
        models[name] = model
    return MultiHeadModel(models)


def save_tasks_file(model_dir: Path, tasks: list[dict[str, Any]], *, shared: bool) -> None:
    """`model/tasks.json`: the tasks, their labels or prompt prefixes, and where each task's model is."""
    layout = "one model, shared by every task (prepend the task's prompt_prefix)" if shared else \
        "one folder per task (model/<task>/), each a full model; every folder holds the same shared encoder"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / TASKS_FILE).write_text(json.dumps({"layout": layout, "tasks": tasks}, indent=2), encoding="utf-8")


def save_multihead(model: MultiHeadModel, tokenizer: Any, run_dir: Path, tasks: list[dict[str, Any]]) -> Path:
    """Save each task's model (shared encoder + its head) to run_dir/model/<task>, plus model/tasks.json."""
    model_dir = run_dir / "model"
    for name, task_model in model.tasks.items():
        task_model.save_pretrained(model_dir / name, safe_serialization=True)
        tokenizer.save_pretrained(model_dir / name)
    save_tasks_file(model_dir, tasks, shared=False)
    return model_dir


def read_tasks_file(model_dir: Path) -> dict[str, Any] | None:
    """The saved `tasks.json` of a multi-task model folder, or None for a one-task model."""
    path = Path(model_dir) / TASKS_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def task_model_dir(model_dir: Path, task: str | None) -> tuple[Path, dict[str, Any] | None]:
    """The folder that holds task `task`'s model, and that task's entry in tasks.json (None for one-task models).
    A multi-task model needs `task`; a one-task model refuses it."""
    saved = read_tasks_file(model_dir)
    if saved is None:
        if task is not None:
            raise ModelError(f"{str(model_dir)!r} holds a one-task model: drop task={task}.")
        return Path(model_dir), None
    names = [t["name"] for t in saved["tasks"]]
    if task is None or task not in names:
        said = "needs" if task is None else f"has no task {task!r}; it needs"
        raise ModelError(f"{str(model_dir)!r} is a multi-task model and {said} task=<name>, one of: "
                         f"{', '.join(names)}.")
    entry = saved["tasks"][names.index(task)]
    folder = Path(model_dir) / task
    return (folder if (folder / "config.json").is_file() else Path(model_dir)), entry
