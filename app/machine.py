"""The page's collapsed "This machine" panel: what `finetune doctor --no-self-test` finds here (versions against
their ranges, the devices, bitsandbytes, hub kernels, RAM and disk), asked in a child process when the panel is first
opened, so that the app itself never creates a CUDA context on the GPU its runs need, and an app whose panel stays
closed never spends the doctor's 5 s of CPU (its imports of torch, transformers and bitsandbytes)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

DOCTOR_TIMEOUT_S = 180  # a cold import of torch and transformers on a busy machine, with room


class MachineReport:
    """`finetune doctor --json --no-self-test`, run in the background from `start()`; `markdown()` says what it
    found (or that it is still looking)."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None):
        self.folder, self.env = folder, env
        self.found: dict[str, Any] | None = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MachineReport:
        """Ask the doctor in a daemon thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._ask, name="this-machine", daemon=True)
            self._thread.start()
        return self

    def _ask(self) -> None:
        command = [sys.executable, "-m", "finetune", "doctor", "--json", "--no-self-test"]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=DOCTOR_TIMEOUT_S,
                                  cwd=self.folder, env=self.env)
            self.found = json.loads(proc.stdout)
        except (subprocess.SubprocessError, OSError, ValueError) as e:
            self.error = f"`finetune doctor` could not run ({type(e).__name__}): run it in a terminal to see why."

    def markdown(self, request: Any = None) -> str:
        """The panel's text; the first call starts the doctor (not the app's start, which must answer Gradio's own
        readiness check within seconds while the doctor's child imports torch)."""
        self.start()
        if self.error:
            return self.error
        if self.found is None:
            return "Checking this machine…"
        return describe(self.found)

    def opened(self, request: Any = None) -> str:
        """The panel's text once the doctor has answered (the panel was opened: its reader waits for it), or what
        stopped it."""
        self.start()._thread.join(timeout=DOCTOR_TIMEOUT_S + 10)
        return self.markdown()


def describe(found: dict[str, Any]) -> str:
    """`finetune doctor`'s findings as the panel's Markdown: problems first, then the devices, then the versions."""
    lines = []
    if found.get("problems"):
        lines += ["**Problems**", "", *[f"- {p}" for p in found["problems"]], ""]
    m = found["machine"]
    for d in m["devices"]:
        if d["device"] == "cpu":
            lines.append(f"- **Device**: CPU ({d['cores']} cores), no GPU: runs train on the CPU (bf16 yes, fp16 no)")
        else:
            lines.append(f"- **{d['device']}**: {d['name']}, {d['memory_gib']:.1f} GiB ({d['free_gib']:.1f} free); "
                         f"bf16 {'yes' if d['bf16'] else 'no'}, fp16 yes")
    build = f"CUDA {m['cuda_build']}" if m["cuda_build"] else "CPU build"
    bnb = m["bitsandbytes"]
    kernels = m["hub_kernels"]
    kernel_state = ("off here" if kernels["disabled_by_environment"] else "usable" if kernels["usable"]
                    else "not installed")
    lines += [f"- **torch** {m['torch']} ({build}), Python {m['python']}",
              f"- **bitsandbytes**: {bnb['version'] or 'not installed'}"
              + (f" ({bnb['backend']} backend)" if bnb["backend"] else ""),
              f"- **Hub kernels**: {kernel_state}",
              f"- **RAM** {m['ram_gib']:.1f} GiB ({m['ram_available_gib']:.1f} available); **disk** "
              f"{m['disk_free_gib']:.1f} GiB free", "",
              "| package | installed | supported |", "|---|---|---|"]
    lines += [f"| {p['name']}{' (' + p['extra'] + ')' if p['extra'] else ''} | {p['found'] or 'not installed'}"
              f"{'' if p['ok'] else ' ⚠'} | {p['wanted'] or 'any'} |" for p in found["packages"]]
    return "\n".join(lines)
