"""What a multi-task run adds to the loop's setup, evaluation and saving (the loop itself is `finetune.train.loop`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from finetune.config.schema import Config
from finetune.data.mixing import MultiData, TaskData, task_counts, task_micro_batches
from finetune.engine.metrics import evaluate
from finetune.engine.step import backward_tasks
from finetune.kinds.base import TaskKind
from finetune.models.heads import (
    MultiHeadModel,
    add_body_lora,
    build_multihead,
    save_multihead,
    save_tasks_file,
    unwrap_multihead,
)
from finetune.models.pretrained import load_model, prepare_for_training, save_model
from finetune.plan.planner import Plan, plan_run
from finetune.registry import entry
from finetune.registry import kind as kind_named

# Bytes a trained parameter costs beyond its forward: its gradient and the optimizer's state (fp32).
STATE_BYTES = {"sgd": 8, "adamw": 16, "adamw_8bit": 10}


def plan_tasks(c: Config, data: MultiData, *, num_processes: int, distributed: str) -> Plan:
    """The plan of the largest single task's graph: a micro-batch holds one task and is back-propagated on its
    own, so the activations are one micro-batch's at the longest length of any task, never the sum over tasks."""
    most_labels = max(data.tasks, key=lambda t: len(t.label_names or []))
    # The probe would run one task's model only; the dry run on fake tensors plans for every task's worst case.
    single = most_labels.config.replace(plan_probe="false")
    plan, _ = plan_run(single, data.lengths, most_labels.label_names, num_processes=num_processes, device=None,
                       distributed=distributed)
    shares = ", ".join(f"{name} {share:.1%}" for name, share in data.shares().items())
    note = (f"Multi-task ({len(data.tasks)} tasks, mixing={c.mixing}): planned for the largest single task's graph "
            "(each micro-batch holds one task and is back-propagated on its own), at the longest sample of any task"
            f"; each task's share of a window: {shares}.")
    return dataclasses.replace(plan, notes=(*plan.notes, note))


def with_head_memory(plan: Plan, model: Any, optimizer: str) -> Plan:
    """The plan with the other tasks' heads added: their weights, gradients and optimizer state stay in memory."""
    model = unwrap_multihead(model)
    if not isinstance(model, MultiHeadModel):
        return plan
    names = list(model.tasks)
    params = sum(p.numel() for name in names[1:] for head in model.heads(name) for p in head.parameters())
    extra = params * STATE_BYTES.get(optimizer, 16)
    breakdown = {**plan.breakdown, "other_task_heads": extra}
    return dataclasses.replace(plan, breakdown=breakdown, predicted_peak_bytes=plan.predicted_peak_bytes + extra)


def load_multitask_model(c: Config, tasks: list[TaskData], plan: Plan) -> Any:
    """The shared model: one head per task on one encoder (classification) or one causal LM for every task; with
    LoRA, adapters on the shared body and every head fully trained."""
    shared = entry(c.task).multitask == "shared"
    first = prepare_for_training(load_model(tasks[0].config, tasks[0].label_names), c,
                                 checkpointing=plan.gradient_checkpointing, lora=plan.lora and shared,
                                 offload=plan.activation_offload, tiled=plan.tiled_mlp)
    if shared:
        return first
    kind = kind_named(c.task)
    model = build_multihead(first, {t.spec.name: kind.model_kwargs(t.label_names) for t in tasks})
    return add_body_lora(model, c) if plan.lora else model


def evaluate_tasks(model: Any, data: MultiData, *, kind: TaskKind, batch_size: int, pad_id: int, accelerator: Any
                   ) -> dict[str, float]:
    """Each task's metrics as `<task>/<metric>`, and their mean weighted by the tasks' `weight` as `<metric>`."""
    inner = unwrap_multihead(accelerator.unwrap_model(model))
    out: dict[str, float] = {}
    per_task: list[tuple[float, dict[str, float]]] = []
    for t in data.tasks:
        if t.eval is None or len(t.eval) == 0:
            continue
        view = inner.tasks[t.spec.name] if isinstance(inner, MultiHeadModel) else inner
        was = view.training
        metrics = evaluate(view, t.eval, kind=kind, label_names=t.label_names, batch_size=batch_size,
                           pad_id=pad_id, accelerator=accelerator)
        view.train(was)
        out.update({f"{t.spec.name}/{k}": v for k, v in metrics.items()})
        per_task.append((t.spec.weight, metrics))
    total = sum(w for w, _ in per_task)
    if per_task and total > 0:
        for key in per_task[0][1]:
            out[key] = sum(w * m[key] for w, m in per_task) / total
    return out


def task_summary(data: MultiData) -> list[dict[str, Any]]:
    """The tasks as `tasks.json` records them: name, weight, share of a window, labels or prompt prefix."""
    out = []
    for t, share in zip(data.tasks, data.shares().values(), strict=True):
        entry: dict[str, Any] = {"name": t.spec.name, "weight": t.spec.weight, "share": share}
        if t.label_names is not None:
            entry["labels"] = t.label_names
        if t.spec.prompt_prefix:
            entry["prompt_prefix"] = t.spec.prompt_prefix
        out.append(entry)
    return out


def save_multitask(model: Any, tokenizer: Any, run_dir: Path, data: MultiData) -> Path:
    """The final model: a folder per task (classification) or one shared causal LM, and model/tasks.json."""
    if isinstance(unwrap_multihead(model), MultiHeadModel):
        # LoRA is merged into the shared body first: each task's folder is then a plain Transformers model.
        merged = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
        return save_multihead(merged, tokenizer, run_dir, task_summary(data))
    path = save_model(model, tokenizer, run_dir, merge_lora=True)
    save_tasks_file(path, task_summary(data), shared=True)
    return path


def backward_multitask(model: Any, data: MultiData, window: list[int], micro_batch_size: int, accelerator: Any, *,
                       pad_id: int, kind: TaskKind) -> tuple[torch.Tensor, list[int]]:
    """A multi-task window's gradient: one task per micro-batch, each task's loss normalised by its own count;
    returns this process's loss sum per task and each task's count over the whole window."""
    micro, weight = task_micro_batches(data, window, micro_batch_size, accelerator.process_index,
                                       accelerator.num_processes)
    counts = task_counts(data, window, kind)  # the whole window's: every process knows it before any backward

    def collate_fn(task: int, mb: list[int]) -> dict[str, torch.Tensor]:
        return data.collate(task, mb, pad_id, kind)

    shared = entry(data.config.task).multitask == "shared"  # one model for every task: no head to name
    sums = backward_tasks(model, micro, collate_fn, counts, [t.spec.weight for t in data.tasks], accelerator,
                          kind=kind, task_names=None if shared else data.names, weight=weight)
    return sums, counts


def window_losses(sums: torch.Tensor, counts: list[int], data: MultiData, accelerator: Any
                  ) -> tuple[float, dict[str, float]]:
    """The window loss Σₜ wₜ · (sum of task t's losses) / Nₜ, and each present task's mean loss."""
    total = accelerator.reduce(sums, "sum") if accelerator.num_processes > 1 else sums
    per_task = {t.spec.name: (total[i] / n).item() for i, (t, n) in enumerate(zip(data.tasks, counts, strict=True))
                if n > 0}
    loss = sum(t.spec.weight * per_task[t.spec.name] for t in data.tasks if t.spec.name in per_task)
    return float(loss), per_task
