"""Where training runs: the precision it resolves to, the accelerate `Accelerator`, the device's memory, and
how long the process has been running, and bitsandbytes imported quietly (the 8-bit optimizer's and the quantized
layers')."""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import torch

from finetune.errors import ConfigError


def resolve_precision(precision: str, cuda: bool | None = None) -> str:
    """`auto` → bf16 (or fp16) on a GPU that has it, fp32 elsewhere; fp16 off a GPU is refused. `cuda=True` plans
    for a CUDA GPU that this machine may not have (bf16, what current GPUs use)."""
    here = torch.cuda.is_available()
    cuda = here if cuda is None else cuda
    if precision == "auto":
        if not cuda:
            return "fp32"
        return "bf16" if not here or torch.cuda.is_bf16_supported() else "fp16"
    if precision == "fp16" and not cuda:
        raise ConfigError(["precision=fp16 needs a CUDA GPU (its loss scaling is GPU-only): use fp32 or auto."])
    return precision


def make_accelerator(precision: str) -> Any:
    """The accelerate `Accelerator` for a resolved precision (fp32, fp16 or bf16)."""
    from accelerate import Accelerator

    # Under a launcher (WORLD_SIZE > 1) without CUDA, accelerate only forms a gloo process group when asked for the
    # CPU explicitly; otherwise every process would train alone.
    cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        return Accelerator(mixed_precision={"fp32": "no"}.get(precision, precision), cpu=cpu)
    except RuntimeError as e:
        if requested_mode() == "fsdp" and "no available devices" in str(e):  # FSDP1's sync_module_states
            raise ConfigError(["accelerate's FSDP version 1 needs a GPU: launch with fsdp_version 2 (without a GPU "
                               "it then runs plain DDP) or without FSDP."]) from e
        raise


def precision_of(accelerator: Any) -> str:
    """The precision an accelerator trains in, in our spelling (accelerate calls fp32 "no")."""
    return {"no": "fp32"}.get(str(accelerator.mixed_precision), str(accelerator.mixed_precision))


def device_memory() -> tuple[str, int]:
    """(description, total bytes) of the device training will use: the first GPU, else this machine's RAM."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"cuda ({props.name})", int(props.total_memory)
    return "cpu", int(psutil.virtual_memory().total)


def host_memory() -> int:
    """Bytes of this machine's RAM: what activation offload's host copies must fit in."""
    return int(psutil.virtual_memory().total)


MODES = ("single", "ddp", "fsdp", "deepspeed")


def is_sharded(model: Any) -> bool:
    """Whether a prepared model's parameters are really sharded: FSDP2 DTensors or an FSDP1 wrapper."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    return isinstance(model, FullyShardedDataParallel) or any(isinstance(p, DTensor) for p in model.parameters())


def distributed_mode(accelerator: Any, model: Any = None) -> str:
    """How a run distributes: single, ddp, fsdp or deepspeed, from accelerate's state; with the prepared `model`,
    fsdp only where its parameters are sharded."""
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind == "DEEPSPEED":
        return "deepspeed"
    if kind == "FSDP" and (model is None or is_sharded(model)):
        return "fsdp"
    return "single" if accelerator.num_processes == 1 else "ddp"


def requested_mode(env: dict[str, str] | None = None) -> str | None:
    """The sharding a launcher asked for: `accelerate launch` with an FSDP or DeepSpeed config (or --use_fsdp,
    --use_deepspeed) tells its processes through these variables; None when it asked for neither."""
    env = os.environ if env is None else env
    for mode, variable in (("fsdp", "ACCELERATE_USE_FSDP"), ("deepspeed", "ACCELERATE_USE_DEEPSPEED")):
        if env.get(variable, "").strip().lower() in ("1", "true", "yes"):
            return mode
    return None


def fallback_note(requested: str | None, mode: str, num_processes: int, device_type: str) -> str | None:
    """One sentence when the run does not shard as the launcher asked (accelerate falls back without a word)."""
    if requested is None or requested == mode:
        return None
    import accelerate

    asked = {"fsdp": "FSDP", "deepspeed": "DeepSpeed"}[requested]
    why = f"accelerate {accelerate.__version__} does not shard without CUDA" if not torch.cuda.is_available() \
        else f"accelerate {accelerate.__version__} did not set it up"
    runs = (f"plain DDP over {num_processes} {device_type.upper()} processes (every process holds the whole model)"
            if mode == "ddp" else "a single process holding the whole model")
    return f"{asked} was asked for, but {why}: this run is {runs}."


def seconds_since_process_start() -> float:
    """Seconds from this process's start to now (the `startup_s` of a run's start event)."""
    # Linux counts a process's start in clock ticks since boot; psutil's create_time adds a boot time rounded to
    # whole seconds, which would put up to 1 s of error into a figure of a few seconds.
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return round(time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return round(time.time() - psutil.Process().create_time(), 2)


def quiet_bitsandbytes() -> None:
    """bitsandbytes warns on every 8-bit matmul of fp32 inputs (it casts them to fp16) and, as it is imported, about
    optional kernels: on a CPU with AVX512-BF16 "Failed to load CPU gemm_4bit_forward from kernels-community: No
    module named 'kernels'". That kernel is not installed on purpose: the `kernels` package downloads it from the
    Hub when bitsandbytes is imported (a network fetch that fails offline and on a locked-down Space), and without it
    bitsandbytes computes 4-bit matmuls on the CPU with its own kernels, which the tests check. Called before any
    import that can bring bitsandbytes in (peft's LoRA layers import it whenever it is installed)."""
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def import_bitsandbytes() -> Any:
    """bitsandbytes, imported quietly: only by a run that uses it (a quantized base, 8-bit AdamW)."""
    quiet_bitsandbytes()
    import bitsandbytes

    return bitsandbytes
