"""The user's run folders, read for the Runs tab as pure functions: each run's status, metrics and times from its
events and config, the table of runs, the comparison of several (curves, final metrics, the config keys that differ),
one run's whole log, and deleting what finetune wrote in a run folder. A sweep's trials (their `sweep.json`) are listed
together, the best marked; a run's lm-evaluation-harness scores (`benchmarks.json`) are compared beside its base's."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from app import charts, report
from app.local.sweeps import read_progress
from app.local.training import ENDED
from finetune.config.schema import ConfigError, from_dict, read_yaml
from finetune.errors import FinetuneError
from finetune.remote import backend
from finetune.run.events import read_events
from finetune.run.rundir import LAUNCH_FILES, MARKER, checkpoints, clear_run_dir, is_finished

TABLE_COLUMNS = ["Run", "Status", "Task", "Model", "Steps", "Metrics", "Started", "Finished", "Time"]
NOWRAP = {"Run", "Status", "Steps", "Started", "Finished"}  # short cells kept on one line (the others wrap)
NOT_DIFFED = ("output_dir", "resume", "overwrite")  # where a run went, not how it trained
MAX_RUNS = 200  # the newest shown (a runs folder kept for months would make a table nobody reads)
SEARCH_FILE = "summary.json"  # a sweep's own folder: its trials and the best (finetune.sweep.summary)
SWEEP_FILE = "sweep.json"  # a sweep's trial: its sweep, trial number, options and end (finetune.sweep.study)
BENCHMARKS_FILE = "benchmarks.json"  # `finetune eval RUN --benchmarks` (finetune.use.benchmarks.RESULTS)
BENCHMARK_COLUMNS = ["Run", "Task", "Metric", "Fine-tuned", "Base"]


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """One run folder as the Runs tab lists it."""

    name: str
    path: Path
    state: str  # running, starting, stopping, stopped, done, failed
    task: str
    model: str
    step: int | None
    total: int | None
    metrics: dict[str, Any]
    started: float | None
    finished: float | None
    resumable: bool
    position: int | None = None  # its place in the queue, while it waits there (state "queued")
    ran_on: str = ""  # the backend its job.json names, in words ("Slurm"); "" for this machine
    predicted_s: float | None = None  # the plan's predicted wall time, start to Done (plan.json's `time`)
    took_s: float | None = None  # the actual one, for a run that finished in one session
    events: list[dict[str, Any]] = field(repr=False, default_factory=list)
    sweep: dict[str, Any] | None = None  # a sweep's trial: its sweep.json (sweep, trial, state, value, direction)
    best: bool = False  # the best complete trial of its sweep
    search: dict[str, Any] | None = None  # a sweep's own folder: its summary.json (counts, best), once it has one

    @property
    def active(self) -> bool:
        """Whether its training process is (or may still be) running."""
        return self.state in ("starting", "running", "stopping")


def _config_of(path: Path) -> dict[str, Any]:
    """The run's resolved config (config.yaml), or what the app launched it with; {} when neither reads."""
    for name in ("config.yaml", "launch.yaml"):
        try:
            if (path / name).is_file():
                values = read_yaml(path / name)
                values.pop("sweep", None)  # a sweep's folder: its launch.yaml is the trials' base config and the search
                return from_dict(values).to_dict()
        except (ConfigError, OSError, ValueError, yaml.YAMLError):
            continue
    return {}


