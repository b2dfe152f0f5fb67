"""The variants of the training loop, as objects the loop calls: one task, segment recurrence, multi-task.

`finetune.train.loop` reads no feature flag: `variant_of(config)` picks the variant once, and the loop asks it for
the data, the plan and the model, each window's backward and loss, the evaluation and the saved model. A variant
is a small class; the arithmetic it calls lives in the engine (`finetune.engine.step`, `.recurrence`) and in
`finetune.train.multitask`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from finetune.config.batch import samples_of
from finetune.config.schema import Config
from finetune.data.load import collate, load_data
from finetune.data.mixing import MultiData, load_tasks
from finetune.data.packing import check_keeps_samples_apart, packing_note
from finetune.engine.gradcache import cached_backward_window
from finetune.engine.metrics import AcrossProcesses, evaluate
from finetune.engine.recurrence import Recurrence, self_check
from finetune.engine.recurrence import backward_window as recurrent_backward_window
from finetune.engine.step import backward_window, per_count, share_of
from finetune.models.pretrained import save_model
from finetune.plan.planner import Plan, plan_run
from finetune.train.multitask import (
    backward_multitask,
    evaluate_tasks,
    load_multitask_model,
    plan_tasks,
    save_multitask,
    window_losses,
    with_head_memory,
)

# The loop's `finetune.train.loop.Setup` (not imported: the loop imports this module, and only the CLI the loop).
Setup = Any


class Variant(Protocol):
    """What the loop asks of its variant, in the order it asks."""

    def load_data(self, c: Config, tokenizer: Any, num_processes: int) -> tuple[Any, Any, list[str] | None]:
        """Training data, evaluation data (or None) and the class names (or None)."""

    def plan(self, c: Config, train_data: Any, label_names: list[str] | None, accelerator: Any, mode: str
             ) -> tuple[Plan, Any]:
        """The plan and the model it was made for, loaded, prepared and checked."""

    def shares(self, s: Setup) -> dict[str, float] | None:
        """Each task's share of a window, for the start event (None: one task)."""

    def backward(self, s: Setup, window: list[int]) -> tuple[torch.Tensor, Any]:
        """Accumulate one window's gradient: this process's loss sum(s) and the window's global target count(s)."""

    def window_loss(self, s: Setup, loss_sum: torch.Tensor, count: Any) -> tuple[float, dict[str, float] | None]:
        """The window's loss over all processes, and each task's (None: one task)."""

    def step_metrics(self, s: Setup) -> dict[str, float] | None:
        """The kind's step metrics of the last window over all processes (every process calls it: collective), or
        None for a kind without any."""

    def evaluate(self, s: Setup) -> dict[str, float]:
        """The evaluation metrics over all processes ({} when there is nothing to evaluate)."""

    def samples(self, s: Setup) -> list[dict[str, Any]] | None:
        """After an evaluation, a few held-out prompts with what the model generated and its rewards (the kind's
        `sample_completions`: GRPO's), or None; every process calls it."""

    def save(self, s: Setup, model: Any, state_dict: dict[str, Any] | None) -> None:
        """Save the final model (main process only); `state_dict` is gathered from a sharded model."""


def variant_of(c: Config) -> Variant:
    """The loop variant this configuration trains with."""
    if c.tasks:
        return MultiTask()
    recurrence = Recurrence.of(c)
    return Recurrent(recurrence) if recurrence else SingleTask()


def global_count(s: Setup, indices: list[int]) -> int | tuple[int, ...]:
    """The targets of these samples, summed over all processes (a tuple for a kind that counts several: its
    `loss_sum` then returns one sum per count)."""
    local = s.train_data.num_targets(indices, s.kind)
    if s.accelerator.num_processes == 1:
        return local
    total = s.accelerator.reduce(torch.tensor(local, device=s.accelerator.device), "sum")
    return tuple(int(v) for v in total.tolist()) if isinstance(local, tuple) else int(total.item())


def step_metric_names(kind: Any) -> tuple[str, ...]:
    """The kind's step metrics: its configured object's own (GRPO's, one per reward), else its entry's."""
    return kind.step_metrics


@dataclasses.dataclass
class KeptWindow:
    """A generated window that trains again (GRPO's `num_iterations`): its samples, each one's group as the kind
    kept it (with its old log-probabilities) and the optimizer steps it has trained."""

    samples: frozenset[int]
    groups: dict[int, Any]
    trained: int = 1


def steps_per_window(kind: Any) -> int:
    """Optimizer steps each window trains in a row: the kind's `steps_per_window` (GRPO's num_iterations), else 1."""
    return int(kind.steps_per_window)


