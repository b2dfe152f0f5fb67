"""Where training runs: the precision it resolves to, the accelerate `Accelerator`, and the device's memory."""

from __future__ import annotations

import os
from typing import Any

import torch

from finetune.errors import ConfigError


def resolve_precision(precision: str) -> str:
    """`auto` → bf16 (or fp16) on a GPU that has it, fp32 elsewhere; fp16 off a GPU is refused."""
    cuda = torch.cuda.is_available()
    if precision == "auto":
        if not cuda:
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if precision == "fp16" and not cuda:
        raise ConfigError(["precision=fp16 needs a CUDA GPU (its loss scaling is GPU-only): use fp32 or auto."])
    return precision


def make_accelerator(precision: str) -> Any:
    """The accelerate `Accelerator` for a resolved precision (fp32, fp16 or bf16)."""
    from accelerate import Accelerator

    # Under a launcher (WORLD_SIZE > 1) without CUDA, accelerate only forms a gloo process group when asked for the
    # CPU explicitly; otherwise every process would train alone.
    cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(mixed_precision={"fp32": "no"}.get(precision, precision), cpu=cpu)


def precision_of(accelerator: Any) -> str:
    """The precision an accelerator trains in, in our spelling (accelerate calls fp32 "no")."""
    return {"no": "fp32"}.get(str(accelerator.mixed_precision), str(accelerator.mixed_precision))


def device_memory() -> tuple[str, int]:
    """(description, total bytes) of the device training will use: the first GPU, else this machine's RAM."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"cuda ({props.name})", int(props.total_memory)
    import psutil

    return "cpu", int(psutil.virtual_memory().total)
