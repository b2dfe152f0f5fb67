"""Measuring the memory of one training window: live tensor bytes on CPU (a TorchDispatchMode), by part of the
window (`LayerPhases`), and allocator peaks on CUDA (the probe's `measure_window`); the window's worst-case batch and
micro steps, which the dry run (finetune.plan.dryrun) runs on a skeleton of fake tensors.

`tracemalloc` does not see torch's allocations and RSS is too coarse (the allocator keeps freed pages), so on a
CPU the tracker counts the bytes of every tensor storage that torch ops create, and forgets a storage when it is
freed. Storages that existed before tracking began (the weights, say) are not seen: add them yourself.
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from finetune.config.schema import Config
from finetune.engine.losses import loss_sum
from finetune.engine.optim import make_optimizer
from finetune.engine.recurrence import Recurrence, detach_cache, segment_loss_sum
from finetune.kinds.base import TaskKind
from finetune.registry import configured

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the precisions that autocast to half


class LiveTensorTracker(TorchDispatchMode):
    """Current and peak bytes of the tensor storages that torch ops create while the mode is active; with
    `phases`, also the peak within each part of the window that `phases.label` names (`LayerPhases`)."""

    def __init__(self, phases: LayerPhases | None = None) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # storage key -> bytes
        self.phases = phases
        self.by_phase: dict[tuple, int] = {}

    def _forget(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def _track(self, t: torch.Tensor, args: Any, inputs: list[set[int]]) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage._cdata  # the C++ StorageImpl: views of one storage share it
        if key in self._live:
            return
        if not inputs:  # the op's input storages, found only when a result is not a tracked one's view
            inputs.append({i.untyped_storage()._cdata for i in _tensors(args)})
        if key in inputs[0]:  # a view or in-place result: no new memory (weights seen via t())
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        if self.phases is not None:
            label = self.phases.label
            self.by_phase[label] = max(self.by_phase.get(label, 0), self.current)
        weakref.finalize(storage, self._forget, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs: list[set[int]] = []
        for t in _tensors(out):
            self._track(t, (args, kwargs), inputs)
        return out


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's arguments or results (tensors in tuples, lists and dicts), what `tree_flatten` finds
    there: the tracker looks at every op of a dry run, and pytree's generic walk was a sixth of its time."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, list | tuple):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind these tensors."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


class LayerPhases:
    """Which part of a window the dry run is in, for a tracker's peak by part: a micro step's forward or backward,
    below, in the first, a middle or the last, or above the repeated layers.

    A window's peak is the largest of these parts' peaks, and in a stack of identical layers each part's peak is a
    straight line in the number of layers (what is alive there is so many layers' saved tensors or gradients, plus
    the same transients); a middle layer's lies between the first's and the last's. So the parts' peaks measured
    with two and three layers give the window's peak with any number (`scaled`), where the whole window's peak
    alone would not (early in the backward the saved activations of every layer are alive, late in it every
    layer's gradients: which is larger can change with the count)."""

    def __init__(self, layers: list[Any]) -> None:
        self.label: tuple = (0, "forward", "below")
        self.step = 0
        self.handles = []
        for k, layer in enumerate(layers):
            where = "first" if k == 0 else "last" if k == len(layers) - 1 else "middle"
            self.handles.append(layer.register_forward_pre_hook(functools.partial(self._enter, where),
                                                                with_kwargs=True))
            self.handles.append(layer.register_forward_hook(functools.partial(self._leave, where)))

    def begin(self, step: int) -> None:
        """A micro step starts."""
        self.step = step
        self.label = (step, "forward", "below")

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self.handles:
            handle.remove()

    def _backward(self, where: str) -> Callable[[torch.Tensor], None]:
        step = self.step

        def hook(grad: torch.Tensor) -> None:
            self.label = (step, "backward", where)

        return hook

    def _enter(self, where: str, module: Any, args: tuple, kwargs: dict) -> None:
        if torch._C._current_autograd_node() is not None:  # checkpointing's recomputation, inside the backward
            return
        self.label = (self.step, "forward", where)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if where == "first" and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._backward("below"))  # the first layer's backward is done

    def _leave(self, where: str, module: Any, args: tuple, output: Any) -> None:
        if torch._C._current_autograd_node() is not None:
            return
        self.label = (self.step, "forward", "above" if where == "last" else where)
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._backward(where))  # the gradient reached its output: its backward begins


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
    if (own := kind.synthetic_batch(model, micro, device)) is not None:  # inputs that are not tokens (images)
        return own
    micro *= kind.sequences_per_sample  # a preference pair is two sequences
    ids = torch.randint(3, max(getattr(model.config, "vocab_size", 0) or 0, 4), (micro, tokens), device=device)
    labels = kind.synthetic_labels(ids)
    # Inputs a kind joins to its batches besides the tokens (a precomputed reference's log-probabilities).
    extra = kind.synthetic_inputs(ids)
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


