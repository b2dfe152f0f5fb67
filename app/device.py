"""The memory the default budget is taken from: the first CUDA GPU's, else the machine's RAM."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

GIB = 1024**3
_PROBE = ("import json, torch; p = torch.cuda.get_device_properties(0); "
          "print(json.dumps({'name': p.name, 'bytes': p.total_memory}))")


@dataclass(frozen=True)
class DeviceMemory:
    """Total memory in GiB of the device training will use, and what it is."""

    gib: float
    what: str


def detect() -> DeviceMemory:
    """GPU 0's total memory if CUDA is available, else system RAM (psutil)."""
    import torch

    if torch.cuda.is_available():
        # Asked in a short child process: querying the device here would create a CUDA context that holds
        # hundreds of MiB of the very GPU the training run needs, for as long as the app lives.
        try:
            out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                                 check=True).stdout
            info = json.loads(out.strip().splitlines()[-1])
            return DeviceMemory(round(info["bytes"] / GIB, 1), f"GPU 0 ({info['name']})")
        except (subprocess.SubprocessError, ValueError, IndexError, KeyError):
            return _ram("system RAM (the CUDA GPU could not be queried)")  # a page without a budget guess is worse
    return _ram("system RAM (no CUDA GPU)")


def _ram(what: str) -> DeviceMemory:
    import psutil

    return DeviceMemory(round(psutil.virtual_memory().total / GIB, 1), what)
