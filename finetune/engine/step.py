"""One optimizer step's arithmetic: a process's share of a window, its exactly scaled backward, and the step.

These are the functions the loop calls for every window (`finetune.train.loop`), kept apart from the loop so that a test
can run them on a model sharded by torch's `fully_shard`, with no accelerate launcher (tests/test_fsdp.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

from finetune.data.windows import micro_batches
from finetune.engine.losses import loss_sum
from finetune.kinds.base import TaskKind


class Distributed(Protocol):
    """What a window needs from its distribution backend. accelerate's `Accelerator` provides all of it in a run
    (single process, DDP, FSDP); a test passes a thin adapter over torch.distributed to run the same window on a
    model sharded by torch's `fully_shard` without accelerate's launcher."""

    num_processes: int
    device: torch.device
    gradient_accumulation_steps: int
    step: int  # micro-batches into the window, which decides when gradients are synchronised
    scaler: Any  # fp16's GradScaler, or None

    def accumulate(self, model: Any) -> contextlib.AbstractContextManager: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor: ...

    def clip_grad_norm_(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor: ...


def share_of(window: list[int], lengths: list[int], micro_batch_size: int, rank: int, num_processes: int
             ) -> tuple[list[list[int]], float]:
    """This process's micro-batches of a window, and the weight of their losses (1, or 0 for a stand-in)."""
    micro = micro_batches(window, lengths, micro_batch_size, rank, num_processes)
    if not micro:  # a tail window smaller than the number of processes: join the collectives with 0 weight
        return [window[:1]], 0.0
    return micro, 1.0


def backward_window(model: Any, micro: list[list[int]], collate_fn: Callable[[list[int]], dict[str, torch.Tensor]],
                    count: int, dist: Distributed, *, kind: TaskKind, weight: float = 1.0,
                    observe: Callable[[dict[str, torch.Tensor], Any, torch.Tensor], None] | None = None
                    ) -> torch.Tensor:
    """Forward and backward this process's micro-batches of one window, leaving the window's gradient
    `sum(losses) / count` in the parameters; returns this process's loss sum (`count` is over all processes).
    `observe(batch, logits, loss)` sees each micro-batch's output (a metric accumulator's `add`)."""
    # accelerator.backward divides by gradient_accumulation_steps, and both DDP's all-reduce and FSDP's
    # reduce-scatter average over processes: the scale undoes both, so the gradient is exactly sum(losses) / count.
    # Setting the steps per window is what flushes (and correctly normalises) a short last window.
    dist.gradient_accumulation_steps = len(micro)
    dist.step = 0
    scale = weight * len(micro) * dist.num_processes / per_count(count, None, dist.device)
    loss_total = torch.zeros(scale.shape, dtype=torch.float64, device=dist.device)
    for mb in micro:
        with dist.accumulate(model):
            batch = {k: v.to(dist.device) for k, v in collate_fn(mb).items()}
            loss, logits = loss_sum(model, batch, kind)
            dist.backward((loss * scale.to(loss.dtype)).sum())  # several sums: each over its own count
            loss_total += loss.detach().double() * weight
            if observe is not None:
                observe(batch, None if logits is None else logits.detach(), loss.detach())
    return loss_total


def per_count(count: int | tuple[int, ...], like: torch.Tensor | None, device: Any = None) -> torch.Tensor:
    """A window's target count(s) as a divisor (at least 1): a 0-d tensor, or one entry per sum of a kind whose
    `num_targets` counts several (ORPO: chosen tokens, pairs)."""
    device = like.device if like is not None else device
    return torch.as_tensor(count, dtype=torch.float64, device=device).clamp(min=1)


def backward_tasks(model: Any, micro: list[tuple[int, list[int]]],
                   collate_fn: Callable[[int, list[int]], dict[str, torch.Tensor]], counts: list[int],
                   weights: list[float], dist: Distributed, *, kind: TaskKind, task_names: list[str] | None = None,
                   weight: float = 1.0) -> torch.Tensor:
    """`backward_window` for a multi-task window: each micro-batch holds one task and is back-propagated on its own
    (one task's graph in memory at a time), leaving Σₜ wₜ · sum(losses of task t) / Nₜ as the window's gradient,
    with `counts` the Nₜ over all processes. Returns this process's loss sum per task (float64).

    `task_names` given, the model is called with `task=<name>` (one head per task); else all tasks share it."""
    dist.gradient_accumulation_steps = len(micro)
    dist.step = 0
    sums = torch.zeros(len(counts), dtype=torch.float64, device=dist.device)
    for t, mb in micro:
        # The same undoing of accelerate's 1/k and the processes' average as in backward_window, per task.
        scale = weight * weights[t] * len(micro) * dist.num_processes / max(counts[t], 1)
        forward = functools.partial(model, task=task_names[t]) if task_names else model
        with dist.accumulate(model):
            batch = collate_fn(t, mb)
            loss, _ = loss_sum(forward, {k: v.to(dist.device) for k, v in batch.items()}, kind)
            dist.backward(loss * scale)
            sums[t] += loss.detach().double() * weight
    return sums


def optimizer_step(params: list[torch.Tensor], optimizer: Any, scheduler: Any, dist: Distributed,
                   max_grad_norm: float) -> tuple[torch.Tensor, bool]:
    """Clip the window's gradient, step the optimizer and, unless fp16 skipped the step, the schedule; returns the
    gradient norm before clipping and whether the step was skipped."""
    # Once per window, on the summed gradient (sync step). accelerate's clip_grad_norm_ unscales fp16 gradients
    # first and, under FSDP2, takes the norm over every process's shards (DTensor gradients).
    grad_norm = dist.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)  # inf: only measure
    scaler = dist.scaler
    scale_before = scaler.get_scale() if scaler is not None else None
    optimizer.step()
    # An fp16 overflow makes the scaler back off. (accelerate's optimizer_step_was_skipped misses it with fused
    # optimizers, which the scaler always calls and which skip the update in the kernel.)
    skipped = scale_before is not None and scaler.get_scale() < scale_before
    if not skipped and scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped
