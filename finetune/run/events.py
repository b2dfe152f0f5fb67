"""The typed event stream of a run: `events.jsonl` for the GUI and scripts, a progress bar for the terminal.

Each line of `events.jsonl` is one JSON object with `event` in start, step, backoff, eval, samples, checkpoint,
stopped, done, push, export, error and `time` (Unix seconds). Tests and the GUI read these records, never printed
text. A checkpoint's path is `checkpoint` in every record that names one.

A run on another machine (a Hugging Face Job, `finetune.remote`) prints each record as one log line, `LOG_PREFIX`
and the JSON (`finetune train --log-events`); the launcher reads them back from the logs with `parse_log_line`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.config.batch import BatchSplit
from finetune.errors import describe, exit_code

if TYPE_CHECKING:  # the record only carries it: importing segments would load numpy and pyarrow for `--help`
    from finetune.rows.segments import Segmentation


@dataclass(frozen=True, kw_only=True)
class Start:
    """A run began (or resumed at `step`); `distributed` is how it really runs (single, ddp, fsdp, deepspeed),
    `note` says when that is not what the launcher asked for, and `startup_s` is how many seconds passed from the
    start of the process to this event (imports, data, plan, model). `segmentation` and `eval_segmentation` say
    what `long_documents` did to the training and evaluation data (None for a stream, whose counts are unknown
    before it is read); their `warning` is set when most samples were truncated."""

    total_steps: int
    steps_per_epoch: int
    num_train_samples: int
    num_eval_samples: int
    batch: BatchSplit  # written flat: micro_batch_size, grad_accum_steps, num_processes, effective_batch_size
    precision: str
    device: str
    run_dir: str
    step: int = 0
    resumed: bool = False
    distributed: str = "single"
    note: str | None = None
    startup_s: float | None = None
    # Conversations left out because they have nothing to learn, per reason (finetune.rows.chat.DROPPED); None if none.
    dropped_rows: dict[str, int] | None = None
    dropped_eval_rows: dict[str, int] | None = None
    segmentation: Segmentation | None = None
    eval_segmentation: Segmentation | None = None
    tasks: dict[str, float] | None = None  # multi-task runs: each task's expected share of a window
    # Columns a kind computed from a model before training (a preference reference, a cached teacher), per part
    # (train, eval): "computed" by this start, or "cached" (read back from the data cache); None if none.
    precomputed: dict[str, str] | None = None
    # What the model's load did with Hugging Face Hub kernels (finetune.models.kernels.KernelUse.to_dict): the
    # option, whether they were asked for, the kernel repositories its layers run, why `auto` went without them.
    kernels: dict[str, Any] | None = None
    tiled_mlp: int | None = None  # positions per tile when the MLPs run tiled (finetune.models.tiled_mlp), else None
    event: str = "start"


@dataclass(frozen=True, kw_only=True)
class Step:
    """One optimizer step; `loss` is the exact window loss, `grad_norm` the norm before clipping."""

    step: int
    epoch: float
    loss: float
    grad_norm: float
    lr: float
    samples: int
    tokens: int
    skipped: int
    samples_per_s: float
    task_losses: dict[str, float] | None = None  # multi-task runs: each task's mean loss in the window
    # The kind's metrics of the window's own batches (its registry entry's `step_metrics`: preference's and reward's
    # rewards/* and logps/*, TRL's names), over all processes.
    metrics: dict[str, float] | None = None
    event: str = "step"


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """Out of memory: optimizer step `step` is retried with a halved micro-batch and doubled accumulation."""

    step: int
    micro_batch_size: int
    grad_accum_steps: int
    message: str
    event: str = "backoff"


@dataclass(frozen=True, kw_only=True)
class Eval:
    """Evaluation metrics after optimizer step `step`."""

    step: int
    epoch: float
    metrics: dict[str, float]
    event: str = "eval"


@dataclass(frozen=True, kw_only=True)
class Samples:
    """After an evaluation, a few of the held-out prompts with what the model generated from them and the reward
    each completion got (a kind that generates while it trains: GRPO); each row has `prompt`, `completion`,
    `reward` (the weighted sum) and `rewards` (each reward function's score by its metric name, None where it gave
    none)."""

    step: int
    rows: list[dict[str, Any]]
    event: str = "samples"


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """A resumable checkpoint was written."""

    step: int
    checkpoint: str
    event: str = "checkpoint"


@dataclass(frozen=True, kw_only=True)
class Stopped:
    """The run stopped on request after a finished optimizer step; `resume=true` continues it."""

    step: int
    checkpoint: str
    event: str = "stopped"


@dataclass(frozen=True, kw_only=True)
class Done:
    """The run finished; `metrics` are the final evaluation and training figures."""

    step: int
    metrics: dict[str, float]
    model_dir: str
    event: str = "done"


@dataclass(frozen=True, kw_only=True)
class Pushed:
    """After `done`, with `push_to_hub`: the model and its card went to `url` (commit `commit`), or `error` says why
    not; the model stays in `model_dir` either way."""

    repo_id: str
    model_dir: str
    url: str | None = None
    commit: str | None = None
    error: str | None = None
    event: str = "push"


@dataclass(frozen=True, kw_only=True)
class Exported:
    """After `done`, `finetune export`: the run's model written as `format` (merged, or gguf with `quant`) to
    `path`; `check` is the behaviour check of a GGUF (llama.cpp against transformers, see finetune.use.export)."""

    format: str
    path: str
    quant: str | None = None
    seconds: float | None = None
    check: dict[str, Any] | None = None
    event: str = "export"


@dataclass(frozen=True, kw_only=True)
class Error:
    """The run failed; `message` is the sentence shown to the user."""

    message: str
    exit_code: int = 1
    event: str = "error"


# Fields that only some runs have (multi-task, a kind's step metrics), left out of the records of the others.
OMITTED_WHEN_NONE = frozenset({"task_losses", "tasks", "metrics"})

Event = Start | Step | Backoff | Eval | Samples | Checkpoint | Stopped | Done | Pushed | Exported | Error


def to_record(event: Event) -> dict[str, Any]:
    """The JSON object written for an event, with `event` first and a timestamp; a batch split's numbers are
    written flat, as top-level keys."""
    record: dict[str, Any] = {"event": event.event, "time": round(time.time(), 3)}
    for name, value in dataclasses.asdict(event).items():
        if name == "event" or (name in OMITTED_WHEN_NONE and value is None):
            continue
        if isinstance(getattr(event, name), BatchSplit):
            record.update(value)
        else:
            record[name] = value
    return record


@dataclass
class EventLog:
    """Sends each event to `events.jsonl` (if a path is given) and to any callbacks, in order."""

    path: Path | None = None
    callbacks: list[Callable[[Event], None]] = field(default_factory=list)
    _line_ends: bool = field(default=False, init=False, repr=False)

    def emit(self, event: Event) -> None:
        """Record one event."""
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                # A process killed mid-write leaves a cut-off last line: start a fresh one, or the first record
                # of this session would be glued to it and lost.
                prefix = "" if self._line_ends or not _ends_mid_line(self.path) else "\n"
                f.write(prefix + json.dumps(to_record(event)) + "\n")
            self._line_ends = True
        for callback in self.callbacks:
            callback(event)

    @contextlib.contextmanager
    def recording_failures(self) -> Iterator[None]:
        """Record an exception raised inside as the run's `error` event (message and exit code), then re-raise."""
        try:
            yield
        except Exception as e:
            self.emit(Error(message=describe(e), exit_code=exit_code(e)))
            raise


LOG_PREFIX = "finetune-event: "  # a record printed on stdout for a launcher that reads the logs


def log_line(event: Event) -> str:
    """The event as one log line: `LOG_PREFIX` and its record."""
    return LOG_PREFIX + json.dumps(to_record(event))


def parse_log_line(line: str) -> dict[str, Any] | None:
    """The record a `log_line` holds, or None for any other line (or a record cut off)."""
    if not line.startswith(LOG_PREFIX):
        return None
    try:
        record = json.loads(line[len(LOG_PREFIX):])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("event"), str) else None


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one record to an `events.jsonl` written by someone else (a mirror of a remote run's events): on a
    fresh line when the last one was cut off."""
    prefix = "\n" if _ends_mid_line(path) else ""
    with open(path, "a", encoding="utf-8") as f:
        f.write(prefix + json.dumps(record) + "\n")


def _ends_mid_line(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except OSError:  # missing or empty
        return False


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The records of an `events.jsonl` file (a partly written last line is skipped)."""
    records = []
    p = Path(path)
    if not p.is_file():
        return records
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class ProgressBar:
    """A tqdm bar fed by step events: loss, lr and samples/s."""

    def __init__(self, disable: bool = False):
        self._bar: Any = None
        self._disable = disable

    def __call__(self, event: Event) -> None:
        from tqdm.auto import tqdm

        if self._disable:
            return
        if isinstance(event, Start):
            self._bar = tqdm(total=event.total_steps, initial=event.step, unit="step", dynamic_ncols=True)
        elif isinstance(event, Step) and self._bar is not None:
            self._bar.update(event.step - self._bar.n)
            self._bar.set_postfix(loss=f"{event.loss:.4f}", lr=f"{event.lr:.2e}", sps=f"{event.samples_per_s:.1f}")
        elif isinstance(event, Backoff) and self._bar is not None:
            self._bar.write(f"step {event.step}: {event.message}")
        elif isinstance(event, Eval) and self._bar is not None:
            self._bar.write(f"step {event.step}: " + ", ".join(f"{k}={v:.4f}" for k, v in event.metrics.items()))
        elif isinstance(event, (Stopped, Done, Error)):
            self.close()

    def say(self, text: str) -> None:
        """A line on stderr, above the bar while one is drawn (a plain print would land after its last frame)."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the bar's line: a job that ended without a final event (ERROR, a kill) leaves it drawn."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