def micro_steps(model: Any, next_batch: Callable[[], dict[str, Any]], kind: TaskKind, accum: int, precision: str,
                 device_type: str, phases: LayerPhases | None = None) -> None:
    """The forwards and backwards of a window. Two micro-batches stand for any window of k ≥ 2: from the second
    on, the window's gradients are resident and each micro-batch repeats the same pattern."""
    half = HALF_DTYPES.get(precision)
    for step in range(min(accum, 2)):
        if phases is not None:
            phases.begin(step)
        batch = next_batch()
        with torch.autocast(device_type, dtype=half or torch.float32, enabled=half is not None):
            loss, _ = loss_sum(model, batch, kind)
        loss.sum().backward()  # a kind may return several sums (ORPO's two terms)
        del loss


def forward_only(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """What lm-evaluation-harness does with its batches of requests (its `hf` model's `_model_call`, then the
    log-probabilities it reads the answers from): forwards without gradients, each batch's logits beside their
    log-softmax, while the previous batch's log-probabilities are still held (the harness's loop variable keeps
    them until the next batch's are made). Two batches stand for any number. An encoder-decoder model is given as
    many decoder tokens as encoder tokens (the harness gives it the continuations: this is their worst case)."""
    extra = {"labels": ids} if getattr(model.config, "is_encoder_decoder", False) else {}
    held = None
    with torch.no_grad():
        for _ in range(2):
            held = torch.nn.functional.log_softmax(model(ids, **extra).logits, dim=-1)
    return held


def measure_forward(model: Any, *, micro: int, tokens: int) -> int:
    """Measured peak bytes of one evaluation forward (`forward_only`) of `micro` random requests of `tokens`
    tokens, the weights included: allocator peaks on CUDA, live tensors on a CPU."""
    device = next(model.parameters()).device
    vocab = max(getattr(model.config, "vocab_size", 0) or 0, 4)
    ids = torch.randint(3, vocab, (micro, tokens), device=device)
    was_training = model.training
    model.eval()
    try:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            forward_only(model, ids)
            return int(torch.cuda.max_memory_allocated(device))
        static = tensor_bytes([*model.parameters(), *model.buffers(), ids])
        with LiveTensorTracker() as tracker:
            forward_only(model, ids)
        return static + tracker.peak
    finally:
        model.train(was_training)


def segment_steps(model: Any, ids_of: Callable[[int], torch.Tensor], segment: int, memory: int, steps: int,
                   precision: str, device_type: str) -> int:
    """Segment recurrence's micro steps at their worst: the cache filled with `memory` tokens by earlier segments
    (without a graph, as detached), then `steps` segments forward and backward (two stand for any number, as in
    `micro_steps`). Returns the carried cache's bytes."""
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


def measure_window(model: Any, c: Config, *, micro: int, tokens: int, accum: int, precision: str,
                   memory: int | None = None, padded: bool = False,
                   batch: dict[str, torch.Tensor] | None = None) -> int:
    """Measured peak bytes of one real window (forward, backward, optimizer step) at the worst-case length
    (`padded`: see `synthetic_batch`); with `memory`, of segment recurrence's segments of `tokens` carrying
    `memory` tokens (`accum` micro steps); with `batch`, of that collated micro-batch in every micro step instead
    of the synthetic one (inputs random tokens leave out: a vision-language model's images).

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
            segment_steps(model, lambda n: torch.randint(3, vocab, (micro, n), device=device), tokens, memory,
                           accum, precision, device.type)
        else:
            def next_batch() -> dict[str, Any]:
                if batch is not None:
                    return {k: v.to(device) for k, v in batch.items()}
                return synthetic_batch(model, micro, tokens, kind, device, packed=c.packing, padded=padded)

            micro_steps(model, next_batch, kind, accum, precision, device.type)
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
