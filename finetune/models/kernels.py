"""Hugging Face Hub kernels as a decision (`kernels: auto | hub | off`), not an accident.

transformers 5.25 loads every model with `use_kernels=True` unless told otherwise: with the `kernels` package
installed it downloads layers' code (`kernels-community/rotary`, …) from the Hub at load time, so an offline load
fails on a kernel that is not cached, and an online one runs code fetched at run time. Here a load asks for kernels
only when the option says so, a kernel failure is said as one (never as "check the hub id"), and the model records
which of its layers got a kernel, for the run's first event.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from finetune.building import one_at_a_time
from finetune.errors import ModelError

ATTRIBUTE = "_finetune_kernels"  # where a loaded model keeps its `KernelUse`
OFF_VALUES = {"0", "no", "false", "off"}  # what transformers' USE_HUB_KERNELS reads as "off"


@dataclass(frozen=True)
class KernelUse:
    """What a load did with hub kernels: the option, whether transformers was asked for them, the kernel
    repositories its layers use (repository → number of layers), and why `auto` went without them."""

    mode: str
    requested: bool
    layers: dict[str, int] = field(default_factory=dict)
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record the run's start event carries."""
        return {"mode": self.mode, "requested": self.requested, "layers": dict(self.layers), "note": self.note}


def disabled_by_environment() -> bool:
    """Whether `USE_HUB_KERNELS` turns hub kernels off for transformers (a shared server sets it for its runs)."""
    return os.environ.get("USE_HUB_KERNELS", "yes").strip().lower() in OFF_VALUES


def package_problem() -> str | None:
    """Why transformers cannot use hub kernels here (the `kernels` package missing or of a version it does not
    take), or None when it can."""
    from transformers.utils import import_utils

    check = getattr(import_utils, "is_kernels_available", None)
    if check is None or not check():
        return "the `kernels` package is not installed (or not a version this transformers takes)"
    return None


def is_kernel_failure(error: BaseException) -> bool:
    """Whether a failed load failed for a hub kernel (a kernel not cached offline, the package missing, …)."""
    return "kernel" in str(error).lower()


@one_at_a_time
def load(loader: Callable[..., Any], mode: str, name: str) -> Any:
    """`loader(use_kernels=…)` as `mode` says, the model marked with its `KernelUse`.

    `off`: never kernelized. `hub`: kernelized, and a kernel failure is a `ModelError` in one sentence. `auto`:
    kernelized when the package is there and the environment allows it; a kernel failure then loads again without
    them and the note says why. One build at a time in the process (`finetune.building`)."""
    if mode == "off":
        return _mark(loader(use_kernels=False), KernelUse(mode, False))
    if disabled_by_environment():
        if mode == "hub":
            raise ModelError("kernels=hub, but hub kernels are turned off here (USE_HUB_KERNELS="
                             f"{os.environ.get('USE_HUB_KERNELS')}; a shared server sets it unless its owner allows "
                             "them): set kernels=auto or off.")
        return _mark(loader(use_kernels=False), KernelUse(mode, False, note="hub kernels are turned off here "
                                                                           "(USE_HUB_KERNELS): trained without them"))
    problem = package_problem()
    if problem is not None:
        if mode == "hub":
            raise ModelError(f"kernels=hub, but {problem}: `pip install kernels`, or set kernels=auto or off.")
        return _mark(loader(use_kernels=False), KernelUse(mode, False))
    try:
        model = loader(use_kernels=True)
    except (OSError, ValueError, ImportError, RuntimeError) as e:
        if not is_kernel_failure(e):
            raise
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        if mode == "hub":
            raise ModelError(f"The hub kernels for {name!r} could not be loaded ({reason}): connect to the Hub once "
                             "to cache them, or set kernels=auto or off to train without them.") from None
        return _mark(loader(use_kernels=False),
                     KernelUse(mode, False, note=f"hub kernels could not be loaded ({reason}): trained without them"))
    return _mark(model, KernelUse(mode, True, layers=kernelized_layers(model)))


def kernelized_layers(model: Any) -> dict[str, int]:
    """The kernel repositories the model's layers and functions run (repository id → how many), from the `kernels`
    package's own record; {} when none (or the package cannot say)."""
    try:
        from kernels import get_kernelized_layers
    except ImportError:
        return {}
    found = get_kernelized_layers(model)
    repos = [*(layer.repo for layer in found.layers.values()), *(func.repo for func in found.funcs.values())]
    return dict(Counter(getattr(repo, "repo_id", None) or str(repo) for repo in repos))


def use_of(model: Any) -> KernelUse | None:
    """The `KernelUse` a model was loaded with (through a LoRA wrapper too), or None for a model not loaded here."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.__dict__.get(ATTRIBUTE)


def record(model: Any) -> dict[str, Any] | None:
    """The start event's record of what the model's load did with hub kernels (None for a model not loaded here)."""
    use = use_of(model)
    return use.to_dict() if use is not None else None


def _mark(model: Any, use: KernelUse) -> Any:
    model.__dict__[ATTRIBUTE] = use  # an nn.Module keeps plain attributes in its __dict__
    return model
