"""Measuring the memory of one training window: live tensor bytes on CPU (a TorchDispatchMode), allocator peaks
on CUDA, and the *dry run* on a model skeleton of fake tensors (the planner's estimate, no weights).

`tracemalloc` does not see torch's allocations and RSS is too coarse (the allocator keeps freed pages), so on a
CPU the tracker counts the bytes of every tensor storage that torch ops create, and forgets a storage when it is
freed. Storages that existed before tracking began (the weights, say) are not seen: add them yourself.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from finetune.config.schema import Config
from finetune.engine.losses import loss_sum
from finetune.engine.optim import make_optimizer
from finetune.engine.recurrence import Recurrence, detach_cache, segment_loss_sum
from finetune.kinds.base import TaskKind
from finetune.kinds.registry import configured
from finetune.kinds.registry import kind as kind_named
from finetune.models import quantize
from finetune.models.pretrained import prepare_for_training, quiet_transformers, resolve_model_path

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the precisions that autocast to half


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


@dataclass(frozen=True)
class Skeleton:
    """The configured model as fake tensors, and the fake mode its dry run must run under (mixing modes fails)."""

    model: Any
    fake_mode: FakeTensorMode


def model_skeleton(c: Config, num_labels: int, *, checkpointing: bool, lora: bool, precision: str = "fp32"
                   ) -> Skeleton:
    """The configured model as fake tensors (shapes, dtypes and a device, no data and no weights read), with
    checkpointing and LoRA as asked; under LoRA with mixed precision the frozen base is in the half dtype, as
    `load_model` stores it (a quantized base is counted from these shapes: `quantize.weight_bytes`)."""
    import transformers
    from transformers import AutoConfig

    quiet_transformers()
    model_config = AutoConfig.from_pretrained(resolve_model_path(c.model), trust_remote_code=c.trust_remote_code)
    kind = kind_named(c.task)
    # The head's size is what the dry run needs (the label names only name its outputs).
    for key, value in kind.model_kwargs([str(i) for i in range(num_labels)]).items():
        setattr(model_config, key, value)
    if getattr(model_config, "pad_token_id", 0) is None:  # as `load_model` sets it: a classifier needs one
        model_config.pad_token_id = getattr(model_config, "eos_token_id", None)
    auto = getattr(transformers, kind.entry.auto_model)
    from transformers.initialization import no_init_weights

    fake = FakeTensorMode()
    # No weight initialisation: the dry run needs shapes, and some initialisers (ViT's truncated normal) read
    # values, which fake tensors have none of.
    with fake, _adapters_stay_where_made(), no_init_weights():
        model = auto.from_config(model_config, trust_remote_code=c.trust_remote_code,
                                 dtype=quantize.base_dtype(precision, lora))
        model = prepare_for_training(model, c, checkpointing=checkpointing, lora=lora)
    return Skeleton(model, fake)


@contextlib.contextmanager
def _adapters_stay_where_made() -> Iterator[None]:
    """Let peft build adapters on fake tensors.

    peft moves new adapter layers to their base layer's device with `Module.to()`, which cannot swap fake tensors
    (under the fake mode they are already made there, in float32), and deep-copies the head it trains, which would
    give the copies a fake mode of their own (mixing modes fails, and collecting the orphans crashed torch 2.13).
    Deep copies of modules get fresh tensors of the same shapes in the active mode instead: the dry run needs
    shapes, not values."""
    real_deepcopy = copy.deepcopy

    def deepcopy(obj: Any, memo: dict | None = None, *args: Any) -> Any:
        if isinstance(obj, torch.nn.Module):
            memo = dict(memo or {})
            for t in [*obj.parameters(), *obj.buffers()]:
                fresh = torch.empty(t.shape, dtype=t.dtype)
                memo[id(t)] = torch.nn.Parameter(fresh, t.requires_grad) if isinstance(t, torch.nn.Parameter) \
                    else fresh
        return real_deepcopy(obj, memo, *args)

    with mock.patch.object(torch.nn.Module, "to", lambda self, *args, **kwargs: self), \
            mock.patch.object(copy, "deepcopy", deepcopy):
        yield


def synthetic_batch(model: Any, micro: int, tokens: int, kind: TaskKind, device: Any = None, packed: bool = False,
                    padded: bool = False) -> dict[str, Any]:
    """A worst-case micro-batch of random token ids: `micro` samples of `tokens` tokens.

    `padded`: the last sample's last token is padding, as in any micro-batch whose samples differ in length; then
    the model builds a 4-D attention mask (B × 1 × L × L, kept for the backward by sdpa), which it skips when every
    token is attended. transformers cannot read a fake mask's values (`is_tracing` is true for fake tensors) and
    always builds it, so an unpadded fake batch has no mask at all: what transformers does with an all-ones one.
    `packed`: rows of two packed samples (position ids restarting, no attention mask), as `packing` trains them;
    more than one sample per row is what makes the model build a full block-diagonal mask. The labels are the
    task kind's (`synthetic_labels`)."""
    if hasattr(kind, "synthetic_batch"):  # a kind whose inputs are not tokens (images of the model's size)
        return kind.synthetic_batch(model, micro, device)
    micro *= getattr(kind, "sequences_per_sample", 1)  # a preference pair is two sequences
    ids = torch.randint(3, max(getattr(model.config, "vocab_size", 0) or 0, 4), (micro, tokens), device=device)
    labels = kind.synthetic_labels(ids)
    # Inputs a kind joins to its batches besides the tokens (a precomputed reference's log-probabilities).
    extra = kind.synthetic_inputs(ids) if hasattr(kind, "synthetic_inputs") else {}
    if packed:
        half = tokens // 2
        positions = torch.cat([torch.arange(half, device=device), torch.arange(tokens - half, device=device)])
        return {"input_ids": ids, "position_ids": positions.expand(micro, -1), "labels": labels, **extra}
    mask = torch.ones_like(ids)
    if padded:
        mask[-1, -1] = 0
    elif isinstance(ids, FakeTensor):
        return {"input_ids": ids, "labels": labels, **extra}
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, **extra}


