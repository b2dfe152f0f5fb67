"""Segment recurrence: truncated back-propagation through time over whole documents (`segment_recurrence`).

A micro-batch of documents is processed `max_length` tokens at a time. Each segment is one micro step (forward and
backward of its own loss sum) that attends to the keys/values of up to `memory_length` earlier tokens carried in
transformers' cache, detached so that backward stops at the segment boundary (Transformer-XL). A segment's
positions predict the next token, the last one predicting the first token of the next segment from the cache, so
no target is lost or counted twice at a boundary: a document has the same targets as in one full forward.

Documents are right-padded, and no attention mask is passed: a real token only ever attends to earlier positions,
which are real tokens of its own document, so padding (and the segments a short document spends as padding) never
changes a real token's logits. The cache lives for one micro-batch, so nothing carries over a window boundary.
What transformers 5.24 does that this relies on is checked in tests/test_segment_recurrence.py and written down in
docs/training.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from finetune.config.modelpath import resolve_model_path
from finetune.config.schema import Config
from finetune.data.encoding import IGNORE_INDEX
from finetune.errors import ModelError

# Architectures whose state transformers cannot carry across calls exactly (checked with transformers 5.24).
CANNOT_CARRY = {
    "mamba": "Mamba carries only its convolution state across calls in transformers, not its SSM state",
    "falcon_mamba": "Falcon-Mamba carries only its convolution state across calls in transformers, not its SSM state",
    "rwkv": "RWKV writes its carried state in place, which breaks the backward pass",
    "recurrent_gemma": "RecurrentGemma takes no carried cache, so a segment cannot see the one before",
}
# RoPE variants whose frequencies depend on the longest position seen, which segments see differently.
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
# The self-check's document: three segments of this many tokens, two samples; the largest difference from a full
# forward it accepts, relative to the largest logit (float rounding; architectures that lose state differ by 1e-3+).
CHECK_SEGMENT, CHECK_TOLERANCE = 8, 1e-4


@dataclass(frozen=True)
class Recurrence:
    """Segments of `segment_length` tokens, each attending to at most `memory_length` earlier tokens."""

    segment_length: int
    memory_length: int

    @classmethod
    def of(cls, c: Config) -> Recurrence | None:
        """The run's recurrence, or None when `segment_recurrence` is off."""
        if not c.segment_recurrence:
            return None
        return cls(c.max_length, c.memory_length or c.max_length)

    def num_segments(self, length: int) -> int:
        """Segments (micro steps) a micro-batch whose longest document has `length` tokens takes."""
        return max(1, math.ceil(length / self.segment_length))

    def memory_reached(self, longest: int) -> int:
        """The most tokens the cache holds, before the last segment of the longest document."""
        return min(self.memory_length, self.segment_length * (self.num_segments(longest) - 1))

    def new_cache(self, model: Any) -> Any:
        """A cache for one micro-batch: the model's own layers (Mamba2 state, its own sliding windows), with every
        full-attention layer bounded to the last `memory_length` tokens."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        cache = DynamicCache(config=_model_config(model))
        # Trimming keys by hand would shift the positions the next segment takes from the cache length; the
        # sliding layer keeps `sliding_window - 1` tokens and counts the positions of all of them.
        cache.layers = [DynamicSlidingWindowLayer(sliding_window=self.memory_length + 1) if type(layer) is DynamicLayer
                        else layer for layer in cache.layers]
        return cache

    def segments(self, width: int) -> Iterator[tuple[int, int]]:
        """(start, end) of each segment of a micro-batch `width` tokens wide."""
        for start in range(0, width, self.segment_length):
            yield start, min(start + self.segment_length, width)


def _model_config(model: Any) -> Any:
    unwrapped = getattr(model, "module", model)  # DDP
    return unwrapped.config


def detach_cache(cache: Any) -> None:
    """Cut the carried state from the segment that made it, so backward stops at the boundary. Keys and values are
    copied: the sliding layer keeps a view into the segment's whole concatenated keys, which would stay alive."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and isinstance(layer.keys, torch.Tensor) and layer.keys.numel():
            layer.keys, layer.values = layer.keys.detach().clone(), layer.values.detach().clone()
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            for k, v in (states or {}).items():
                if isinstance(v, torch.Tensor):
                    states[k] = v.detach()


def segment_loss_sum(model: Any, input_ids: torch.Tensor, labels: torch.Tensor, start: int, end: int,
                     cache: Any) -> torch.Tensor:
    """The loss sum of one segment: positions start..end-1 predict tokens start+1..end (the last one the next
    segment's first token), attending to the cache, which the call extends."""
    logits = model(input_ids=input_ids[:, start:end], cache=cache, use_cache=True).logits.float()
    targets = labels[:, start + 1: end + 1]
    targets = F.pad(targets, (0, end - start - targets.size(1)), value=IGNORE_INDEX)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def no_single_token_tail(batch: dict[str, torch.Tensor], recurrence: Recurrence) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's input ids and labels, one padding column wider if the last segment would be one token: a
    one-token call takes Mamba2's decoding path, which writes its state in place and breaks backward. Padding after
    every document changes no result."""
    ids, labels = batch["input_ids"], batch["labels"]
    if ids.size(1) % recurrence.segment_length == 1 and recurrence.segment_length > 1:
        ids, labels = F.pad(ids, (0, 1), value=0), F.pad(labels, (0, 1), value=IGNORE_INDEX)
    return ids, labels


def document_loss_sum(model: Any, batch: dict[str, torch.Tensor], recurrence: Recurrence) -> torch.Tensor:
    """A micro-batch's loss sum segment by segment, without backward (evaluation)."""
    ids, labels = no_single_token_tail(batch, recurrence)
    cache, total = recurrence.new_cache(model), torch.zeros((), dtype=torch.float64, device=ids.device)
    for start, end in recurrence.segments(ids.size(1)):
        total += segment_loss_sum(model, ids, labels, start, end, cache).double()
        detach_cache(cache)
    return total


