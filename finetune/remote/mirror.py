"""The local copy of a remote run's events, read from its logs, and what the job's end means for the run.

The job's `finetune train --log-events` prints every record of its `events.jsonl` as one log line
(`finetune.run.events.log_line`). `Mirror` appends each one, once, to the local run folder's `events.jsonl`, its
paths (`run_dir`, `model_dir`, `checkpoint`) moved from the job's run folder to the local one: the GUI's curves and
status read it as they read a local run's. A log stream is replayed from the job's first line each time it is opened
(a re-attach, a reconnect), so the mirror counts: the records already in the file are skipped, never written twice.
`outcome` turns the job's final stage and the records into the exit code a local run would have had.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config.batch import BatchSplit
from finetune.errors import EXIT_STOPPED
from finetune.remote.timelimit import format_duration
from finetune.rows.segments import Segmentation
from finetune.run.events import (
    Backoff,
    Checkpoint,
    Done,
    Error,
    Eval,
    Event,
    Exported,
    Pushed,
    Samples,
    Start,
    Step,
    Stopped,
    append_record,
    parse_log_line,
    read_events,
)

_CLASSES = {cls.__dataclass_fields__["event"].default: cls
            for cls in (Start, Step, Backoff, Eval, Samples, Checkpoint, Stopped, Done, Pushed, Exported, Error)}


def from_record(record: dict[str, Any]) -> Event | None:
    """The typed event of a record `to_record` wrote (None for a kind this version does not know): the batch split
    gathered from its flat keys, a segmentation rebuilt, unknown keys left out."""
    cls = _CLASSES.get(record.get("event"))  # type: ignore[arg-type]
    if cls is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)} - {"event"}
    values = {k: v for k, v in record.items() if k in names}
    try:
        if cls is Start:
            values["batch"] = BatchSplit(**{f.name: record[f.name] for f in dataclasses.fields(BatchSplit)})
            for key in ("segmentation", "eval_segmentation"):
                if isinstance(values.get(key), dict):
                    values[key] = Segmentation(**values[key])
        return cls(**values)
    except (KeyError, TypeError):  # a record missing a field its class needs
        return None


class Mirror:
    """Appends the records of one job's log lines to `run_dir/events.jsonl`, each once. `events_before` is how many
    records the file held when the job was launched (the earlier jobs of a resumed run)."""

    def __init__(self, run_dir: Path, remote_dir: str, events_before: int = 0):
        self.path = Path(run_dir) / "events.jsonl"
        self.local_dir = str(run_dir)
        self.remote_dir = remote_dir.rstrip("/")
        self.events_before = events_before
        self.have = max(0, len(read_events(self.path)) - events_before)
        self.seen = 0

    def restart(self) -> None:
        """A new log stream begins: it replays the job's records from the first."""
        self.seen = 0

    def feed(self, line: str) -> dict[str, Any] | None:
        """The record a log line carries, written to the file if it is new (None for any other line, or one that
        is there already)."""
        record = parse_log_line(line.rstrip("\n"))
        if record is None:
            return None
        self.seen += 1
        if self.seen <= self.have:
            return None
        record = self.localised(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_record(self.path, record)
        self.have += 1
        return record

    def localised(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record with the job's run-folder paths moved to the local run folder."""
        def move(value: Any) -> Any:
            if isinstance(value, str) and (value == self.remote_dir or value.startswith(self.remote_dir + "/")):
                return self.local_dir + value[len(self.remote_dir):]
            return value

        return {k: move(v) for k, v in record.items()}

    def job_records(self) -> list[dict[str, Any]]:
        """This job's records so far (those of earlier jobs of a resumed run left out)."""
        return read_events(self.path)[self.events_before:]


@dataclass(frozen=True)
class Outcome:
    """How the run ended on the job: `status` done, stopped or failed, the exit code a local run would have had,
    and one sentence."""

    status: str
    exit_code: int
    message: str
    stage: str

    def to_dict(self) -> dict[str, Any]:
        """As job.json records it."""
        return dataclasses.asdict(self)


def _last(records: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((r for r in reversed(records) if r.get("event") == kind), None)


def outcome(stage: str, message: str | None, records: list[dict[str, Any]], *, running_s: int | None,
            timeout_s: int, resume_command: str, last_error_line: str | None = None) -> Outcome:
    """What the job's final `stage` means: COMPLETED is done (0); CANCELED, a `stopped` record (the run asked to
    stop before the time limit) or a job that ran into its limit are stopped (130, resumable from the newest
    checkpoint in the bucket); any other end is failed, with the run's own `error` record (its message and exit
    code) when it wrote one, else the job's message or its last `error:` line."""
    checkpoint = _last(records, "checkpoint") or _last(records, "stopped")
    resume = (f"continue from its checkpoint (step {checkpoint['step']}) with `{resume_command}`" if checkpoint
              else "it had not written a checkpoint yet, so start it again")
    if stage == "COMPLETED":
        done = _last(records, "done")
        step = f" after {done['step']} steps" if done else ""
        return Outcome("done", 0, f"The job completed{step}.", stage)
    stopped = _last(records, "stopped")
    hit_limit = running_s is not None and running_s >= timeout_s - 60 or "timeout" in (message or "").lower() \
        or "timed out" in (message or "").lower()
    if stage == "CANCELED":
        return Outcome("stopped", EXIT_STOPPED, f"The job was cancelled; {resume}.", stage)
    if stopped is not None or hit_limit:
        return Outcome("stopped", EXIT_STOPPED, f"The job reached its time limit of {format_duration(timeout_s)} "
                       f"and was stopped; {resume} (give a longer --timeout).", stage)
    error = _last(records, "error")
    if error is not None:
        return Outcome("failed", int(error.get("exit_code") or 1), str(error.get("message")), stage)
    why = message or (last_error_line.removeprefix("error:").strip() if last_error_line else None)
    detail = f": {why}" if why else " (its logs say why)"
    return Outcome("failed", 1, f"The job ended with {stage}{detail}.", stage)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM (a `kill`, the app) cancels the job as Ctrl-C does


def follow_cancelling(run: Callable[[], Outcome], cancel: Callable[[], None], bar: Any, notice: str) -> Outcome | None:
    """`run()` (a backend's follower) until the job ends; Ctrl-C or SIGTERM says `notice`, `cancel()`s the job and
    follows it to its end. None when a second Ctrl-C leaves without waiting. The progress bar is closed before
    anything after it is said, so a job's last sentence is on a line of its own."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        try:
            return run()
        except KeyboardInterrupt:
            bar.close()
            print(notice, file=sys.stderr, flush=True)
            cancel()
            try:
                return run()
            except KeyboardInterrupt:
                return None
    finally:
        signal.signal(signal.SIGTERM, previous)
        bar.close()
