"""Activation offload: with gradient checkpointing, each checkpointed layer's input waits for the backward in CPU
memory instead of on the device, and is copied back for the layer's recomputation (`activation_offload`).

Non-reentrant checkpointing keeps only the inputs of a checkpointed call as saved tensors (torch's
`_NoopSaveInputs`; transformers passes a decoder layer's hidden states positionally and the rest in a closure),
everything inside the layer is recomputed. So saved-tensor hooks around that call (what
`torch.autograd.graph.save_on_cpu` does, and transformers' `offload=True`) move exactly the hidden states: the
residual stream, `layers × micro × tokens × hidden × bytes` of device memory on a long context. Our own hooks, not
`save_on_cpu`, because they also count the bytes that leave the device (the planner's host term, measured by the
same hooks in the dry run) and because pinned memory needs CUDA. It is exact: the same values come back.

On a CUDA device the host copies are pinned and both copies are issued `non_blocking` on the compute stream: the
host does not wait for them, and the caching allocator's stream order keeps the source alive until its copy ran.
In the dry run (fake tensors) the hooks copy nothing: a saved input is dropped from the device and counted as
host bytes, and the copy back is a new device tensor of its shape, alive while its layer recomputes.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

ATTRIBUTE = "_activation_offload"  # where `enable` leaves the model's `Offload` (its byte counts)


class _Packed:
    """A saved tensor while it is away from the device: its host copy (None in the dry run) and how to rebuild it."""

    __slots__ = ("host", "shape", "dtype", "device", "__weakref__")

    def __init__(self, host: torch.Tensor | None, t: torch.Tensor) -> None:
        self.host, self.shape, self.dtype, self.device = host, t.shape, t.dtype, t.device


class Offload:
    """Saved-tensor hooks that keep saved tensors in CPU memory (pinned with `pin_memory`), with the bytes they
    hold there now (`current`) and at most (`peak`)."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.current = 0
        self.peak = 0

    def reset(self) -> None:
        """Start a new peak (the bytes still held stay counted)."""
        self.peak = self.current

    def _release(self, nbytes: int) -> None:
        self.current -= nbytes

    def pack(self, t: torch.Tensor) -> _Packed:
        """Move a saved tensor off the device: a host copy (none for a fake tensor), counted until it is freed."""
        nbytes = t.numel() * t.element_size()
        fake = isinstance(t, FakeTensor) or t.device.type == "meta"
        host = None
        if not fake:
            # Host memory is not the device's: no live-tensor tracker counts it (a CPU measurement then sees
            # what a GPU's allocator would).
            with _disable_current_modes():
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_memory and t.device.type == "cuda")
                host.copy_(t, non_blocking=host.is_pinned())
        packed = _Packed(host, t)
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(packed, self._release, nbytes)
        return packed

    def unpack(self, packed: _Packed) -> torch.Tensor:
        """The saved tensor back on its device, for the recomputation (the dry run: a new tensor of its shape)."""
        if packed.host is None:
            return torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        return packed.host.to(packed.device, non_blocking=packed.host.is_pinned(), copy=True)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Tensors saved for the backward inside this block go to CPU memory."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


def _offloaded(checkpoint: Callable[..., Any], offload: Offload) -> Callable[..., Any]:
    """A checkpointing function whose saved inputs wait in CPU memory."""

    @functools.wraps(checkpoint)
    def call(*args: Any, **kwargs: Any) -> Any:
        with offload.hooks():
            return checkpoint(*args, **kwargs)

    call.offloaded = True  # type: ignore[attr-defined]
    return call


def enable(model: Any, *, pin_memory: bool | None = None) -> Offload:
    """Offload the inputs of `model`'s checkpointed layers (checkpointing must be on); returns the counts.
    `pin_memory` defaults to whether CUDA is available (pinned memory needs it)."""
    offload = Offload(torch.cuda.is_available() if pin_memory is None else pin_memory)
    wrapped = 0
    for module in model.modules():
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if checkpoint is not None and getattr(module, "gradient_checkpointing", False):
            if getattr(checkpoint, "offloaded", False):  # enabled twice: the first one's hooks stay
                checkpoint = checkpoint.__wrapped__
            module._gradient_checkpointing_func = _offloaded(checkpoint, offload)
            wrapped += 1
    if not wrapped:
        raise ValueError("activation offload needs gradient checkpointing on the model's layers")
    setattr(model, ATTRIBUTE, offload)
    return offload


def of(model: Any) -> Offload | None:
    """The model's `Offload`, or None when its activations stay on the device."""
    return getattr(model, ATTRIBUTE, None)
