"""A benchmark's tools run as child processes, one after another: each from the repository root, timed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def run(command: list[str]) -> float:
    """Run a tool's process from the repository root; its wall seconds (its output's tail, and an error, if it
    fails)."""
    start = time.time()
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"exit code {proc.returncode}: {' '.join(command)}")
    return time.time() - start