class SingleTask:
    """One dataset, one model: the plain loop."""

    recurrence: Recurrence | None = None
    _window_metrics: Any = None  # the last window's metric accumulator, for a kind with step metrics
    _kept: KeptWindow | None = None  # a window to train again, as generated (`steps_per_window` > 1)

    def load_data(self, c: Config, tokenizer: Any, num_processes: int) -> tuple[Any, Any, list[str] | None]:
        """The dataset, tokenised (or read as a stream)."""
        return load_data(c, tokenizer, num_processes=num_processes)

    def plan(self, c: Config, train_data: Any, label_names: list[str] | None, accelerator: Any, mode: str
             ) -> tuple[Plan, Any]:
        """The planner's plan and its model; packed rows are checked on the loaded model."""
        plan, model = plan_run(c, train_data.widths, label_names, num_processes=accelerator.num_processes,
                               device=accelerator.device, load=True, distributed=mode)
        if c.packing:
            check_keeps_samples_apart(model, c.model)
            plan = dataclasses.replace(plan, notes=(*plan.notes, packing_note(train_data, c.max_length)))
        return plan, model

    def shares(self, s: Setup) -> None:
        """One task."""
        return None

    def _collate(self, s: Setup) -> Any:
        return lambda mb: collate(s.train_data, mb, s.tokenizer.pad_token_id, s.kind)

    def backward(self, s: Setup, window: list[int]) -> tuple[torch.Tensor, int]:
        """This process's share of the window, each micro-batch's loss sum scaled by the window's target count."""
        accelerator = s.accelerator
        micro, weight = share_of(window, s.train_data.lengths, samples_of(s.batch.micro_batch_size, s.kind),
                                 accelerator.process_index, accelerator.num_processes)
        # Count the window's targets over all processes *before* its first backward: every micro-batch's loss sum
        # is divided by this one number, which is what makes k·B and (B, k) identical.
        count = global_count(s, [i for mb in micro for i in mb] if weight else [])  # a stand-in counts for nothing
        return self._backward(s, micro, count, weight), count

    def _backward(self, s: Setup, micro: list[list[int]], count: int, weight: float) -> torch.Tensor:
        # A fresh accumulator per call: a window retried after an OOM back-off counts once. A stand-in (weight 0)
        # adds nothing but still joins the reduction.
        acc = self._window_metrics = s.kind.metrics(s.label_names, s.accelerator.device) \
            if s.kind.entry.step_metrics else None
        observe = acc.add if acc is not None and weight else None
        if s.kind.entry.whole_window:  # a loss over the whole window (in-batch negatives, GRPO's groups)
            return self._whole_window(s, micro, count, weight, observe)
        return backward_window(s.model, micro, self._collate(s), count, s.accelerator, kind=s.kind, weight=weight,
                               observe=observe)

    def _whole_window(self, s: Setup, micro: list[list[int]], count: int, weight: float, observe: Any
                      ) -> torch.Tensor:
        """The window by gradient caching. A kind that trains each window several steps (GRPO's num_iterations)
        generates it at its first step and keeps its groups, the policy's log-probabilities then as the old ones;
        its later steps collate the kept groups (by sample, so that a back-off's new split takes them too)."""
        steps = steps_per_window(s.kind)
        samples = frozenset(i for mb in micro for i in mb)
        kept = self._kept if self._kept is not None and self._kept.samples == samples else None
        collate, keep, fresh = self._collate(s), None, {}
        if kept is not None:
            def collate(mb: list[int]) -> dict[str, torch.Tensor]:
                return s.kind.join_groups([kept.groups[i] for i in mb], s.tokenizer.pad_token_id)
        elif steps > 1:
            def keep(mb: list[int], batch: dict[str, torch.Tensor], outputs: torch.Tensor) -> None:
                fresh.update(zip(mb, s.kind.keep_groups(batch, outputs), strict=True))
        loss = cached_backward_window(s.model, micro, collate, count, s.accelerator, kind=s.kind, weight=weight,
                                      step=s.progress.step, observe=observe, keep=keep,
                                      micro_rows=s.batch.micro_batch_size)
        # Only once the window has trained (an out-of-memory retry generates or collates it again).
        if kept is not None:
            kept.trained += 1
        elif steps > 1:
            kept = KeptWindow(samples, fresh)
        self._kept = kept if kept is not None and kept.trained < steps else None
        return loss

    def step_metrics(self, s: Setup) -> dict[str, float] | None:
        """The entry's `step_metrics` of the last window's batches, reduced over processes like an evaluation."""
        if self._window_metrics is None:
            return None
        result = self._window_metrics.result(AcrossProcesses(s.accelerator))
        return {k: result[k] for k in step_metric_names(s.kind) if k in result}

    def window_loss(self, s: Setup, loss_sum: torch.Tensor, count: int) -> tuple[float, None]:
        """The summed loss over the window's target count."""
        return (s.accelerator.reduce(loss_sum, "sum") / per_count(count, loss_sum)).sum().item(), None

    def evaluate(self, s: Setup) -> dict[str, float]:
        """The task kind's metrics on the evaluation data."""
        if s.eval_data is None or len(s.eval_data) == 0:
            return {}
        return evaluate(s.model, s.eval_data, kind=s.kind, label_names=s.label_names, batch_size=s.eval_batch_size,
                        pad_id=s.tokenizer.pad_token_id, accelerator=s.accelerator, recurrence=self.recurrence)

    def samples(self, s: Setup) -> list[dict[str, Any]] | None:
        """The kind's sample completions of the first evaluation rows (a kind that generates: GRPO), else None.
        Every process generates the same few (a sharded model's forward is collective)."""
        if s.eval_data is None or len(s.eval_data) == 0:
            return None
        return s.kind.sample_completions(s.model, s.eval_data, s.tokenizer.pad_token_id, s.accelerator.device)

    def save(self, s: Setup, model: Any, state_dict: dict[str, Any] | None) -> None:
        """model/ (and adapter/ with merge_lora)."""
        save_model(model, s.tokenizer, s.run_dir, merge_lora=s.config.merge_lora, state_dict=state_dict)
        # A kind whose folder has files of its own (sentence-transformers') adds them.
        s.kind.save_layout(s.run_dir / "model", model, s.config.max_length)


