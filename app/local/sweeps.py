"""A sweep the app runs (`finetune sweep` in the job manager's one child, its trials one after another) as the Run
panel follows it: which trial of how many trains now, the best so far, and how the sweep ended.

Read from what `finetune.sweep.study` leaves in the sweep's folder and beside it, never from the child's output:
summary.json (rewritten after each trial: every trial, how it ended, the best) and each trial's run folder
(`<sweep>-trial-NNN`, its sweep.json saying "running" while it trains, its events.jsonl), so that a page reloaded, or
an app restarted, finds the same progress.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config.schema import ConfigError, read_yaml
from finetune.errors import EXIT_STOPPED
from finetune.run.events import read_events
from finetune.sweep.study import SUMMARY_FILE, TRIAL_FILE, trial_folder

VERB = "sweep"  # the job's `finetune` command (`JobManager.start(…, verb=VERB)`)
ENDED = ("complete", "pruned", "failed")  # the trials that count towards the number asked for (not "retried")


@dataclass(frozen=True, kw_only=True)
class SweepProgress:
    """Where a sweep stands: `finished` of `total` trials ended, the one in progress, the best so far."""

    total: int
    finished: int
    objective: str
    running: int | None = None  # the study's number of the trial training now
    params: dict[str, Any] | None = None  # the options the search picked for it
    best: dict[str, Any] | None = None  # summary.json's best trial: number, value, run, params
    counts: dict[str, int] | None = None  # trials by how they ended: complete, pruned, failed

    @property
    def line(self) -> str:
        """"Trial 2 of 6 · best so far accuracy=0.8125 (trial 0)", as the Run panel shows it."""
        at = min(self.finished + (1 if self.running is not None else 0), self.total) or 1
        parts = [f"Trial {at} of {self.total}" if self.finished < self.total else f"{self.total} trials"]
        if self.running is not None and self.params:
            parts[0] += " (" + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in self.params.items()) + ")"
        if pruned := (self.counts or {}).get("pruned"):
            parts.append(f"{pruned} pruned")
        if self.best is not None:
            parts.append(f"best so far {self.objective}={self.best['value']:.4g} (trial {self.best['number']})")
        elif self.finished:
            parts.append("no trial complete yet")
        return " · ".join(parts)


def is_sweep(command: list[str]) -> bool:
    """Whether a job's command (`python -m finetune VERB …`) runs a sweep."""
    return len(command) > 3 and command[3] == VERB


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def sweep_of(config_path: Path) -> dict[str, Any]:
    """The `sweep:` section of the config a sweep was started with ({} when it has none, or does not read)."""
    try:
        section = read_yaml(config_path).get("sweep")
    except (OSError, ValueError, AttributeError, ConfigError):
        return {}
    return section if isinstance(section, dict) else {}


def read_progress(folder: Path, config_path: Path) -> SweepProgress:
    """The progress of the sweep kept in `folder` (started from `config_path`), from its summary and trials."""
    section = sweep_of(config_path)
    summary = _json(folder / SUMMARY_FILE)
    trials = [t for t in summary.get("trials") or [] if isinstance(t, dict)]
    total = summary.get("trials_wanted") or section.get("trials") or 10
    objective = summary.get("objective") or str(section.get("objective") or "").removeprefix("eval/")
    best = summary.get("best") if isinstance(summary.get("best"), dict) else None
    running = _running_trial(folder)
    return SweepProgress(total=int(total), finished=sum(t.get("state") in ENDED for t in trials),
                         objective=objective, running=None if running is None else running.get("trial"),
                         params=None if running is None else running.get("params"), best=best,
                         counts=summary.get("counts") if isinstance(summary.get("counts"), dict) else None)


def _running_trial(folder: Path) -> dict[str, Any] | None:
    """The sweep.json of the trial that says it trains now (the newest such, after a killed sweep), or None."""
    running = []
    for record in folder.parent.glob(f"{folder.name}-trial-*/{TRIAL_FILE}"):
        trial = _json(record)
        if trial.get("sweep_dir") and Path(trial["sweep_dir"]).name == folder.name and \
                trial.get("state") == "running" and isinstance(trial.get("trial"), int):
            running.append(trial)
    return max(running, key=lambda t: t["trial"], default=None)


def shown_events(folder: Path, progress: SweepProgress) -> list[dict[str, Any]]:
    """The events the Run panel draws: the trial in progress's, else the best trial's, else the newest trial's."""
    if progress.running is not None:
        run = trial_folder(folder, progress.running)
    elif progress.best is not None and progress.best.get("run"):
        run = folder.parent / str(progress.best["run"])
    else:
        runs = sorted(folder.parent.glob(f"{folder.name}-trial-*"))
        if not runs:
            return []
        run = runs[-1]
    return read_events(run / "events.jsonl")


def sweep_state(progress: SweepProgress, *, name: str, rc: int | None, running: bool, stop_requested: bool,
                killed: bool, error: str) -> tuple[str, str]:
    """The job's state and its sentence: running, stopping, done, stopped or failed (`name`: the sweep's; `error`:
    what the child's output says went wrong)."""
    again = f"Start sweep again with the name {name} and the same settings to continue: its finished trials are kept."
    if running:
        return ("stopping", "Stopping the sweep after the trial's current optimizer step…") if stop_requested \
            else ("running", progress.line)
    if rc == 0 or rc is None and progress.finished >= progress.total:  # None: an earlier app's child, gone
        best = progress.best
        said = f"best: trial {best['number']} ({best['run']}), {progress.objective} {best['value']:.4g}" if best \
            else "no trial completed"
        return "done", f"Sweep done: {progress.finished} trial(s); {said}."
    if killed or stop_requested or rc in (EXIT_STOPPED, -signal.SIGINT):
        return "stopped", f"Sweep stopped after {progress.finished} of {progress.total} trials. {again}"
    if rc is None or rc < 0:
        return "failed", f"The sweep's process was killed (out of memory?). {again}"
    return "failed", error or f"The sweep's process exited with code {rc}."
