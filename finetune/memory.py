"""Measuring memory: live tensor bytes on CPU (a TorchDispatchMode), allocator peaks on CUDA.

`tracemalloc` does not see torch's allocations and RSS is too coarse (the allocator keeps freed pages), so on a
CPU the tracker counts the bytes of every tensor storage that torch ops create, and forgets a storage when it is
freed. Storages that existed before tracking began (the weights, say) are not seen: add them yourself.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorTracker(TorchDispatchMode):
    """Current and peak bytes of the tensor storages that torch ops create while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # storage key -> bytes

    def _forget(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage._cdata  # the C++ StorageImpl: views of one storage share it
        if key in self._live or key in inputs:  # a view or in-place result: no new memory (weights seen via t())
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._forget, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind these tensors."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())
