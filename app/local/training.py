"""The one training job the app runs at a time: `finetune train` in a child process, followed through events.jsonl.

The child runs in its own session (process group), so Stop can signal it and everything it started; the app never
trains in its own process. What a page needs to re-attach after a reload, or after the app itself restarts, is
written to `<runs_dir>/current.json`.

A Start while a run is in progress (`submit`) puts the run in the queue instead (`app.local.queue`: queue.json in the
runs folder, so it survives an app restart): when the run in progress ends (done, stopped or failed) the first queued
run starts by itself, from the thread that follows each run to its end. An app shutting down starts nothing: the next
app process starts the queue's first run at once, or once the run it re-attached to ends.

A run that ends without a final event of its own (killed by the out-of-memory killer, say) is a failed run, before
and after an app restart; any failed or stopped run that has a complete checkpoint can be resumed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.local.children import signal_group, spawn
from app.local.current import CurrentRun, alive, is_finetune
from app.local.queue import Queued, RunQueue
from app.local.sweeps import SweepProgress, is_sweep, read_progress, shown_events, sweep_state
from app.local.tail import EventTail, error_from_output, session_output
from finetune.config.schema import ConfigError, read_yaml
from finetune.run.rundir import checkpoints

# After a Stop, how long the child may take to finish its optimizer step and write the checkpoint before it is
# killed: long windows of a big model and a multi-GB optimizer state take minutes; a second Stop kills at once.
STOP_TIMEOUT_S = 600.0
TERMINAL = ("stopped", "done", "error")
KILLED = "The training process was killed (out of memory?)."
WATCH_INTERVAL_S = 1.0
ALREADY = "This run is already training or waiting in the queue: its settings stay as they were started."
ENDED = "# ended: "  # the launch log's line saying how a session ended, as the app saw it (`ended_as`)


class JobBusy(RuntimeError):
    """A run is in progress; the message says which and what to do."""


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    """What the page shows about the current (or last) run."""

    state: str  # idle, starting, running, stopping, stopped, done, failed
    run_dir: Path | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    returncode: int | None = None
    message: str = ""
    output_tail: str = ""
    command: str = ""
    config_path: Path | None = None
    owner: str | None = None  # who started it, on a shared server
    latest_checkpoint: Path | None = None  # the newest complete checkpoint on disk
    sweep: SweepProgress | None = None  # a sweep's job: its trials (its events are the trial shown's)

    @property
    def active(self) -> bool:
        """Whether a child process is (or may still be) running."""
        return self.state in ("starting", "running", "stopping")

    @property
    def model_dir(self) -> Path | None:
        """The trained model (or LoRA adapter) folder, once the run is done."""
        if self.run_dir is None or self.state != "done":
            return None
        for name in ("model", "adapter"):
            if (self.run_dir / name).is_dir():
                return self.run_dir / name
        return None

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint a stopped or failed run resumes from (what `resume=true` takes: the newest complete one)."""
        if self.latest_checkpoint is not None:
            return str(self.latest_checkpoint)
        last = self.last("stopped", "checkpoint") or {}
        return last.get("checkpoint") or last.get("path")

    @property
    def resumable(self) -> bool:
        """Whether Resume can continue this run: it stopped or failed, and a complete checkpoint is on disk."""
        return self.state in ("stopped", "failed") and self.latest_checkpoint is not None

    @property
    def progress(self) -> tuple[int, int] | None:
        """(optimizer step reached, total steps) of the latest start; None before the run has started."""
        start = self.last("start")
        if start is None:
            return None
        step = self.last("step")
        total = start["total_steps"]
        return (total if self.state == "done" else max(step["step"] if step else 0, start.get("step", 0))), total

    def last(self, *kinds: str) -> dict[str, Any] | None:
        """The latest event of one of `kinds` (e.g. "step"), or None."""
        return next((e for e in reversed(self.events) if e.get("event") in kinds), None)


