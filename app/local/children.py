"""Where the app starts its `finetune` children: each in a session (process group) of its own, so that a Stop can
signal it and everything it started, and closing the page (or the app) does not take it down; its output goes to a
log, and it gets the environment it is given (on a shared server, one without the app's secrets:
`Access.child_env`). The training run, the export and the planner all start here; the previews of a visitor's input
run in forked children instead (`app.local.bounded`).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping
from typing import IO


def _default_sigint() -> None:
    """In the child, before it execs: SIGINT back to its default. An app started with SIGINT ignored (a shell's
    background job) would pass that on through exec, and a Stop before the CLI installs its handler (while it
    imports, the first seconds) would be lost: the run went on to the end under "Stopping…"."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(command: list[str], log: IO[str], env: Mapping[str, str]) -> subprocess.Popen:
    """`command` in a new session, its output (and errors) appended to `log`, unbuffered so the log follows it;
    SIGINT stops it whatever the app's own disposition (`_default_sigint`)."""
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_default_sigint,  # noqa: PLW1509 (one signal call)
                            env={**env, "PYTHONUNBUFFERED": "1"})


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