def _micro_steps(model: Any, next_batch: Callable[[], dict[str, Any]], kind: TaskKind, accum: int, precision: str,
                 device_type: str) -> None:
    """The forwards and backwards of a window. Two micro-batches stand for any window of k ≥ 2: from the second
    on, the window's gradients are resident and each micro-batch repeats the same pattern."""
    half = HALF_DTYPES.get(precision)
    for _ in range(min(accum, 2)):
        batch = next_batch()
        with torch.autocast(device_type, dtype=half or torch.float32, enabled=half is not None):
            loss, _ = loss_sum(model, batch, kind)
        loss.sum().backward()  # a kind may return several sums (ORPO's two terms)
        del loss


def _segment_steps(model: Any, ids_of: Callable[[int], torch.Tensor], segment: int, memory: int, steps: int,
                   precision: str, device_type: str) -> int:
    """Segment recurrence's micro steps at their worst: the cache filled with `memory` tokens by earlier segments
    (without a graph, as detached), then `steps` segments forward and backward (two stand for any number, as in
    `_micro_steps`). Returns the carried cache's bytes."""
    half = HALF_DTYPES.get(precision)
    recurrence = Recurrence(segment, max(memory, 1))
    cache = recurrence.new_cache(model)
    with torch.autocast(device_type, dtype=half or torch.float32, enabled=half is not None):
        with torch.no_grad():
            for start, end in recurrence.segments(memory):
                model(input_ids=ids_of(end - start), cache=cache, use_cache=True)
                detach_cache(cache)
        carried = tensor_bytes(_cache_tensors(cache))
        for _ in range(min(steps, 2)):
            ids = ids_of(segment + 1)
            loss = segment_loss_sum(model, ids, ids, 0, segment, cache)
            loss.backward()
            del loss
            detach_cache(cache)
    return carried


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    tensors = []
    for layer in cache.layers:
        tensors += [getattr(layer, name, None) for name in ("keys", "values")]
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            tensors += list((states or {}).values())
    return [t for t in tensors if isinstance(t, torch.Tensor)]


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
            carried = _segment_steps(model, ids_of, segment, memory, steps, precision, "cpu")
    finally:
        for p in model.parameters():
            p.grad = None
    return tracker.peak, carried


def dry_run(skeleton: Skeleton, kind: TaskKind, micro: int, tokens: int, accum: int, precision: str,
            packed: bool = False, padded: bool = False) -> int:
    """Peak bytes that one window's forward and backward add on top of weights and optimizer state (`padded`: see
    `synthetic_batch`).

    Autocast acts on fake tensors as on real ones, so mixed precision keeps exactly the half- and full-precision
    tensors a real run keeps."""
    model = skeleton.model
    model.train()
    with skeleton.fake_mode:
        batch = synthetic_batch(model, micro, tokens, kind, packed=packed, padded=padded)
    try:
        with skeleton.fake_mode, LiveTensorTracker() as tracker:
            _micro_steps(model, lambda: batch, kind, accum, precision, "cpu")
    finally:
        for p in model.parameters():
            p.grad = None
    return tracker.peak


def measure_window(model: Any, c: Config, *, micro: int, tokens: int, accum: int, precision: str,
                   memory: int | None = None, padded: bool = False) -> int:
    """Measured peak bytes of one real window (forward, backward, optimizer step) at the worst-case length
    (`padded`: see `synthetic_batch`); with `memory`, of segment recurrence's segments of `tokens` carrying
    `memory` tokens (`accum` micro steps).

    The weights do not change (the probe's own optimizer runs at learning rate 0 and is thrown away) and the
    random state is restored, so training afterwards is exactly what it would have been."""
    kind = configured(c)
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    rng = torch.get_rng_state(), (torch.cuda.get_rng_state_all() if cuda else None)
    optimizer = make_optimizer(c.replace(learning_rate=0.0), model)

    def window() -> None:
        if memory is not None:
            vocab = max(getattr(model.config, "vocab_size", 0) or 0, 4)
            _segment_steps(model, lambda n: torch.randint(3, vocab, (micro, n), device=device), tokens, memory,
                           accum, precision, device.type)
        else:
            def batch() -> dict[str, Any]:
                return synthetic_batch(model, micro, tokens, kind, device, packed=c.packing, padded=padded)

            _micro_steps(model, batch, kind, accum, precision, device.type)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    was_training = model.training
    model.train()
    try:
        window()  # the first window creates the optimizer state, as training's first step does
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            window()
            return int(torch.cuda.max_memory_allocated(device))
        static = tensor_bytes(list(model.parameters()) + [v for st in optimizer.state.values()
                                                          for v in st.values() if torch.is_tensor(v)])
        with LiveTensorTracker() as tracker:
            window()
        return static + tracker.peak
    finally:
        model.train(was_training)
        torch.set_rng_state(rng[0])
        if cuda:
            torch.cuda.set_rng_state_all(rng[1])
            torch.cuda.empty_cache()