@dataclass(kw_only=True)
class _Job:
    """The child process of the current run and what is needed to follow it."""

    run_dir: Path
    config_path: Path
    log_path: Path
    command: list[str]
    pid: int
    proc: subprocess.Popen | None  # None when adopted from an earlier app process
    launched: float  # Unix time; events from before it belong to earlier sessions of the same run directory
    owner: str | None = None
    stop_requested_at: float | None = None
    killed: bool = False  # the app itself killed it (a second Stop, or a stop that timed out)
    time_limit_min: float | None = None  # set when the server's time limit stopped it
    tail: EventTail | None = None

    def events(self) -> list[dict[str, Any]]:
        if self.tail is None:
            self.tail = EventTail(self.run_dir / "events.jsonl")
        return self.tail.read()


def _busy_message(status: JobStatus) -> str:
    """Why a second run cannot start now (what `start` raises; the app queues it instead: `submit`)."""
    step, start = status.last("step"), status.last("start")
    where = f", step {step['step']} of {start['total_steps']}" if step and start else ""
    return (f"A run is in progress ({status.run_dir}{where}): only one job runs at a time. Stop it, or wait for "
            "it to finish, before starting another.")


def _pushes(config_path: Path) -> bool:
    """Whether the run's config (as launched) pushes the model to the Hub when it is done."""
    try:
        return bool(read_yaml(config_path).get("push_to_hub"))
    except (OSError, ValueError, AttributeError, ConfigError):
        return False


