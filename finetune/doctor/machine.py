"""What `finetune doctor` reports of the machine: Python and torch, the devices and their memory, which precisions
they have, bitsandbytes' backend, hub kernels, RAM and free disk. Each finding that stops a run is a problem, one
sentence with the fix."""

from __future__ import annotations

import contextlib
import io
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

import psutil
import torch

from finetune.config.versions import installed
from finetune.models import kernels

GIB = 2**30
MIN_FREE_DISK_GB = 5.0  # a run's checkpoints and the data cache; below this `finetune doctor` warns


def devices() -> list[dict[str, Any]]:
    """Each CUDA GPU (name, memory total and free, compute capability, bf16), or the CPU alone."""
    if not torch.cuda.is_available():
        return [{"device": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                 "bf16": True, "fp16": False}]
    found = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        found.append({"device": f"cuda:{i}", "name": props.name, "memory_gib": round(total / GIB, 2),
                      "free_gib": round(free / GIB, 2), "capability": f"{props.major}.{props.minor}",
                      "bf16": bool(torch.cuda.is_bf16_supported()), "fp16": True})
    return found


def bitsandbytes_backend() -> dict[str, Any]:
    """bitsandbytes' version and the backend its native library loaded for (cpu, cuda, …), or why it cannot load."""
    version = installed("bitsandbytes")
    if version is None:
        return {"version": None, "backend": None, "note": "not installed: quantization=8bit/4bit and adamw_8bit "
                "need it (pip install 'finetune[quantization]')"}
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from bitsandbytes import cextension
    except Exception as e:  # noqa: BLE001 — any failure of a native library's import is the finding itself
        return {"version": version, "backend": None, "note": f"fails to import: {type(e).__name__}: {e}"[:300]}
    return {"version": version, "backend": str(getattr(cextension, "BNB_BACKEND", "unknown")).lower(), "note": None}


def hub_kernels() -> dict[str, Any]:
    """Whether transformers would kernelize models from the Hub here: the `kernels` package, USE_HUB_KERNELS and
    whether the Hub is offline."""
    problem = kernels.package_problem()
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
    return {"kernels_package": installed("kernels"), "usable": problem is None,
            "disabled_by_environment": kernels.disabled_by_environment(), "hub_offline": offline}


def memory(folder: Path) -> dict[str, Any]:
    """Host RAM and the free disk under `folder` (where runs and the data cache go)."""
    ram = psutil.virtual_memory()
    disk = shutil.disk_usage(folder)
    return {"ram_gib": round(ram.total / GIB, 2), "ram_available_gib": round(ram.available / GIB, 2),
            "disk_free_gib": round(disk.free / GIB, 2), "disk_folder": str(folder)}


def facts(folder: Path) -> dict[str, Any]:
    """Everything `finetune doctor` says of this machine."""
    return {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
            "cuda_build": torch.version.cuda, "devices": devices(), "bitsandbytes": bitsandbytes_backend(),
            "hub_kernels": hub_kernels(), **memory(folder)}


def problems(found: dict[str, Any]) -> list[str]:
    """One sentence per finding that would stop or hobble a run, with what to do."""
    out = []
    if found["disk_free_gib"] < MIN_FREE_DISK_GB:
        out.append(f"Only {found['disk_free_gib']:.1f} GiB are free under {found['disk_folder']}: free at least "
                   f"{MIN_FREE_DISK_GB:g} GiB for checkpoints and the data cache.")
    if found["devices"][0]["device"] == "cpu" and found["cuda_build"]:
        out.append(f"torch {found['torch']} is a CUDA {found['cuda_build']} build but sees no GPU: check the driver "
                   "(nvidia-smi) and CUDA_VISIBLE_DEVICES.")
    bnb = found["bitsandbytes"]
    if bnb["version"] is not None and bnb["backend"] is None:
        out.append(f"bitsandbytes {bnb['version']} {bnb['note']}: reinstall it for this torch, or leave "
                   "quantization=none.")
    return out
