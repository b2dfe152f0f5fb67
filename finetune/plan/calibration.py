"""The time calibration the planner keeps: what finished runs really took, so that the next prediction of the same
kind on the same device is corrected by them (docs/planning.md, "Time and cost").

After each run that finishes in one session, one line goes to `$XDG_CACHE_HOME/finetune/timing.jsonl` (by default
`~/.cache/finetune/timing.jsonl`), read from the run's own `plan.json` and `events.jsonl`: its kind, device and
model, the step and evaluation time the arithmetic predicted (FLOPs ÷ the probed rate, before any calibration) and
what they really took, and its fixed costs: start-up (process start to the start event: imports, data, model, plan)
and finishing (checkpoints, the saved model, to Done).

The next prediction of the same kind and device (`for_prediction`) takes the `RECENT` newest records, those of the
same model if there are any: its step time is its FLOPs × the median of their actual seconds per FLOP of a step,
the same for the evaluations, and its start-up and finishing are their medians. A median, not a mean: one run
slowed by other work on the machine moves it little. This moment's probe is not used once there are records: a
0.3 s probe samples one moment, a record a whole run, and on a shared machine scaling the records by the probe's
ratio made the prediction worse, not better (bench/time_estimate.py, docs/planning.md "Time and cost"). The file
is small (`KEPT` lines at most) and always safe to delete; one that cannot be read is ignored, with one line saying
so.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

log = logging.getLogger(__name__)

RECENT = 5  # records a prediction uses: enough for a median to leave out one disturbed run
KEPT = 200  # lines the file keeps, newest last


@dataclass(frozen=True, kw_only=True)
class Record:
    """One finished run's predicted and actual times (seconds)."""

    kind: str
    device: str
    model: str
    steps: int
    predicted_s: float  # the plan's total, start to Done, as it was predicted (calibrated or not)
    actual_s: float  # process start to Done
    arithmetic_step_s: float  # the step time from FLOPs ÷ the probed rate, before calibration
    step_s: float  # an optimizer step's actual mean time, evaluations and saves left out
    arithmetic_eval_s: float  # all evaluations from the arithmetic, before calibration
    eval_s: float  # all evaluations' actual time
    flops_per_step: float  # the arithmetic's FLOPs of one optimizer step
    eval_flops: float  # and of all evaluations together
    startup_s: float  # process start to the start event
    finish_s: float  # checkpoints, the saved model, to Done
    time: float  # when the run finished (Unix seconds)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What the records of a kind and device say: seconds per FLOP of a step and of an evaluation, and fixed costs."""

    step_s_per_flop: float
    eval_s_per_flop: float
    startup_s: float
    finish_s: float
    runs: int
    same_model: bool

    def words(self) -> str:
        """The basis of a calibrated prediction, in words."""
        of = "this model's" if self.same_model else "this kind's"
        return f"{of} last {self.runs} finished run{'s' * (self.runs != 1)} here"


def path() -> Path:
    """The calibration file: the user's cache folder (XDG_CACHE_HOME), beside the plan and data caches."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune" / "timing.jsonl"


def read(file: Path | None = None) -> list[Record]:
    """The records of the calibration file, oldest first; [] (and one line logged) for a file that cannot be read."""
    file = file or path()
    try:
        lines = file.read_text(encoding="utf-8").splitlines() if file.is_file() else []
    except (OSError, UnicodeDecodeError) as e:
        log.warning("The time calibration %s cannot be read (%s); predictions use the arithmetic alone.", file, e)
        return []
    records = _parse(lines)
    if records is None:
        log.warning("The time calibration %s is not what finetune writes; it is ignored (delete it to start a new "
                    "one).", file)
    return records or []


def _parse(lines: list[str]) -> list[Record] | None:
    """The records of the file's lines; None if any line is not one."""
    names = {f.name for f in fields(Record)}
    try:
        records = [Record(**{k: v for k, v in json.loads(line).items() if k in names})
                   for line in lines if line.strip()]
    except (ValueError, TypeError, AttributeError):
        return None
    # The types too: a prediction divides by these numbers.
    wrong = any(not isinstance(getattr(r, f.name), str if f.type == "str" else (int, float)) or
                isinstance(getattr(r, f.name), bool) for r in records for f in fields(Record))
    return None if wrong else records


