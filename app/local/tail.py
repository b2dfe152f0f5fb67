"""Reading what a training child writes: its events.jsonl as it grows, and its printed output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class EventTail:
    """The records of a growing events.jsonl, reading only the lines appended since the last call."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._records: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        """All complete records so far (a half-written last line waits for the next call)."""
        try:
            size = self.path.stat().st_size
        except OSError:
            size = 0
        if size < self._offset:  # replaced (overwrite=true): start again
            self._offset, self._records = 0, []
        if size > self._offset:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(size - self._offset)
            end = chunk.rfind(b"\n") + 1
            for line in chunk[:end].splitlines():
                try:
                    self._records.append(json.loads(line))
                except ValueError:
                    continue
            self._offset += end
        return list(self._records)


def session_output(path: Path, max_bytes: int = 32768) -> str:
    """What the child printed since its launch (the log file also holds earlier sessions of the run)."""
    if not path.is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - max_bytes))
        text = f.read().decode("utf-8", errors="replace")
    # The child's tqdm bars (if any) rewrite one line with carriage returns: keep only each line's final state.
    lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n")]
    starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    lines = lines[starts[-1] + 1:] if starts else lines
    return "\n".join(line for line in lines if line.strip())


def error_from_output(output: str) -> str:
    """The CLI's message (from the last line starting "error: "), else the last line (of a traceback)."""
    lines = output.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("error: "):
            return "\n".join([lines[i][len("error: "):], *lines[i + 1:]]).strip()
    return lines[-1] if lines else ""
