"""A window whose loss couples its samples (in-batch negatives), back-propagated exactly by gradient caching.

With in-batch negatives, k micro-batches of B are not one batch of k·B unless every anchor sees the whole window's
positives. So the window is embedded first, micro-batch by micro-batch, without a graph; every process gathers every
process's embeddings and computes the loss over the *global* window (the same numbers everywhere) and its gradient
with respect to the embeddings; then each micro-batch is embedded again, with a graph and the random state it had the
first time (so dropout draws the same masks), and back-propagates its slice of that gradient (`embeddings · grad`).
The gradient left in the parameters is that of the window's loss over its target count, whatever the split into
micro-batches and processes (Gao et al., "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup",
2021; sentence-transformers' CachedMultipleNegativesRankingLoss).

The kind provides `embed(model, inputs)` (a micro-batch's outputs, one row per sequence), `window_loss_sum(samples,
labels)` (the loss of a whole window of samples, as a sum its target count divides) and `as_samples`/`as_rows`
(a micro-batch's rows as samples (B, g, d), and back). A kind whose samples are made before they are scored has
`prepare_batch(model, batch, step=…)` too (GRPO: a micro-batch of prompts → its generated groups, their rewards in
the labels), called once per micro-batch before its outputs are cached; the replay reuses the prepared batch, and
`step` (the optimizer step) lets the kind seed what it draws so that it does not depend on the split. A batch it
prepared already (a window trained again: GRPO's `num_iterations`, whose caller collates kept groups) it returns as
it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from finetune.engine.step import Distributed, per_count
from finetune.kinds.base import TaskKind


class RandomState:
    """The random state of the CPU and of a CUDA device at one moment, to run a forward again with it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Inside: the random state as it was captured; after: as it was before (the replay draws nothing)."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def gather_rows(local: torch.Tensor, dist: Distributed) -> tuple[torch.Tensor, int]:
    """Every process's rows (dim 0) in process order, on every process, and where this process's rows start. Summed
    into zeros (adding zeros is exact), so any backend that reduces (accelerate, a thin torch.distributed adapter)
    gathers tensors of uneven lengths."""
    if dist.num_processes == 1:
        return local, 0
    rank = int(getattr(dist, "process_index", 0))
    sizes = torch.zeros(dist.num_processes, dtype=torch.long, device=local.device)
    sizes[rank] = len(local)
    sizes = dist.reduce(sizes, "sum")
    start = int(sizes[:rank].sum())
    full = torch.zeros((int(sizes.sum()), *local.shape[1:]), dtype=local.dtype, device=local.device)
    full[start: start + len(local)] = local
    return dist.reduce(full, "sum"), start


def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "labels"}


def cached_backward_window(model: Any, micro: list[list[int]],
                           collate_fn: Callable[[list[int]], dict[str, torch.Tensor]], count: int,
                           dist: Distributed, *, kind: TaskKind, weight: float = 1.0, step: int = 0,
                           observe: Callable[[dict[str, torch.Tensor], Any, torch.Tensor | None], None] | None = None,
                           keep: Callable[[list[int], dict[str, torch.Tensor], torch.Tensor], None] | None = None,
                           micro_rows: int = 0) -> torch.Tensor:
    """Forward and backward this process's micro-batches of one window by gradient caching, leaving the gradient of
    the global window's `window_loss_sum / count` in the parameters; returns this process's share of that loss sum
    (its samples' part, so that the sum over processes is the window's). A stand-in (`weight` 0) joins every
    collective with no samples of its own. `observe(batch, outputs, None)` sees each micro-batch's cached outputs
    (a metric accumulator's `add`); `keep(indices, batch, outputs)` sees each prepared micro-batch with its outputs
    without a graph (GRPO keeps a window it trains again, those outputs its old log-probabilities).

    `micro` lists the batches the kind prepares (GRPO's generation batches of whole groups); each prepared batch is
    forwarded in the kind's `micro_pieces` of `micro_rows` rows (GRPO's micro-batches of completions, which may hold
    part of a group), each piece a backward of its own."""
    dist.step = 0
    batches, pieces, samples = [], [], []  # pieces: (inputs, random state, rows) of each forward, in order
    # 1. The window's embeddings, without a graph; each piece's random state kept for its replay. Through the
    # prepared model (its autocast) with no gradient: the numbers the replay's forward makes again.
    with torch.no_grad():
        for mb in micro:
            batch = {k: v.to(dist.device) for k, v in collate_fn(mb).items()}
            batch = kind.prepare_batch(model, batch, step=step)  # samples made before they are scored (GRPO's groups)
            parts = []
            for inputs in kind.micro_pieces(_inputs(batch), micro_rows):
                state = RandomState(dist.device)
                parts.append(kind.embed(model, inputs).float())
                pieces.append((inputs, state, len(parts[-1])))
            outputs = torch.cat(parts)
            samples.append(kind.as_samples(outputs, len(batch["labels"])))
            batches.append(batch)
            if keep is not None:
                keep(mb, batch, outputs)
            if observe is not None and weight:
                observe(batch, outputs, None)
    mine = torch.cat(samples) if weight else samples[0][:0]
    labels = torch.cat([b["labels"] for b in batches]) if weight else batches[0]["labels"][:0]
    # 2. The loss over the global window, on every process, and its gradient with respect to the embeddings.
    window, start = gather_rows(mine, dist)
    window_labels, _ = gather_rows(labels.double() if labels.is_floating_point() else labels, dist)
    window.requires_grad_(True)
    with torch.enable_grad():
        total = kind.window_loss_sum(window, window_labels.to(labels.dtype))
        (grad,) = torch.autograd.grad(total / per_count(count, total), window)
    grad = grad[start: start + len(mine)]
    # 3. Each piece again, with a graph, back-propagating its slice. accelerate's backward divides by the pieces
    # (the window's backward calls) and DDP averages over processes: the factor undoes both, as in `backward_window`.
    dist.gradient_accumulation_steps = len(pieces)
    factor = weight * len(pieces) * dist.num_processes
    row_grads = []
    offset = 0
    for cached in samples:
        size = len(cached) if weight else 0
        row_grads.append(kind.as_rows(grad[offset: offset + size]) if size else None)
        offset += size
    row_grad = torch.cat(row_grads) if weight else None
    offset = 0
    for inputs, state, size in pieces:
        with dist.accumulate(model):
            with state.replayed():
                rows = kind.embed(model, inputs).float()
            slice_grad = row_grad[offset: offset + size] if row_grad is not None else torch.zeros_like(rows)
            dist.backward((rows * slice_grad).sum() * factor)
        offset += size
    share = len(mine) / max(len(window), 1)
    return (total.detach().double() * share).reshape(())