class JobManager:
    """Starts, stops and reports on one `finetune train` child process at a time."""

    def __init__(self, runs_dir: str | Path, python: str = sys.executable, stop_timeout: float = STOP_TIMEOUT_S,
                 env: dict[str, str] | None = None, max_run_s: float | None = None):
        self.runs_dir = Path(runs_dir)
        self.env = env  # the child's environment (default: the app's); a shared server leaves its secrets out
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.stop_timeout = stop_timeout
        self.max_run_s = max_run_s  # the server's time limit: a longer run is stopped (with a checkpoint)
        self._lock = threading.RLock()
        self._job: _Job | None = None
        self._closing = False  # the app is shutting down: no queued run starts
        self.queue = RunQueue(self.runs_dir)  # the runs waiting for this one to end
        self.current = CurrentRun(self.runs_dir)  # current.json: what another app process trains, what to adopt
        self._adopt()
        self._advance()  # a queued run whose turn came while no app was running starts now

    # --- starting
    def start(self, config_path: Path, run_dir: Path, overrides: list[str] | None = None,
              owner: str | None = None, env: dict[str, str] | None = None, verb: str = "train") -> JobStatus:
        """Run `finetune train CONFIG [overrides] -q` (in `env`, default the manager's; `verb` "sweep": `finetune
        sweep`, its trials one after another in that child); raises JobBusy while another run is in progress."""
        command = [self.python, "-m", "finetune", verb, str(config_path), *(overrides or []), "-q"]
        return self._launch(command, config_path, run_dir, owner, env)

    def follow_job(self, run_dir: Path, owner: str | None = None, env: dict[str, str] | None = None,
                   launched: float | None = None) -> JobStatus:
        """Re-attach to the job of `run_dir` on its backend (`finetune jobs follow RUN -q`: it follows the job's
        events and ends as the job does), as the current run; events from `launched` on are this session's."""
        command = [self.python, "-m", "finetune", "jobs", "follow", str(run_dir), "-q"]
        return self._launch(command, run_dir / "config.yaml", run_dir, owner, env, launched, reattach=True)

    def _launch(self, command: list[str], config_path: Path, run_dir: Path, owner: str | None,
                env: dict[str, str] | None, launched: float | None = None, reattach: bool = False) -> JobStatus:
        with self._lock, self.current.launching():
            current = self.status()
            if current.active:
                raise JobBusy(_busy_message(current))
            if elsewhere := self.current.other_app(getattr(self._job, "pid", None)):
                raise JobBusy(elsewhere)
            if not reattach:  # a re-attach follows the same job on: the launcher that went away did not end it
                self._record_end(current)
            log_path = run_dir / "launch.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a", encoding="utf-8") as log:
                log.write(f"$ {' '.join(command[1:])}\n")
                log.flush()
                # A new session: Stop signals the whole group, and closing the browser tab (or the app) does not
                # take the run down with it.
                proc = spawn(command, log, env if env is not None else os.environ if self.env is None else self.env)
            self._job = _Job(run_dir=run_dir, config_path=config_path, log_path=log_path, command=command,
                             pid=proc.pid, proc=proc, launched=launched or time.time() - 1.0, owner=owner)
            self._save_current()
            threading.Thread(target=self._follow, args=(self._job,), daemon=True).start()  # to its end
            return self.status()

    def submit(self, config_path: Path, run_dir: Path, overrides: list[str] | None = None,
               owner: str | None = None, verb: str = "train") -> int:
        """Start the run now (0), or while another run is in progress (or others wait) put it at the end of the
        queue: its position then (1: it starts next). `JobBusy` when that run folder is already training or queued."""
        with self._lock, self.queue.locked():
            if taken := self.taken(run_dir):
                raise JobBusy(taken)
            queue = self.queue.entries()
            current = self.status()
            if not current.active and not queue:
                self.start(config_path, run_dir, overrides, owner, verb=verb)
                return 0
            self.queue.write([*queue, Queued(run_dir=run_dir, config_path=config_path,
                                             overrides=tuple(overrides or ()), owner=owner, queued_at=time.time(),
                                             verb=verb)])
        self._advance()  # the run in progress may have ended while this one was queued
        return self.queue.position(run_dir) or 0

    def taken(self, run_dir: Path) -> str:
        """Why no Start may go into `run_dir` now: it is training or waiting in the queue ("" when it may). Asked
        before Start writes anything in the folder, and again when the run is submitted."""
        current, here = self.status(), run_dir.resolve()
        busy = [q.run_dir for q in self.queue.entries()] + ([current.run_dir] if current.active else [])
        if any(p.resolve() == here for p in busy):
            return ALREADY
        # a run in progress here queues it; another app's does not
        return "" if current.active else self.current.other_app(getattr(self._job, "pid", None))

    def cancel(self, run_dir: Path) -> Queued | None:
        """Take `run_dir` off the queue; the entry taken off, or None when it was not queued (it may have started)."""
        with self._lock, self.queue.locked():
            queue = self.queue.entries()
            taken = next((q for q in queue if q.run_dir == run_dir), None)
            if taken is not None:
                self.queue.write([q for q in queue if q is not taken])
            return taken

    def _advance(self) -> None:
        """Start the first queued run if no run is in progress (a queued run whose folder is gone is dropped)."""
        if self._closing or not self.queue.entries():  # nothing waits (a run queued meanwhile advances itself)
            return
        with self._lock, self.queue.locked():
            if self._closing or self.status().active:
                return
            try:  # another app process (one ending as this one starts) may have started it already: follow that
                launched = float((self.current.read() or {})["launched"])
            except (KeyError, ValueError, TypeError):
                launched = 0.0
            if self._job is not None and launched > self._job.launched:
                self._adopt()
                if self.status().active:
                    return
            # another app process's run: that process starts the next run when its run ends
            if self.current.other_app(getattr(self._job, "pid", None)):
                return
            queue = self.queue.entries()
            while queue:
                first = queue.pop(0)
                self.queue.write(queue)
                if first.run_dir.is_dir():
                    self.start(first.config_path, first.run_dir, list(first.overrides), first.owner,
                               verb=first.verb)
                    return

    def _record_end(self, ended: JobStatus) -> None:
        """Write how the previous run ended into its launch log, once it is no longer the current run: a run stopped
        (or killed) before it wrote an event of its end is then "Stopped" on the Runs tab too, not "Failed"."""
        if self._job is not None and ended.state in ("stopped", "failed", "done"):
            with open(self._job.log_path, "a", encoding="utf-8") as log:
                log.write(f"{ENDED}{ended.state}\n")

    def resume(self, run_dir: Path, owner: str | None = None) -> JobStatus:
        """Continue a stopped run from its latest checkpoint (`finetune train RUN/config.yaml resume=true`)."""
        return self.start(run_dir / "config.yaml", run_dir, ["resume=true"], owner)

    # --- stopping
    def stop(self) -> str:
        """First call: SIGINT (finish the step, checkpoint, exit). Second call, or after a timeout: kill the group."""
        with self._lock:
            job = self._job
            if job is None or not self.status().active:
                return "No run is in progress."
            if job.stop_requested_at is None:
                job.stop_requested_at = time.time()
                self._save_current()
                signal_group(job.pid, signal.SIGINT)
                threading.Thread(target=self._kill_after_timeout, args=(job,), daemon=True).start()
                return ("Stopping after the current optimizer step: a checkpoint is saved and the run can be resumed. "
                        "Press Stop again to kill it at once.")
            self._kill(job)
            return "Killed the run. It resumes from its last checkpoint, if it wrote one."

    def _kill(self, job: _Job) -> None:
        job.killed = True
        self._save_current()
        signal_group(job.pid, signal.SIGKILL)
        if job.proc is not None:
            job.proc.wait(timeout=30)

    def _kill_after_timeout(self, job: _Job) -> None:
        deadline = (job.stop_requested_at or time.time()) + self.stop_timeout
        while time.time() < deadline:
            if not self._running(job):
                return
            time.sleep(0.5)
        with self._lock:
            if self._running(job):
                self._kill(job)

    def _follow(self, job: _Job) -> None:
        """Stop `job` at the server's time limit (with a checkpoint), and once it has ended start the first queued
        run."""
        limit_s = self.max_run_s
        while self._running(job):
            if limit_s is not None and job.stop_requested_at is None and time.time() - job.launched >= limit_s:
                with self._lock:
                    if self._job is job and job.stop_requested_at is None and self._running(job):
                        job.time_limit_min = limit_s / 60
                        self.stop()
            time.sleep(WATCH_INTERVAL_S)
        if self._job is job:
            self._advance()

    def shutdown(self, grace_s: float) -> str:
        """The app is going away (SIGTERM, `docker stop`): stop the run with a checkpoint and wait up to `grace_s`
        for it to exit; says what happened. No queued run starts after it: the next app process starts them."""
        self._closing = True
        status = self.status()
        if not status.active:
            return ""
        job = self._job
        self.stop()
        deadline = time.time() + grace_s
        while time.time() < deadline and self._running(job):
            time.sleep(0.2)
        if self._running(job):
            return (f"The run in {status.run_dir} did not stop within {grace_s:g} s; it may be killed without a new "
                    "checkpoint (give the container more time, e.g. `docker stop -t 120`).")
        return f"The run in {status.run_dir} stopped with a checkpoint; Resume continues it."

    # --- status
    def _running(self, job: _Job) -> bool:
        if job.proc is not None:
            return job.proc.poll() is None
        return alive(job.pid)

    def status(self) -> JobStatus:
        """The current or last run's state, events, exit code and messages."""
        with self._lock:
            job = self._job
            if job is None:
                return JobStatus(state="idle")
            if is_sweep(job.command):
                return _sweep_status(job, running=self._running(job))
            events = job.events()
            mine = [e for e in events if e.get("time", 0) >= job.launched]
            output = session_output(job.log_path)
            rc = job.proc.poll() if job.proc is not None else None
            running = rc is None and self._running(job)
            state, message = self._state(job, mine, rc, running, output)
            tail = "\n".join(output.splitlines()[-12:])
            latest = None
            finished = (job.run_dir / "metrics.json").is_file() or any(e.get("event") == "done" for e in events)
            if state in ("stopped", "failed") and not finished:
                latest = next(iter(reversed(checkpoints(job.run_dir))), None)
            return JobStatus(state=state, run_dir=job.run_dir, events=events, returncode=rc, message=message,
                             output_tail=tail, command=" ".join(job.command[1:]), config_path=job.config_path,
                             owner=job.owner, latest_checkpoint=latest)

    def _state(self, job: _Job, mine: list[dict[str, Any]], rc: int | None, running: bool,
               output: str) -> tuple[str, str]:
        last = next((e for e in reversed(mine) if e.get("event") in TERMINAL), None)
        if running:
            if job.stop_requested_at is not None:
                return "stopping", "Stopping after the current optimizer step…"
            if any(e.get("event") == "done" for e in mine):  # the model is saved; the child is ending
                # Only a run whose config pushes uploads after `done`: any other would flash a push that never was.
                if _pushes(job.config_path):
                    return "running", "Training is done; pushing the model to the Hub…"
                return "running", "Training is done; finishing…"
            started = any(e.get("event") == "start" for e in mine)
            return ("running", "") if started else ("starting", "Loading the data and the model…")
        kind = (last or {}).get("event")
        if kind == "done" or (rc == 0 and kind is None):
            return "done", ""
        if kind == "stopped":
            if job.time_limit_min is not None:
                return "stopped", (f"Stopped: reached the server's time limit of {job.time_limit_min:g} min; the "
                                   "checkpoint is saved. Resume continues the run.")
            return "stopped", f"Stopped at step {last['step']}; the checkpoint is saved. Resume continues the run."
        if kind == "error":
            return "failed", last.get("message") or error_from_output(output)
        if job.killed:
            return "stopped", "The run was killed; Resume continues from its last checkpoint, if it saved one."
        if job.stop_requested_at is not None and (rc in (None, 130, -signal.SIGINT) or _interrupted(output)):
            # Stopped while it started: a resumed run keeps the checkpoint an earlier session saved.
            kept = next(iter(reversed(checkpoints(job.run_dir))), None)
            if kept is not None:
                return "stopped", (f"The run was stopped while it started; its checkpoint of step "
                                   f"{int(kept.name.removeprefix('step-'))} is kept. Resume continues from it.")
            return "stopped", "The run was stopped before it saved a checkpoint."
        # No final event and no signal of ours: something outside the app ended it (an out-of-memory kill, most
        # likely). An adopted run (rc None) that is gone without a final event ended the same way.
        if rc is None or rc < 0:
            return "failed", KILLED
        return "failed", error_from_output(output) or f"The training process exited with code {rc}."

    # --- re-attaching after the app restarts
    def _save_current(self) -> None:
        job = self._job
        record = {"pid": job.pid, "run_dir": str(job.run_dir), "config_path": str(job.config_path),
                  "log_path": str(job.log_path), "command": job.command, "launched": job.launched,
                  "owner": job.owner, "stop_requested_at": job.stop_requested_at, "killed": job.killed,
                  "time_limit_min": job.time_limit_min}
        self.current.write(record)

    def _adopt(self) -> None:
        """Follow the run an earlier app process started, so its progress (or result) shows again."""
        try:
            record = self.current.read() or {}
            job = _Job(run_dir=Path(record["run_dir"]), config_path=Path(record["config_path"]),
                       log_path=Path(record["log_path"]), command=list(record["command"]), pid=int(record["pid"]),
                       proc=None, launched=float(record["launched"]), owner=record.get("owner"),
                       stop_requested_at=record.get("stop_requested_at"), killed=bool(record.get("killed")),
                       time_limit_min=record.get("time_limit_min"))
        except (OSError, ValueError, KeyError, TypeError):
            return
        if alive(job.pid) and not is_finetune(job.pid):
            job.pid = -1  # the id now belongs to an unrelated process: never signal it
        self._job = job
        if self._running(job):
            # the time limit counts from the launch, across app restarts
            threading.Thread(target=self._follow, args=(job,), daemon=True).start()


def _sweep_status(job: _Job, running: bool) -> JobStatus:
    """A sweep's status: its trials' progress, the events of the trial it shows (`app.local.sweeps`)."""
    output = session_output(job.log_path)
    rc = job.proc.poll() if job.proc is not None else None
    progress = read_progress(job.run_dir, job.config_path)
    state, message = sweep_state(progress, name=job.run_dir.name, rc=rc, running=rc is None and running,
                                 stop_requested=job.stop_requested_at is not None, killed=job.killed,
                                 error=error_from_output(output))
    return JobStatus(state=state, run_dir=job.run_dir, events=shown_events(job.run_dir, progress), returncode=rc,
                     message=message, output_tail="\n".join(output.splitlines()[-12:]),
                     command=" ".join(job.command[1:]), config_path=job.config_path, owner=job.owner, sweep=progress)


def _interrupted(output: str) -> bool:
    """Whether the child's output ends in an interrupt's traceback: a Stop that landed while Python still imported
    (an interpreter stopped there may exit 1, not 130)."""
    lines = [line.strip() for line in output.strip().splitlines()]
    return bool(lines) and lines[-1] == "KeyboardInterrupt"