class Recurrent(SingleTask):
    """Segment recurrence: whole documents, a segment per micro step, the cache carried between them."""

    def __init__(self, recurrence: Recurrence) -> None:
        self.recurrence = recurrence

    def plan(self, c: Config, train_data: Any, label_names: list[str] | None, accelerator: Any, mode: str
             ) -> tuple[Plan, Any]:
        """The plan, and a model checked to carry its state exactly from one segment to the next."""
        plan, model = super().plan(c, train_data, label_names, accelerator, mode)
        self_check(model, self.recurrence)
        return plan, model

    def _backward(self, s: Setup, micro: list[list[int]], count: int, weight: float) -> torch.Tensor:
        return recurrent_backward_window(s.model, micro, self._collate(s), count, s.accelerator, self.recurrence,
                                         s.train_data.lengths, weight=weight)


class MultiTask:
    """Several datasets in one run: one task per micro-batch, each task's loss over its own count."""

    def load_data(self, c: Config, tokenizer: Any, num_processes: int) -> tuple[MultiData, None, None]:
        """Every task's data (each with its own evaluation rows)."""
        return MultiData(c, load_tasks(c, tokenizer)), None, None

    def plan(self, c: Config, train_data: MultiData, label_names: list[str] | None, accelerator: Any, mode: str
             ) -> tuple[Plan, Any]:
        """Planned for the largest single task's graph; the shared model is loaded after the plan."""
        plan = plan_tasks(c, train_data, num_processes=accelerator.num_processes, distributed=mode)
        model = load_multitask_model(c, train_data.tasks, plan)
        return with_head_memory(plan, model, c.optimizer), model

    def shares(self, s: Setup) -> dict[str, float]:
        """Each task's expected share of a window."""
        return s.train_data.shares()

    def backward(self, s: Setup, window: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Per-task loss sums and counts (`finetune.train.multitask.backward_multitask`)."""
        return backward_multitask(s.model, s.train_data, window, s.batch.micro_batch_size, s.accelerator,
                                  pad_id=s.tokenizer.pad_token_id, kind=s.kind)

    def window_loss(self, s: Setup, loss_sum: torch.Tensor, count: list[int]) -> tuple[float, dict[str, float]]:
        """Σₜ wₜ · (task t's loss sum) / Nₜ, and each present task's mean loss."""
        return window_losses(loss_sum, count, s.train_data, s.accelerator)

    def step_metrics(self, s: Setup) -> None:
        """None: a multi-task step reports each task's loss instead."""
        return None

    def evaluate(self, s: Setup) -> dict[str, float]:
        """Each task's metrics as `<task>/<metric>`, and their weighted mean."""
        return evaluate_tasks(s.model, s.train_data, kind=s.kind, batch_size=s.eval_batch_size,
                              pad_id=s.tokenizer.pad_token_id, accelerator=s.accelerator)

    def samples(self, s: Setup) -> None:
        """None: no multi-task kind generates while it trains."""
        return None

    def save(self, s: Setup, model: Any, state_dict: dict[str, Any] | None) -> None:
        """A folder per task (or one shared model) and model/tasks.json."""
        save_multitask(model, s.tokenizer, s.run_dir, s.train_data)
