"""The run queue: the runs waiting for the run in progress to end, first to start first, kept in
`<runs_dir>/queue.json` (written atomically, like current.json, so that the queue survives an app restart) and
changed under a file lock (`queue.lock`), so that an app process that is still ending and the one that replaces it
never both take the same run off the queue. The job manager (`app.local.training.JobManager`) puts runs in and starts
them; this module only keeps the list.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.run.rundir import LAUNCH_FILES, MARKER, write_json


@dataclass(frozen=True, kw_only=True)
class Queued:
    """A run waiting in the queue: what the job manager's `start` will be given, and whose run it is."""

    run_dir: Path
    config_path: Path
    overrides: tuple[str, ...] = ()  # ("resume=true",) for a queued Resume
    owner: str | None = None
    queued_at: float = 0.0  # Unix time
    verb: str = "train"  # the command it runs: `finetune train`, or `finetune sweep` (the Train tab's Sweep)

    def record(self) -> dict[str, Any]:
        """The entry as queue.json keeps it."""
        return {"run_dir": str(self.run_dir), "config_path": str(self.config_path), "overrides": list(self.overrides),
                "owner": self.owner, "queued_at": self.queued_at, "verb": self.verb}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Queued:
        """An entry of queue.json (`KeyError`, `TypeError` or `ValueError` for one that is not)."""
        return cls(run_dir=Path(record["run_dir"]), config_path=Path(record["config_path"]),
                   overrides=tuple(str(o) for o in record.get("overrides") or ()), owner=record.get("owner"),
                   queued_at=float(record.get("queued_at") or 0.0), verb=_verb(record.get("verb")))


def _verb(value: Any) -> str:
    """The queued command's verb; anything but `sweep` (an older queue.json has none) trains."""
    return "sweep" if value == "sweep" else "train"


class RunQueue:
    """The queue of one runs folder (everyone's runs: `JobClient.queued` shows a user only their own)."""

    def __init__(self, runs_dir: Path):
        self.folder = Path(runs_dir).resolve()  # the manager's threads must not follow a later change of directory

    def entries(self) -> list[Queued]:
        """The runs waiting, first to start first (none when queue.json is missing or not the app's)."""
        try:
            return [Queued.from_record(r) for r in json.loads((self.folder / "queue.json").read_text("utf-8"))]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def position(self, run_dir: Path) -> int | None:
        """The place of `run_dir` in the queue (1: next to start), or None when it is not queued."""
        return next((i for i, q in enumerate(self.entries(), 1) if q.run_dir == run_dir), None)

    def write(self, entries: list[Queued]) -> None:
        """Replace the queue (atomically: an app killed mid-write leaves the old queue, never half of one)."""
        write_json(self.folder / "queue.json", [q.record() for q in entries])

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The queue to this thread alone, across app processes too, while it is read and changed."""
        with open(self.folder / "queue.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def remove_unstarted(run_dir: Path) -> bool:
    """Remove a run folder that holds only what Start wrote in it (its marker and launch files): a queued run
    cancelled before it ran. A folder with anything else (a queued Resume's run) is kept; whether it was removed."""
    if not run_dir.is_dir() or any(p.name not in (MARKER, *LAUNCH_FILES) for p in run_dir.iterdir()):
        return False
    for name in (MARKER, *LAUNCH_FILES):
        (run_dir / name).unlink(missing_ok=True)
    run_dir.rmdir()
    return True
