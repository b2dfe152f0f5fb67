"""The runs folder's record of the run in progress (`current.json`), shared by every app process on that folder:
what a restarted app re-attaches to, and what keeps two app processes from training at once (`training.lock` makes
the check and the write one step)."""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from finetune.run.rundir import write_json

OTHER_APP = ("Another app process on this runs folder is training a run, and one runs folder trains one run at a "
             "time: start runs from that app, or stop it first (each app process needs its own --runs-dir).")


def alive(pid: int) -> bool:
    """Whether process `pid` runs; a zombie (exited, not yet reaped by its adopter) does not."""
    if pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone else's process: it exists
        return True


def is_finetune(pid: int) -> bool:
    """Whether process `pid` runs finetune (a recorded pid may since belong to an unrelated process)."""
    try:
        return any("finetune" in arg for arg in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


class CurrentRun:
    """`runs/current.json` and its lock."""

    def __init__(self, runs_dir: Path):
        self.path = runs_dir / "current.json"
        self.lock_path = runs_dir / "training.lock"

    def read(self) -> dict[str, Any] | None:
        """The record, or None when there is none (or it cannot be read)."""
        try:
            record = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def write(self, record: dict[str, Any]) -> None:
        """Write the record atomically: an app killed mid-write must not leave a half file the next start cannot
        adopt."""
        write_json(self.path, record)

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """Launches on this runs folder to one thread of one app process at a time (`training.lock`): the check
        that no run trains and the write of current.json that says one does are one step. (Taken inside the
        queue's lock, never around it.)"""
        with open(self.lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def other_app(self, own_pid: int | None) -> str:
        """Why this app process may start no run now: another one on the same runs folder has a run training (the
        record names a live finetune process that is not `own_pid`, this process's run); "" when none has."""
        try:
            pid = int((self.read() or {})["pid"])
        except (KeyError, ValueError, TypeError):
            return ""
        if pid == own_pid or not alive(pid) or not is_finetune(pid):
            return ""
        return OTHER_APP
