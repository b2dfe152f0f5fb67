"""The export child: `finetune export` of a finished run, one at a time on the server, its output in the run's
`export.log`, and its whole process group killed past a time limit (an export that hangs must not hold the machine).
The Runs tab's evaluation (`finetune eval RUN --benchmarks`) is a child of its own kind, the same way (`EVAL_LOG`).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from app.local.children import signal_group, spawn
from app.local.training import JobBusy

EXPORT_LIMIT_S = 3600.0  # without a server run-time limit (locally): an export is minutes even for a 7B model
LOG = "export.log"  # in the run directory, beside export/ (which the child creates)
EVAL_LOG = "benchmarks.log"  # in the run directory, beside benchmarks.json


@dataclass
class ExportChild:
    """The export child process and what is needed to follow it."""

    run_dir: Path
    owner: str | None
    proc: subprocess.Popen
    log: Path
    started: float
    timed_out: bool = False


class ExportJobs:
    """The app's one export child (or, with `log` and `busy`, its one child of another kind)."""

    def __init__(self, limit_s: float | None = None, log: str = LOG,
                 busy: str = "An export is in progress on this server: wait for it to finish."):
        self.limit_s = limit_s or EXPORT_LIMIT_S
        self.log_name, self.busy = log, busy
        self._lock = threading.Lock()
        self._child: ExportChild | None = None

    @property
    def child(self) -> ExportChild | None:
        """The latest export child (running or ended), or None before any."""
        return self._child

    def running(self) -> bool:
        """Whether an export is in progress on this server."""
        with self._lock:
            return self._child is not None and self._child.proc.poll() is None

    def start(self, command: list[str], run_dir: Path, owner: str | None, env: Mapping[str, str]) -> ExportChild:
        """Run `command` (`python -m finetune export RUN …`) for `owner`, its output to RUN/export.log; `JobBusy`
        while another export runs."""
        with self._lock:
            if self._child is not None and self._child.proc.poll() is None:
                raise JobBusy(self.busy)
            log = run_dir / self.log_name
            with open(log, "w", encoding="utf-8") as out:
                out.write(f"$ finetune {' '.join(command[3:])}\n")
                out.flush()
                proc = spawn(command, out, env)
            self._child = ExportChild(run_dir=run_dir, owner=owner, proc=proc, log=log, started=time.time())
            threading.Thread(target=self._watch, args=(self._child,), daemon=True).start()
            return self._child

    def _watch(self, child: ExportChild) -> None:
        """Kill the export's process group past the time limit."""
        try:
            child.proc.wait(timeout=self.limit_s)
        except subprocess.TimeoutExpired:
            child.timed_out = True
            signal_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
