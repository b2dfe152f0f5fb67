"""Where the app starts its `finetune` children: each in a session (process group) of its own, so that a Stop can
signal it and everything it started, and closing the page (or the app) does not take it down; its output goes to a
log, and it gets the environment it is given (on a shared server, one without the app's secrets:
`Access.child_env`). The training run, the export and the planner all start here; the previews of a visitor's input
run in forked children instead (`app.jobs.bounded`).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from typing import IO


def spawn(command: list[str], log: IO[str], env: Mapping[str, str]) -> subprocess.Popen:
    """`command` in a new session, its output (and errors) appended to `log`, unbuffered so the log follows it."""
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**env, "PYTHONUNBUFFERED": "1"})


def run(command: list[str], timeout_s: float, env: Mapping[str, str]) -> subprocess.CompletedProcess:
    """`command` to its end (the planner: seconds), its output captured; `subprocess.TimeoutExpired` past
    `timeout_s`, when it is killed."""
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=dict(env))


def signal_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group `pid` leads (nothing for an unknown pid, or one that is gone)."""
    if pid <= 0:
        return
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