def for_prediction(kind: str, device: str, model: str, records: list[Record] | None = None) -> Calibration | None:
    """The calibration of a run of `kind` on `device` from the newest records (see the module); None without any."""
    records = [r for r in (read() if records is None else records)
               if r.kind == kind and r.device == device and r.flops_per_step > 0]
    same = [r for r in records if r.model == model]
    recent = (same or records)[-RECENT:]
    if not recent:
        return None
    evaluated = [r.eval_s / r.eval_flops for r in recent if r.eval_flops > 0 and r.eval_s > 0]
    per_flop = statistics.median(r.step_s / r.flops_per_step for r in recent)
    return Calibration(step_s_per_flop=per_flop,
                       eval_s_per_flop=statistics.median(evaluated) if evaluated else per_flop,
                       startup_s=statistics.median(r.startup_s for r in recent),
                       finish_s=statistics.median(r.finish_s for r in recent), runs=len(recent), same_model=bool(same))


def from_run(run_dir: Path, *, kind: str, model: str) -> Record | None:
    """A finished run's record from its plan.json and events.jsonl; None for a run that cannot calibrate anything:
    no predicted time (a stream), resumed (its sessions' times differ), or not done."""
    try:
        predicted = json.loads((run_dir / "plan.json").read_text(encoding="utf-8")).get("time") or {}
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(predicted, dict):
        return None
    events = _events(run_dir / "events.jsonl")
    starts = [e for e in events if e.get("event") == "start"]
    numbers = [predicted.get(k) for k in ("arithmetic_step_s", "total_s", "flops_per_step", "rate_flops")]
    if not all(isinstance(n, (int, float)) and n > 0 for n in numbers) or len(starts) != 1 \
            or starts[0].get("resumed"):
        return None
    # Each span between two records is what the later one ends: a step, an evaluation (and the samples it
    # generates), or a save (checkpoints, the model, Done).
    spent = {"step": 0.0, "eval": 0.0, "finish": 0.0}
    previous, steps, done = starts[0]["time"], 0, None
    for e in events[events.index(starts[0]) + 1:]:
        name = e.get("event")
        span = e["time"] - previous
        previous = e["time"]
        if name in ("step", "backoff"):
            spent["step"] += span
            steps += name == "step"
        elif name in ("eval", "samples"):
            spent["eval"] += span
        elif name in ("checkpoint", "done"):
            spent["finish"] += span
        if name == "done":
            done = e
            break
    if done is None or not steps:
        return None
    startup = float(starts[0].get("startup_s") or 0.0)
    return Record(kind=kind, device=predicted.get("device_key") or "", model=model, steps=steps,
                  predicted_s=predicted["total_s"], actual_s=round(startup + done["time"] - starts[0]["time"], 3),
                  arithmetic_step_s=predicted["arithmetic_step_s"], step_s=round(spent["step"] / steps, 5),
                  arithmetic_eval_s=float(predicted.get("arithmetic_eval_s") or 0.0), eval_s=round(spent["eval"], 3),
                  flops_per_step=predicted["flops_per_step"],
                  eval_flops=float(predicted.get("arithmetic_eval_s") or 0.0) * predicted["rate_flops"],
                  startup_s=startup, finish_s=round(spent["finish"], 3), time=done["time"])


def record_run(run_dir: Path, *, kind: str, model: str, file: Path | None = None) -> Record | None:
    """Add a finished run's record to the calibration file (keeping the newest `KEPT`); the record, or None."""
    record = from_run(run_dir, kind=kind, model=model)
    if record is None:
        return None
    file = file or path()
    lines = [*_lines(file), json.dumps(asdict(record))][-KEPT:]
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f"{file.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(file)  # whole or not at all: two runs finishing together each keep a readable file
    except OSError as e:
        log.warning("The time calibration %s cannot be written (%s); the next prediction is not corrected by this "
                    "run.", file, e)
    return record


def _lines(file: Path) -> list[str]:
    """The file's lines that hold records: none of a file `read` ignores (writing replaces it)."""
    try:
        lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError):
        return []
    return lines if _parse(lines) is not None else []


def _events(file: Path) -> list[dict]:
    """The records of an events.jsonl (the plan sits below finetune.run, which writes them); a cut-off line is
    skipped."""
    records = []
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("time"), (int, float)):
            records.append(record)
    return records