def micro_steps(micro: list[list[int]], lengths: Any, recurrence: Recurrence) -> int:
    """Micro steps (segments) of this process's share of a window."""
    return sum(recurrence.num_segments(int(np.max(lengths[mb]))) for mb in micro)


def backward_window(model: Any, micro: list[list[int]], collate_fn: Callable[[list[int]], dict[str, torch.Tensor]],
                    count: int, dist: Any, recurrence: Recurrence, lengths: Any, *, weight: float = 1.0
                    ) -> torch.Tensor:
    """`step.backward_window` segment by segment: each segment of each micro-batch is one micro step, its loss sum
    scaled by the window's target count; returns this process's loss sum."""
    # Every segment is a micro step of the window, so accelerate synchronises gradients once, on this process's
    # very last segment; processes whose documents are longer simply take more micro steps before it.
    steps = micro_steps(micro, lengths, recurrence)
    dist.gradient_accumulation_steps = steps
    dist.step = 0
    scale = weight * steps * dist.num_processes / max(count, 1)
    loss_total = torch.zeros((), dtype=torch.float64, device=dist.device)
    for mb in micro:
        ids, labels = no_single_token_tail({k: v.to(dist.device) for k, v in collate_fn(mb).items()}, recurrence)
        cache = recurrence.new_cache(model)  # a fresh state for every micro-batch of documents
        for start, end in recurrence.segments(ids.size(1)):
            with dist.accumulate(model):
                loss = segment_loss_sum(model, ids, labels, start, end, cache)
                dist.backward(loss * scale)
            detach_cache(cache)
            loss_total += loss.detach().double() * weight
    return loss_total


def check_model_config(model_config: Any, longest: int) -> None:
    """A `ModelError` for an architecture or setting with which segments would train silently wrong."""
    kind = getattr(model_config, "model_type", "")
    if kind in CANNOT_CARRY:
        raise ModelError(f"segment_recurrence=true cannot train {kind} models: {CANNOT_CARRY[kind]} (transformers "
                         "5.24); use an attention model with RoPE (Llama, Qwen, Mistral) or Mamba2, or turn "
                         "segment_recurrence off.")
    rope = getattr(model_config, "rope_parameters", None) or {}
    kinds = [rope.get("rope_type")] + [v.get("rope_type") for v in rope.values() if isinstance(v, dict)]
    bad = next((k for k in kinds if k in POSITION_DEPENDENT_ROPE), None)
    if bad:
        raise ModelError(f"segment_recurrence=true cannot train with RoPE scaling {bad!r}: its frequencies depend on "
                         "the longest position seen, which a segment sees differently from the whole document; use "
                         "a model without it or turn segment_recurrence off.")
    limit = absolute_position_limit(model_config)
    if limit is not None and longest > limit:
        raise ModelError(f"segment_recurrence=true needs positions up to {longest}, but this model learned absolute "
                         f"positions only up to {limit}: set max_document_length={limit}, or use a RoPE model.")


def check_run(c: Config, lengths: Any) -> None:
    """Refuse, before any weight is loaded, a model with which segment recurrence would be silently wrong for this
    data (its longest document, or `max_document_length` when the lengths are not known yet)."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(resolve_model_path(c.model), trust_remote_code=c.trust_remote_code)
    limit = absolute_position_limit(model_config)
    if not len(lengths) and c.max_document_length is None and limit is not None:  # a stream: lengths unknown
        raise ModelError(f"segment_recurrence=true with streamed data needs max_document_length (at most {limit}) "
                         "for a model with learned absolute positions: documents of unknown length could pass them.")
    longest = int(np.max(lengths)) if len(lengths) else (c.max_document_length or c.max_length)
    check_model_config(model_config, longest)


def absolute_position_limit(model_config: Any) -> int | None:
    """How many positions a model with learned absolute positions has (GPT-2's `n_positions`); None for RoPE and
    state-space models."""
    if getattr(model_config, "rope_parameters", None) or getattr(model_config, "model_type", "") == "mamba2":
        return None
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(model_config, name, None)
        if isinstance(value, int):
            return value
    return None


@torch.no_grad()
def self_check(model: Any, recurrence: Recurrence) -> None:
    """A `ModelError` unless three segments carried through the cache give the logits of one full forward pass:
    the model must honour the cache and its positions for segment recurrence to be exact."""
    config = _model_config(model)
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, max(getattr(config, "vocab_size", 2), 2), (2, 3 * CHECK_SEGMENT),
                            generator=generator).to(device)
        full = model(input_ids=ids).logits.float()
        check = Recurrence(CHECK_SEGMENT, 3 * CHECK_SEGMENT)
        cache, parts = check.new_cache(model), []
        for start, end in check.segments(ids.size(1)):
            parts.append(model(input_ids=ids[:, start:end], cache=cache, use_cache=True).logits.float())
            detach_cache(cache)
        gap = (torch.cat(parts, dim=1) - full).abs().max().item() / (1 + full.abs().max().item())
    except (TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise ModelError(f"segment_recurrence=true cannot train {config.model_type} models: they do not run segment "
                         f"by segment with a carried cache ({type(e).__name__}: {str(e).splitlines()[0][:120]}).") \
            from None
    finally:
        model.train(was_training)
    if not gap <= CHECK_TOLERANCE:
        raise ModelError(f"segment_recurrence=true cannot train {config.model_type} models: segments carried through "
                         f"the cache differ from a full forward pass by {gap:.2g}, so training would be silently "
                         "wrong; turn segment_recurrence off.")
