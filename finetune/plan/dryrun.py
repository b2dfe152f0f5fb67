"""The *dry run*: one training window's forward and backward on a model skeleton of fake tensors under the
live-tensor tracker (the planner's estimate of a window's peak, no weights read); and an evaluation's forward
without gradients (`dry_run_forward`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from finetune.kinds.base import TaskKind
from finetune.plan.memory import (
    LayerPhases,
    LiveTensorTracker,
    forward_only,
    micro_steps,
    segment_steps,
    synthetic_batch,
)
from finetune.plan.skeleton import SCALED_FROM, Skeleton, repeated_layers, scaled


def dry_run_segments(skeleton: Skeleton, micro: int, segment: int, memory: int, steps: int, precision: str
                     ) -> tuple[int, int]:
    """`dry_run` for segment recurrence: peak bytes of a window's segments at full memory, and the carried cache's
    bytes (part of that peak)."""
    model = skeleton.model
    model.train()
    vocab = max(getattr(model.config, "vocab_size", 0) or 0, 4)

    def ids_of(n: int) -> torch.Tensor:
        with skeleton.fake_mode:
            return torch.randint(3, vocab, (micro, n))

    try:
        with skeleton.fake_mode, LiveTensorTracker() as tracker:
            carried = segment_steps(model, ids_of, segment, memory, steps, precision, "cpu")
    finally:
        for p in model.parameters():
            p.grad = None
    return tracker.peak, carried


def dry_run(skeleton: Skeleton, kind: TaskKind, micro: int, tokens: int, accum: int, precision: str,
            packed: bool = False, padded: bool = False, cuda: bool = False) -> int:
    """Peak bytes that one window's forward and backward add on top of weights and optimizer state (`padded`: see
    `synthetic_batch`); for a deep model, scaled from its window's parts with two and three layers (`Skeleton`).
    `cuda`: the window of a CUDA run, whose attention kernels differ from the CPU's (`attention_as_on_cuda`).

    Autocast acts on fake tensors as on real ones, so mixed precision keeps exactly the half- and full-precision
    tensors a real run keeps."""
    with attention_as_on_cuda() if cuda else contextlib.nullcontext():
        if skeleton.wider is None:
            return _window(skeleton.model, skeleton.fake_mode, kind, micro, tokens, accum, precision, packed,
                           padded)[0]
        small, wider = (_window(m, skeleton.fake_mode, kind, micro, tokens, accum, precision, packed, padded,
                                True)[1] for m in skeleton.models)
    parts = {label for label in small if label[2] != "middle"}  # a middle layer's peak lies between its neighbours'
    if parts != {label for label in wider if label[2] != "middle"}:
        raise RuntimeError(f"the dry run's parts differ between {SCALED_FROM} and {SCALED_FROM + 1} layers")
    return max(scaled(small[label], wider[label], skeleton.layers) for label in parts)


@contextlib.contextmanager
def attention_as_on_cuda() -> Iterator[None]:
    """Attention in the dry run as a CUDA GPU computes it: `scaled_dot_product_attention` without its dropout.

    The dry run's fake tensors are on the CPU, whose fused (flash) sdpa kernel does no dropout: with attention
    dropout (GPT-2's `attn_pdrop`, BERT's `attention_probs_dropout_prob`, 0.1 by default) torch falls back to the
    math kernel there, which builds and keeps the (tokens × tokens) scores of every head and their dropout mask. On
    a CUDA GPU the flash and memory-efficient kernels apply the dropout inside the kernel from a random seed and
    keep only the output and its log-sum-exp, what the CPU's fused kernel keeps without dropout. Without dropout
    (Llama, Qwen, Mistral) nothing changes. A mask that padding makes is built and kept either way."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
              dropout_p: float = 0.0, *args: Any, **kwargs: Any) -> torch.Tensor:
        return sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", fused):
        yield


@contextlib.contextmanager
def _one_sequence_per_row() -> Iterator[None]:
    """Let transformers see that an unpacked fake batch holds one sequence per row, as it sees in a real one.

    transformers looks for packed sequences in the position ids and, when it cannot read their values (fake tensors
    are "tracing" to it), assumes there may be some: it then builds the (tokens × tokens) causal mask that a real
    unpadded batch skips (sdpa's `is_causal`), 2 GiB of booleans and a 4 GiB bf16 copy at 46 k tokens, which a real
    run never holds. The dry run's unpacked batches have none (`synthetic_batch`), so the answer is "none"."""
    from transformers import masking_utils

    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


def _window(model: Any, fake_mode: FakeTensorMode, kind: TaskKind, micro: int, tokens: int, accum: int,
            precision: str, packed: bool, padded: bool, by_phase: bool = False) -> tuple[int, dict[tuple, int]]:
    """One fake model's window: its peak, and (`by_phase`) the peak of each of its parts (`LayerPhases`)."""
    model.train()
    with fake_mode:
        batch = synthetic_batch(model, micro, tokens, kind, packed=packed, padded=padded)
    phases = LayerPhases(repeated_layers(model) or []) if by_phase else None
    try:
        with fake_mode, LiveTensorTracker(phases) as tracker, \
                contextlib.nullcontext() if packed else _one_sequence_per_row():
            micro_steps(model, lambda: batch, kind, accum, precision, "cpu", phases)
    finally:
        if phases is not None:
            phases.remove()
        for p in model.parameters():
            p.grad = None
    return tracker.peak, tracker.by_phase


def dry_run_forward(skeleton: Skeleton, micro: int, tokens: int) -> int:
    """Peak bytes that one evaluation forward adds on top of the weights: lm-evaluation-harness's call of a batch
    of `micro` requests of `tokens` tokens, without gradients (`forward_only`); for a deep model, scaled from its
    parts with two and three layers, as `dry_run` is."""
    if skeleton.wider is None:
        return _forward(skeleton.model, skeleton.fake_mode, micro, tokens)[0]
    small, wider = (_forward(m, skeleton.fake_mode, micro, tokens, True)[1] for m in skeleton.models)
    parts = {label for label in small if label[2] != "middle"}
    if parts != {label for label in wider if label[2] != "middle"}:
        raise RuntimeError(f"the forward's parts differ between {SCALED_FROM} and {SCALED_FROM + 1} layers")
    return max(scaled(small[label], wider[label], skeleton.layers) for label in parts)


def _forward(model: Any, fake_mode: FakeTensorMode, micro: int, tokens: int, by_phase: bool = False
             ) -> tuple[int, dict[tuple, int]]:
    """One fake model's evaluation forward: its peak, and (`by_phase`) the peak of each of its parts."""
    model.eval()
    vocab = max(getattr(model.config, "vocab_size", 0) or 0, 4)
    with fake_mode:
        ids = torch.randint(3, vocab, (micro, tokens))
    phases = LayerPhases(repeated_layers(model) or []) if by_phase else None
    try:
        with fake_mode, LiveTensorTracker(phases) as tracker, _one_sequence_per_row():
            forward_only(model, ids)
    finally:
        if phases is not None:
            phases.remove()
    return tracker.peak, tracker.by_phase
