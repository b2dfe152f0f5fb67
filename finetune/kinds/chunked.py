"""The causal-LM loss in chunks of positions (`chunked_loss`): the full [tokens × vocabulary] logits never exist.

The model runs as usual but is asked for the logits of its last position only (transformers' `logits_to_keep`), and
a hook on its decoder keeps the final hidden states. The output head (its bias, LoRA on it, a tied embedding) and
the model's logit scaling or soft-capping are then applied to a chunk of positions at a time, each chunk's
cross-entropy summed; `torch.utils.checkpoint` drops the chunk's logits after its forward and recomputes them in the
backward. The sum is the same as the full loss's to float rounding, so the engine's division by the window's target
count (and with it `(B, k) ≡ (k·B, 1)`) is unchanged. At most one chunk's logits and their gradient are alive.

A model whose logits are not its head applied to its last hidden state (as far as the three scalings below tell)
is refused at its first step: the logits it returns for the last position are compared with the chunk's.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

from finetune.errors import ModelError

IGNORE_INDEX = -100
CHUNK_BYTES = 64 * 2**20  # one chunk's float32 logits: 128 positions of a 128 k vocabulary, 2,048 of 8 k
MIN_POSITIONS = 16
COUNTED_CHUNKS = 2  # the planner's dry run computes this many chunks at each end of the loop (`_chunks`)


def chunk_positions(vocab: int) -> int:
    """Positions per chunk: one chunk's float32 logits take about CHUNK_BYTES."""
    return max(MIN_POSITIONS, CHUNK_BYTES // (4 * max(vocab, 1)))


def unwrap(model: Any) -> Any:
    """The transformers model inside the wrappers a run puts around it (a partial, DDP, peft)."""
    while True:
        if isinstance(model, functools.partial):
            model = model.func
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        else:
            return model


def unsupported(model: Any) -> str | None:
    """Why the chunked loss cannot run on `model` (a transformers causal LM, possibly wrapped), or None."""
    base = unwrap(model)
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "logits_to_keep" not in params:
        return f"{type(base).__name__} cannot skip its logits (its forward takes no `logits_to_keep`)"
    if not callable(getattr(base, "get_output_embeddings", None)) or base.get_output_embeddings() is None:
        return f"{type(base).__name__} has no output head to apply chunk by chunk"
    decoder = base.get_decoder() if callable(getattr(base, "get_decoder", None)) else None
    if decoder is None or decoder is base:
        return f"{type(base).__name__} has no separate decoder whose hidden states the head reads"
    return None


def logit_transform(base: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the model does to its head's output before returning it: Cohere's `logit_scale`, Granite's
    `logits_scaling`, Gemma 2/3's `final_logit_softcapping` (applied in the logits' dtype, as the models do)."""
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    scale = getattr(base, "logit_scale", None) if hasattr(config, "logit_scale") else None
    divide = getattr(config, "logits_scaling", None)
    cap = getattr(config, "final_logit_softcapping", None)

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform


def _chunk_loss(head: Any, transform: Callable, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = transform(head(hidden)).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_loss_sum(model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy summed over the targets of (b, s) unshifted `labels`, chunk by chunk."""
    base = unwrap(model)
    reason = unsupported(base)
    if reason:
        raise ModelError(f"chunked_loss=true cannot run: {reason}; set chunked_loss=false.")
    head, transform = base.get_output_embeddings(), logit_transform(base)
    kept: list[torch.Tensor] = []
    autocast: list[tuple[str, bool, torch.dtype]] = []

    def keep(module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        kept.append(hidden)
        # The autocast the model's forward runs under (accelerate wraps the forward in it under mixed precision):
        # the head runs under the same, outside the forward.
        device = hidden.device.type
        autocast.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))

    handle = base.get_decoder().register_forward_hook(keep)
    try:
        last = model(**inputs, logits_to_keep=1).logits
    finally:
        handle.remove()
    hidden = kept[-1]
    device, enabled, dtype = autocast[-1]
    with torch.autocast(device, dtype=dtype, enabled=enabled):
        _check_head(head, transform, hidden, last)
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
        flat = hidden.reshape(-1, hidden.size(-1))
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, t, stand_in in _chunks(flat, targets, chunk_positions(last.size(-1))):
            if stand_in:
                total = total + h[0, 0]
            elif torch.is_grad_enabled():  # the checkpoint's recompute restores this autocast
                total = total + checkpoint(_chunk_loss, head, transform, h, t, use_reentrant=False)
            else:
                total = total + _chunk_loss(head, transform, h, t)
    return total


def _chunks(flat: torch.Tensor, targets: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """The loss's chunks of `size` positions: their hidden states, their targets, and whether the chunk only
    stands in for the chunks between the first and the last COUNTED_CHUNKS, in a dry run (fake tensors, shapes
    only: the planner's) that would otherwise compute every one of a 32 k-token sample's 250.

    Those middle chunks are the same ops on the same shapes, and what each leaves behind is nothing in the forward
    (its loss is a scalar in place of the last one, its input a view of the hidden states) and in the backward its
    input's gradient, which the split keeps until every chunk's is there: so each one's peak is the same transient
    above the gradients of the chunks after it, and the largest is the last computed, a counted chunk at the start
    (the end's are counted too: the shorter last chunk, the head's gradient made and first accumulated). One
    stand-in of all the middle chunks' positions leaves what they leave, their gradients' bytes (one element's
    gradient is a tensor of its input's shape, zeros but that element), without their logits, losses and
    recomputation: the window's peak is what computing every chunk gives, to the byte (tests/test_chunked_loss.py
    compares the two). A real run computes every chunk."""
    chunks = -(-flat.size(0) // size)
    if not (isinstance(flat, FakeTensor) and torch.is_grad_enabled()) or chunks <= 2 * COUNTED_CHUNKS:
        return [(h, t, False) for h, t in zip(flat.split(size), targets.split(size), strict=True)]
    middle = size * (chunks - 2 * COUNTED_CHUNKS)
    sizes = [size] * COUNTED_CHUNKS + [middle] + [size] * (COUNTED_CHUNKS - 1) + [flat.size(0) - size * (chunks - 1)]
    return [(h, t, k == COUNTED_CHUNKS)
            for k, (h, t) in enumerate(zip(flat.split(sizes), targets.split(sizes), strict=True))]


def _check_head(head: Any, transform: Callable, hidden: torch.Tensor, last: torch.Tensor) -> None:
    """The model's own logits of the last position are the head applied to its hidden state (fake tensors of the
    planner's dry run have no values to compare)."""
    if isinstance(hidden, FakeTensor) or isinstance(last, FakeTensor):
        return
    with torch.no_grad():
        ours = transform(head(hidden[:, -1:])).float()
        theirs = last[:, -1:].float()
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3):
            raise ModelError("chunked_loss=true cannot run on this model: its logits are not its output head applied "
                             "to its last hidden state; set chunked_loss=false.")
