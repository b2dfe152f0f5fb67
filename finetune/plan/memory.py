"""Measuring the memory of one training window: live tensor bytes on CPU (a TorchDispatchMode), allocator peaks
on CUDA, and the *dry run* on a model skeleton of fake tensors (the planner's estimate, no weights).

`tracemalloc` does not see torch's allocations and RSS is too coarse (the allocator keeps freed pages), so on a
CPU the tracker counts the bytes of every tensor storage that torch ops create, and forgets a storage when it is
freed. Storages that existed before tracking began (the weights, say) are not seen: add them yourself.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from finetune.config.schema import Config
from finetune.engine.losses import loss_sum
from finetune.engine.optim import make_optimizer
from finetune.engine.recurrence import Recurrence, detach_cache, segment_loss_sum
from finetune.errors import ModelError
from finetune.kinds.base import TaskKind
from finetune.models import quantize
from finetune.models.pretrained import load_failure, prepare_for_training, quiet_transformers, resolve_model_path
from finetune.registry import configured
from finetune.registry import kind as kind_named

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


SCALED_FROM = 2  # a deep model's dry run is made on this many of its repeated layers and on one more


@dataclass(frozen=True)
class Skeleton:
    """The configured model as fake tensors, and the fake mode its dry run must run under (mixing modes fails).

    A model of more than SCALED_FROM + 1 identical layers is built twice instead, with SCALED_FROM layers (`model`)
    and with one more (`wider`); `layers` is the real count. Every byte count of the model (weights, gradients, a
    window's peak in each of its parts) is then a straight line in the number of layers through the two, which
    `count` extends to `layers`: a dry run of 5 layers instead of 32 (or 80) that predicts the same bytes."""

    model: Any
    fake_mode: FakeTensorMode
    layers: int = 0  # the real model's repeated layers when `model` has SCALED_FROM of them; 0: built whole
    wider: Any = None  # the same model with SCALED_FROM + 1 layers (under the same fake mode)

    @property
    def models(self) -> list[Any]:
        """The fake models the dry run runs: one, or the two that a deep model is scaled from."""
        return [self.model] if self.wider is None else [self.model, self.wider]

    def count(self, of: Callable[[Any], int]) -> int:
        """`of(model)` for the real model: measured on it, or extended along the layers from the two built."""
        if self.wider is None:
            return of(self.model)
        return scaled(of(self.model), of(self.wider), self.layers)


def scaled(small: int, wider: int, layers: int) -> int:
    """A count measured with SCALED_FROM and SCALED_FROM + 1 layers, at `layers` layers (a straight line)."""
    return wider + (layers - SCALED_FROM - 1) * (wider - small)


def model_skeleton(c: Config, num_labels: int, *, checkpointing: bool, lora: bool, precision: str = "fp32",
                   offload: bool = False, tiled: bool = False) -> Skeleton:
    """The configured model as fake tensors (shapes, dtypes and a device, no data and no weights read), with
    checkpointing and LoRA as asked; under LoRA with mixed precision the frozen base is in the half dtype, as
    `load_model` stores it (a quantized base is counted from these shapes: `quantize.weight_bytes`); with
    `offload`, checkpointing's saved inputs leave the device and are counted as host bytes
    (`finetune.engine.offload`); with `tiled`, its MLPs run a tile of positions at a time
    (`finetune.models.tiled_mlp`). A deep model of identical layers is built with two and three of them
    (`Skeleton`)."""
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

    def build(config: Any) -> Any:
        # No weight initialisation: the dry run needs shapes, and some initialisers (ViT's truncated normal) read
        # values, which fake tensors have none of.
        # (only for image models: elsewhere it leaves GPT-2's tied head untied in the count, 14 % over.)
        init = no_init_weights() if kind.entry.inputs == "images" else contextlib.nullcontext()
        with fake, _adapters_stay_where_made(), init:
            try:
                model = auto.from_config(config, trust_remote_code=c.trust_remote_code,
                                         dtype=quantize.base_dtype(precision, lora))
            except ValueError as e:  # no such head for this architecture (seq2seq on BERT): as loading it says
                raise ModelError(load_failure(c.model, e, c.task)) from None
            return prepare_for_training(model, c, checkpointing=checkpointing, lora=lora, offload=offload,
                                        tiled=tiled)

    layers = _scalable_layers(model_config, c)
    if layers:
        small, wider = (build(_with_layers(model_config, n)) for n in (SCALED_FROM, SCALED_FROM + 1))
        if _uniform(repeated_layers(small), SCALED_FROM) and _uniform(repeated_layers(wider), SCALED_FROM + 1):
            return Skeleton(small, fake, layers, wider)
    return Skeleton(build(model_config), fake)


def _scalable_layers(model_config: Any, c: Config) -> int:
    """The model's count of repeated layers when its dry run may be scaled from a few of them, else 0: a stack of
    more than SCALED_FROM + 1 layers of one type (segment recurrence's carried cache is measured whole)."""
    layers = getattr(model_config, "num_hidden_layers", None)
    types = getattr(model_config, "layer_types", None)
    if c.segment_recurrence or c.trust_remote_code or not isinstance(layers, int) or layers <= SCALED_FROM + 1:
        return 0
    if types is not None and (not isinstance(types, list | tuple) or len(set(types)) > 1):
        return 0  # sliding and full attention interleaved: the layers differ
    return layers


def _with_layers(model_config: Any, n: int) -> Any:
    """A copy of the model's config with `n` of its (identical) layers."""
    config = copy.deepcopy(model_config)
    config.num_hidden_layers = n
    if isinstance(getattr(config, "layer_types", None), list | tuple):
        config.layer_types = list(config.layer_types[:1]) * n
    return config


def repeated_layers(model: Any) -> list[Any] | None:
    """The model's stack of repeated layers (Llama's `layers`, BERT's `layer`, GPT-2's `h`), or None: the first
    module list whose entries are all checkpointing layers of one class."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and \
                all(isinstance(m, GradientCheckpointingLayer) and type(m) is type(module[0]) for m in module):
            return list(module)
    return None


def _uniform(layers: list[Any] | None, n: int) -> bool:
    """Whether `layers` are `n` layers of the same parameters (names, shapes, dtypes, what trains)."""
    if layers is None or len(layers) != n:
        return False
    shapes = [[(name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in m.named_parameters()] for m in layers]
    return all(s == shapes[0] for s in shapes)


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


def _micro_steps(model: Any, next_batch: Callable[[], dict[str, Any]], kind: TaskKind, accum: int, precision: str,
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
            _micro_steps(model, lambda: batch, kind, accum, precision, "cpu", phases)
    finally:
        if phases is not None:
            phases.remove()
        for p in model.parameters():
            p.grad = None
    return tracker.peak, tracker.by_phase


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
