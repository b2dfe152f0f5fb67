"""The model as fake tensors for the dry run (shapes, dtypes and a device, no data and no weights), built with a
few of its repeated layers and extended along them (`Skeleton`)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from finetune.building import BUILDS
from finetune.config.schema import Config
from finetune.errors import ModelError
from finetune.models import quantize
from finetune.models.pretrained import load_failure, prepare_for_training, quiet_transformers, resolve_model_path
from finetune.registry import kind as kind_named

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
        with BUILDS, fake, _adapters_stay_where_made(), init:
            try:
                model = auto.from_config(config, trust_remote_code=c.trust_remote_code,
                                         dtype=quantize.base_dtype(precision, lora))
            except ValueError as e:  # no such head for this architecture (seq2seq on BERT): as loading it says
                raise ModelError(load_failure(c.model, e, c.task)) from None
            # As `load_model` freezes them (a vision tower, unless trained): no gradients, no optimizer state.
            for name in kind.frozen_modules(model, c):
                model.get_submodule(name).requires_grad_(False)
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