def clock(stamp: float | None) -> str:
    """A time as the Runs tab shows it ("" for none)."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp)) if stamp else ""


def ended_as(path: Path) -> str | None:
    """How the run's last session ended as the app saw it (its launch log's last line of `ENDED`: a run stopped
    before its first event of an end is "stopped", as the Train tab said); None when it does not say."""
    log = path / "launch.log"
    if not log.is_file():
        return None
    with open(log, "rb") as f:  # its end is enough: the line is written after the session's output
        f.seek(max(0, log.stat().st_size - 65536))
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    last_launch = max((i for i, line in enumerate(lines) if line.startswith("$ ")), default=-1)
    said = [line.removeprefix(ENDED).strip() for line in lines[last_launch + 1:] if line.startswith(ENDED)]
    return said[-1] if said and said[-1] in ("stopped", "failed", "done") else None


def ran_on(path: Path) -> str:
    """Where the run trained, when not on this machine: the title of the backend its job.json names."""
    if not (path / "job.json").is_file():
        return ""
    try:
        return backend.of_run(path).title
    except FinetuneError:  # damaged, or written by another version: the run is still listed
        return ""


def run_info(path: Path, current: Any = None, position: int | None = None) -> RunInfo:
    """What `path` holds: its state (the job manager's `current` status when it is that run, "queued" at
    `position` in the queue), last step, final metrics and times, from its events."""
    events = read_events(path / "events.jsonl")
    config = _config_of(path)
    starts = [e for e in events if e.get("event") == "start"]
    last_start = max((i for i, e in enumerate(events) if e.get("event") == "start"), default=-1)
    final = next((e for e in reversed(events[last_start + 1:]) if e.get("event") in ("done", "stopped", "error")),
                 None)
    if current is not None and current.run_dir is not None and Path(current.run_dir).resolve() == path.resolve() \
            and current.state != "idle":
        state = current.state
    elif position is not None:
        state = "queued"
    else:
        state = {"done": "done", "stopped": "stopped", "error": "failed"}.get((final or {}).get("event")) \
            or ended_as(path) or "failed"
    finished = is_finished(path)
    metrics = dict(next((e["metrics"] for e in reversed(events) if e.get("event") == "done"), None) or {})
    steps = [e["step"] for e in events if e.get("event") == "step"]
    step = max(steps) if steps else (starts[-1].get("step") if starts else None)
    if state == "done" and starts:
        step = starts[-1]["total_steps"]
    stamp = starts[0].get("time") if starts else None
    if stamp is None and (path / MARKER).is_file():
        stamp = (path / MARKER).stat().st_mtime
    search = _json_of(path / SEARCH_FILE) or None
    if search and not events and state == "failed" and ended_as(path) is None:
        # A sweep's folder has no events of its own: it is done when its trials are (else it was cut short).
        state = "done" if read_progress(path, path / "launch.yaml").finished >= (search.get("trials_wanted") or 0) \
            else "stopped"
    sweep = _json_of(path / SWEEP_FILE)
    sweep = sweep if isinstance(sweep.get("sweep"), str) and isinstance(sweep.get("trial"), int) else None
    if sweep is not None and state == "stopped" and sweep.get("state") == "pruned":
        state = "pruned"
    return RunInfo(name=path.name, path=path, state=state, task=config.get("task", ""), model=config.get("model", ""),
                   step=step, total=starts[-1].get("total_steps") if starts else None, metrics=metrics,
                   started=stamp, finished=final.get("time") if final and state in ("done", "stopped", "failed")
                   else None, resumable=state in ("stopped", "failed") and not finished and bool(checkpoints(path)),
                   position=position if state == "queued" else None, ran_on=ran_on(path), events=events,
                   sweep=sweep, search=search, predicted_s=_predicted_s(path),
                   took_s=_took_s(starts, final) if state == "done" else None)


def _json_of(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it is missing or not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}



def _predicted_s(path: Path) -> float | None:
    """The plan's predicted wall time of the run (plan.json's `time`, finetune.plan.timing), if it has one."""
    try:
        predicted = json.loads((path / "plan.json").read_text(encoding="utf-8")).get("time") or {}
    except (OSError, ValueError, AttributeError):
        return None
    return predicted.get("total_s") if isinstance(predicted.get("total_s"), (int, float)) else None


def _took_s(starts: list[dict[str, Any]], final: dict[str, Any] | None) -> float | None:
    """Start to Done of a run that finished in one session: its process's start (its start event less the
    `startup_s` it took to get there) to its done event; None for a resumed run (its sessions' times differ)."""
    if len(starts) != 1 or final is None or not isinstance(starts[0].get("time"), (int, float)):
        return None
    return final["time"] - starts[0]["time"] + float(starts[0].get("startup_s") or 0)


def time_cell(run: RunInfo) -> str:
    """The Time column: the predicted wall time, beside the actual one once the run is done."""
    predicted = f"predicted {_minutes(run.predicted_s)}" if run.predicted_s is not None else ""
    took = f"took {_minutes(run.took_s)}" if run.took_s is not None else ""
    return " · ".join(p for p in (predicted, took) if p)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def list_runs(home: Path, current: Any = None, queued: dict[Path, int] | None = None) -> list[RunInfo]:
    """The run folders directly in `home` (those with the tool's marker), newest first; `queued`: the positions of
    the ones waiting in the queue."""
    if not home.is_dir():
        return []
    folders = [p for p in home.iterdir() if p.is_dir() and not p.is_symlink() and (p / MARKER).is_file()]
    positions = {Path(k).resolve(): v for k, v in (queued or {}).items()}
    runs = _mark_best([run_info(p, current, positions.get(p.resolve())) for p in folders])
    # A sweep's trials side by side, where its newest trial would be.
    newest: dict[str, float] = {}
    for r in runs:
        if r.sweep is not None:
            newest[r.sweep["sweep"]] = max(newest.get(r.sweep["sweep"], 0.0), r.started or 0.0)
    return sorted(runs, key=lambda r: (newest[r.sweep["sweep"]] if r.sweep else r.started or 0, r.name),
                  reverse=True)[:MAX_RUNS]


def _mark_best(runs: list[RunInfo]) -> list[RunInfo]:
    """The runs, the best complete trial of each sweep marked (by its objective, in its direction)."""
    best: dict[str, RunInfo] = {}
    for r in runs:
        if r.sweep is None or r.sweep.get("state") != "complete" or not isinstance(r.sweep.get("value"), (int, float)):
            continue
        sign = -1 if r.sweep.get("direction") == "minimize" else 1
        held = best.get(r.sweep["sweep"])
        # A tie goes to the earlier trial, as the sweep's summary.json picks it (the first of the best).
        if held is None or (sign * r.sweep["value"], -r.sweep["trial"]) > \
                (sign * held.sweep["value"], -held.sweep["trial"]):
            best[r.sweep["sweep"]] = r
    chosen = {id(r) for r in best.values()}
    return [dataclasses.replace(r, best=True) if id(r) in chosen else r for r in runs]


def headline(metrics: dict[str, Any]) -> str:
    """The run's key final metrics in one line (its kind's, then the loss)."""
    keys = [k for k in report.HEADLINE_METRICS if isinstance(metrics.get(k), (int, float))]
    return ", ".join(f"{k} {metrics[k]:.4f}" for k in keys[:3])


def runs_frame(runs: list[RunInfo]) -> pd.DataFrame:
    """The runs as the tab's table."""
    rows = [[r.name, status_title(r), r.task,
             r.model, f"{r.step}/{r.total}" if r.total else "", headline(r.metrics), clock(r.started),
             clock(r.finished), time_cell(r)] for r in runs]
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def runs_html(frame: pd.DataFrame) -> str:
    """The runs table as the tab draws it: one <table>, its header and body in the same columns, in a region that
    scrolls sideways in a narrow window (a keyboard can focus and scroll it); a sentence when there are no runs.

    Gradio's Dataframe drew its header and its body as two tables: at 400 px the body's columns shrank to a few
    letters, no longer under their titles."""
    if frame.empty:
        return '<p class="ft-runs-empty">No runs yet: the runs you start appear here.</p>'
    head = "".join(f'<th scope="col">{escape(c)}</th>' for c in frame.columns)
    nowrap = [' class="ft-nowrap"' if column in NOWRAP else "" for column in frame.columns]
    rows = "".join("<tr>" + "".join(f"<td{cls}>{escape(str(value))}</td>" for cls, value in zip(nowrap, row,
                                                                                                 strict=True))
                   + "</tr>" for row in frame.itertuples(index=False))
    return (f'<div class="ft-runs" role="region" aria-label="Your runs" tabindex="0"><table><thead><tr>{head}</tr>'
            f"</thead><tbody>{rows}</tbody></table></div>")


def status_title(run: RunInfo) -> str:
    """The run's status as the table shows it: "Stopped (resumable)", "Queued (position 2)", "Done on Slurm"."""
    title = report.STATE_TITLES.get(run.state, run.state) + (f" on {run.ran_on}" if run.ran_on else "")
    if run.position is not None:
        return f"{title} (position {run.position})"
    trial = f" · sweep {run.sweep['sweep']} #{run.sweep['trial']}" + (" ★ best" if run.best else "") \
        if run.sweep else ""
    return title + (" (resumable)" if run.resumable else "") + trial + _search_words(run.search)


def _search_words(search: dict[str, Any] | None) -> str:
    """A sweep's folder in the Runs table: " · sweep of 6 trials (2 pruned) · best #3" ("" for any other run)."""
    if not search or not isinstance(search.get("trials"), list):
        return ""
    counts = search.get("counts") if isinstance(search.get("counts"), dict) else {}
    pruned = f" ({counts['pruned']} pruned)" if counts.get("pruned") else ""
    best = search.get("best") if isinstance(search.get("best"), dict) else None
    return f" · sweep of {len(search['trials'])} trials{pruned}" + (f" · best #{best.get('number')}" if best else "")


def compare_frame(runs: list[RunInfo]) -> pd.DataFrame:
    """The training and evaluation loss of each run, as `charts.loss_chart_html` draws it: one colour per run
    (`train/<run>` solid, `eval/<run>` dashed with points)."""
    frames = []
    for r in runs:
        frame = charts.loss_frame(r.events)
        frame = frame[frame.split.isin(("train", "eval"))].copy()
        frame["split"] = frame.split + "/" + r.name
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else charts.loss_frame([])


def metrics_frame(runs: list[RunInfo]) -> pd.DataFrame:
    """The final metrics of each run, one row per run (a metric a run lacks is empty)."""
    keys = list(dict.fromkeys(k for r in runs for k, v in r.metrics.items() if isinstance(v, (int, float))))
    rows = [[r.name, report.STATE_TITLES.get(r.state, r.state),
             *[round(float(r.metrics[k]), 4) if isinstance(r.metrics.get(k), (int, float)) else None for k in keys]]
            for r in runs]
    return pd.DataFrame(rows, columns=["Run", "Status", *keys])


def benchmarks_frame(runs: list[RunInfo]) -> pd.DataFrame:
    """Each run's lm-evaluation-harness scores (its benchmarks.json), the fine-tuned model beside its base, per task
    and metric: value ± the harness's standard error ("" where the base was not scored)."""
    rows = []
    for r in runs:
        record = _json_of(r.path / BENCHMARKS_FILE)
        tasks = (record.get("model") or {}).get("tasks") or {}
        base = (record.get("base") or {}).get("tasks") or {}
        for task, result in tasks.items():
            for metric, score in (result.get("metrics") or {}).items():
                theirs = ((base.get(task) or {}).get("metrics") or {}).get(metric)
                rows.append([r.name, task, metric, _score(score), _score(theirs)])
    return pd.DataFrame(rows, columns=BENCHMARK_COLUMNS)


def _score(score: Any) -> str:
    """A harness score as "0.8750 ± 0.0690"."""
    if not isinstance(score, dict) or not isinstance(score.get("value"), (int, float)):
        return ""
    stderr = score.get("stderr")
    return f"{score['value']:.4f}" + (f" ± {stderr:.4f}" if isinstance(stderr, (int, float)) else "")


def config_diff(runs: list[RunInfo]) -> pd.DataFrame:
    """Only the config keys whose values differ between the runs: one row per key, one column per run."""
    configs = [_config_of(r.path) for r in runs]
    keys = list(dict.fromkeys(k for c in configs for k in c if k not in NOT_DIFFED))
    shown = [[k, *[_shown(c.get(k, "—")) for c in configs]] for k in keys
             if len({repr(c.get(k, "—")) for c in configs}) > 1]
    return pd.DataFrame(shown, columns=["Option", *[r.name for r in runs]])


def _shown(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return "" if value is None else str(value)


def full_log(run: RunInfo) -> str:
    """The run's whole log: every event as a readable line, then all that its training process printed."""
    lines, total = [], None
    for e in run.events:
        if e.get("event") == "start":
            total = e.get("total_steps")
        try:
            line = report.event_line(e, total)
        except (KeyError, TypeError, ValueError):  # an event from another version of the tool: shown as it is
            line = str(e)
        if line:
            lines.append(line)
    text = "\n".join(lines)
    output = run.path / "launch.log"
    if output.is_file():
        text += "\n\n--- output of the training process ---\n" + output.read_text(encoding="utf-8", errors="replace")
    return text + "\n"


def delete_run(path: Path) -> list[Path]:
    """Remove what finetune and the app wrote in the run folder (`clear_run_dir` and the launch files) and the
    folder once empty; returns the files kept (ones a person added)."""
    kept = clear_run_dir(path)
    for name in LAUNCH_FILES:
        (path / name).unlink(missing_ok=True)
    leftovers = sorted(p for p in path.rglob("*") if p.is_file() or p.is_symlink())
    if not leftovers:
        shutil.rmtree(path)
    return sorted({*kept, *leftovers})


