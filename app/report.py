"""A run's events in words, as every tab says them: the state's title, the headline metrics, one line per event,
what became of the data, the final metrics, and the command that reproduces the run."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.mapping import in_form_words, plain_words
from finetune import registry as kinds
from finetune.config.schema import read_yaml
from finetune.errors import ConfigError
from finetune.rows.chat import describe_dropped
from finetune.rows.segments import Segmentation

if TYPE_CHECKING:
    from app.local.training import JobStatus

# A finished run's headline metrics, every kind's (its registry entry), then the loss: a run has only its own kind's.
HEADLINE_METRICS = (*dict.fromkeys(m for n in kinds.names() for m in kinds.entry(n).metrics), "loss")
STATE_TITLES = {"idle": "Ready", "queued": "Queued", "starting": "Starting", "running": "Training",
                "stopping": "Stopping", "stopped": "Stopped", "done": "Done", "failed": "Failed",
                # A sweep's trial that median pruning stopped (its sweep.json says so): never resumed.
                "pruned": "Pruned"}


def data_lines(facts: dict[str, Any] | None, plain: bool = False) -> list[str]:
    """What `long_documents` did to the data, from a start event or a plan: one line per data set, then any
    warning, in the form's words (Markdown, or `plain` text for the log)."""
    words = plain_words if plain else in_form_words
    lines, warnings = [], []
    for name, key in (("training data", "segmentation"), ("evaluation data", "eval_segmentation")):
        counts = (facts or {}).get(key)
        if isinstance(counts, dict):
            lines.append(f"{name}: {words(Segmentation(**counts).sentence())}")
            warnings += [f"⚠️ {words(counts['warning'])}"] if counts.get("warning") else []
    return lines + warnings


def final_metrics(status: JobStatus) -> dict[str, Any]:
    """The `done` event's metrics (empty until the run finishes)."""
    done = status.last("done")
    return dict(done["metrics"]) if done and status.state == "done" else {}


def event_line(event: dict[str, Any], total: int | None) -> str | None:
    """One event as a line of the log (its clock time first), or None for an event the log does not show."""
    kind = event.get("event")
    clock = time.strftime("%H:%M:%S", time.localtime(event.get("time", 0)))
    if kind == "start":
        what = "resumed" if event.get("resumed") else "started"
        return (f"{clock} {what} at step {event['step']} of {event['total_steps']}: micro-batch "
                f"{event['micro_batch_size']} × accumulation {event['grad_accum_steps']} × {event['num_processes']} "
                "process(es) = "
                f"{event['effective_batch_size']}, {event['precision']} on {event['device']}"
                + "".join(f"\n{clock} {what} data: {describe_dropped(event[key])}"
                          for what, key in (("training", "dropped_rows"), ("evaluation", "dropped_eval_rows"))
                          if event.get(key))
                + "".join(f"\n{clock} {line}" for line in data_lines(event, plain=True)))  # the log is not Markdown
    if kind == "step":
        return (f"{clock} step {event['step']}/{total or '?'} loss {event['loss']:.4f} lr {event['lr']:.2e} "
                f"grad {event['grad_norm']:.3g} {event['samples_per_s']:.1f} samples/s")
    if kind == "eval":
        return f"{clock} eval @ {event['step']}: " + ", ".join(f"{k} {v:.4f}" for k, v in event["metrics"].items())
    if kind == "checkpoint":
        return f"{clock} checkpoint {event['checkpoint']}"
    if kind == "stopped":
        return f"{clock} stopped at step {event['step']} (checkpoint {event['checkpoint']})"
    if kind == "done":
        return f"{clock} done: model in {event['model_dir']}"
    if kind == "error":
        return f"{clock} error: {event['message']}"
    if kind == "push":
        where = event.get("url") or f"{event['repo_id']} failed: {event.get('error')}"
        return f"{clock} push: {where}"
    return None


def waiting_note(status: JobStatus) -> str:
    """What Try it and Export say before there is a finished model to use: why not yet, and what to do."""
    if status.active:
        return "The run is training: its model can be used here once the run has finished."
    if status.state in ("stopped", "failed"):
        return ("The last run did not finish, so there is no model to use yet: resume it (Run panel) or train "
                "another to the end on the Train tab.")
    return "No trained model yet: train a run to the end on the Train tab, then use its model here."


def display_path(path: Path | str) -> str:
    """`path` relative to the working directory when it is inside it (shorter, and what a CLI user would type)."""
    given = Path(path)
    try:
        return str(given.resolve().relative_to(Path.cwd().resolve())) if given.is_absolute() else str(given)
    except ValueError:
        return str(given)


def waits_for(position: int) -> str:
    """What a run at `position` in the queue waits for, in words."""
    return "the run in progress ends" if position == 1 else f"the {position} runs before it end"


def queued_words(position: int) -> str:
    """What a Start (or Resume) that was queued says."""
    return (f"Queued, position {position}: it starts by itself when {waits_for(position)}; Cancel takes it off "
            "the queue.")


def shown_path(path: Path | str, runs_dir: Path, shared: bool) -> str:
    """`path` as a message shows it: locally as `display_path` does; on a shared server by its place in the runs
    folder (`runs/<user>/<run>/…`, the folder by its name alone), never by where the server keeps it."""
    if not shared:
        return display_path(path)
    try:
        inside = Path(path).resolve().relative_to(Path(runs_dir).resolve())
    except (ValueError, OSError):
        return Path(path).name
    return str(Path(Path(runs_dir).resolve().name) / inside)


def reproduce_command(status: JobStatus) -> str:
    """The command that reproduces the current (or last) run from a terminal; "" before any run."""
    if status.config_path is None:
        return ""
    extra = ["resume=true"] if "resume=true" in status.command.split() else []
    verb = "sweep" if status.sweep is not None else "train"  # a sweep started again goes on where it was
    return shlex.join(["finetune", verb, display_path(status.config_path), *extra])


def run_options(status: JobStatus) -> dict[str, Any]:
    """The run's own `report_to` and `push_to_hub` (from its resolved config.yaml, else the launched one)."""
    for path in (status.run_dir / "config.yaml" if status.run_dir else None, status.config_path):
        if path is not None and Path(path).is_file():
            try:
                values = read_yaml(path)
            except ConfigError:
                continue
            report_to = values.get("report_to") or []
            return {"report_to": report_to.split(",") if isinstance(report_to, str) else list(report_to),
                    "push_to_hub": values.get("push_to_hub")}
    return {"report_to": [], "push_to_hub": None}
