"""The Runs tab: every run of the user who asks (their own runs folder only), with its status, key metrics, times,
config and command; two or more selected are compared (loss curves, final metrics, the config keys that differ);
one selected can have its whole log downloaded, be resumed (stopped or failed, with a checkpoint) or be deleted
(after a confirmation; only what finetune wrote, by its manifest).

Runs are named by their folder's name and looked up in the user's own folder (`Access.home`), never by a path the
page sends: a name that is not one of the user's runs is refused like a run that does not exist.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd
import yaml

from app import views
from app.jobs import JobBusy
from finetune.config.schema import ConfigError, from_dict, read_yaml
from finetune.run.events import read_events
from finetune.run.rundir import LAUNCH_FILES, MARKER, checkpoints, clear_run_dir, is_finished

TABLE_COLUMNS = ["Run", "Status", "Task", "Model", "Steps", "Metrics", "Started", "Finished"]
COLUMN_WIDTHS = ["15%", "10%", "10%", "15%", "6%", "20%", "12%", "12%"]  # of TABLE_COLUMNS
NOT_DIFFED = ("output_dir", "resume", "overwrite")  # where a run went, not how it trained
MAX_RUNS = 200  # the newest shown (a runs folder kept for months would make a table nobody reads)


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
    events: list[dict[str, Any]] = field(repr=False, default_factory=list)

    @property
    def active(self) -> bool:
        """Whether its training process is (or may still be) running."""
        return self.state in ("starting", "running", "stopping")


def _config_of(path: Path) -> dict[str, Any]:
    """The run's resolved config (config.yaml), or what the app launched it with; {} when neither reads."""
    for name in ("config.yaml", "launch.yaml"):
        try:
            if (path / name).is_file():
                return from_dict(read_yaml(path / name)).to_dict()
        except (ConfigError, OSError, ValueError, yaml.YAMLError):
            continue
    return {}


def _clock(stamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp)) if stamp else ""


def run_info(path: Path, current: Any = None) -> RunInfo:
    """What `path` holds: its state (the job manager's `current` status when it is that run), last step, final
    metrics and times, from its events."""
    events = read_events(path / "events.jsonl")
    config = _config_of(path)
    starts = [e for e in events if e.get("event") == "start"]
    last_start = max((i for i, e in enumerate(events) if e.get("event") == "start"), default=-1)
    final = next((e for e in reversed(events[last_start + 1:]) if e.get("event") in ("done", "stopped", "error")),
                 None)
    if current is not None and current.run_dir is not None and Path(current.run_dir).resolve() == path.resolve() \
            and current.state != "idle":
        state = current.state
    else:
        state = {"done": "done", "stopped": "stopped", "error": "failed"}.get((final or {}).get("event"), "failed")
    finished = is_finished(path)
    metrics = dict(next((e["metrics"] for e in reversed(events) if e.get("event") == "done"), None) or {})
    steps = [e["step"] for e in events if e.get("event") == "step"]
    step = max(steps) if steps else (starts[-1].get("step") if starts else None)
    if state == "done" and starts:
        step = starts[-1]["total_steps"]
    stamp = starts[0].get("time") if starts else None
    if stamp is None and (path / MARKER).is_file():
        stamp = (path / MARKER).stat().st_mtime
    return RunInfo(name=path.name, path=path, state=state, task=config.get("task", ""), model=config.get("model", ""),
                   step=step, total=starts[-1].get("total_steps") if starts else None, metrics=metrics,
                   started=stamp, finished=final.get("time") if final and state in ("done", "stopped", "failed")
                   else None, resumable=state in ("stopped", "failed") and not finished and bool(checkpoints(path)),
                   events=events)


def list_runs(home: Path, current: Any = None) -> list[RunInfo]:
    """The run folders directly in `home` (those with the tool's marker), newest first."""
    if not home.is_dir():
        return []
    folders = [p for p in home.iterdir() if p.is_dir() and not p.is_symlink() and (p / MARKER).is_file()]
    runs = [run_info(p, current) for p in folders]
    return sorted(runs, key=lambda r: (r.started or 0, r.name), reverse=True)[:MAX_RUNS]


def headline(metrics: dict[str, Any]) -> str:
    """The run's key final metrics in one line (its kind's, then the loss)."""
    keys = [k for k in views.HEADLINE_METRICS if isinstance(metrics.get(k), (int, float))]
    return ", ".join(f"{k} {metrics[k]:.4f}" for k in keys[:3])


def runs_frame(runs: list[RunInfo]) -> pd.DataFrame:
    """The runs as the tab's table."""
    rows = [[r.name, views.STATE_TITLES.get(r.state, r.state) + (" (resumable)" if r.resumable else ""), r.task,
             r.model, f"{r.step}/{r.total}" if r.total else "", headline(r.metrics), _clock(r.started),
             _clock(r.finished)] for r in runs]
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def compare_frame(runs: list[RunInfo]) -> pd.DataFrame:
    """The training and evaluation loss of each run, as `views.loss_chart_html` draws it: one colour per run
    (`train/<run>` solid, `eval/<run>` dashed with points)."""
    frames = []
    for r in runs:
        frame = views.loss_frame(r.events)
        frame = frame[frame.split.isin(("train", "eval"))].copy()
        frame["split"] = frame.split + "/" + r.name
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else views.loss_frame([])


def metrics_frame(runs: list[RunInfo]) -> pd.DataFrame:
    """The final metrics of each run, one row per run (a metric a run lacks is empty)."""
    keys = list(dict.fromkeys(k for r in runs for k, v in r.metrics.items() if isinstance(v, (int, float))))
    rows = [[r.name, views.STATE_TITLES.get(r.state, r.state),
             *[round(float(r.metrics[k]), 4) if isinstance(r.metrics.get(k), (int, float)) else None for k in keys]]
            for r in runs]
    return pd.DataFrame(rows, columns=["Run", "Status", *keys])


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
            line = views._event_line(e, total)
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


@dataclass(frozen=True, kw_only=True)
class SelectionShown:
    """What the selected runs show: the one run's details and actions, or the comparison of several."""

    details: Any = ""
    config: Any = ""
    command: Any = ""
    log: Any = field(default_factory=lambda: gr.update(value=None, interactive=False))
    resume: Any = field(default_factory=lambda: gr.update(interactive=False))
    delete: Any = field(default_factory=lambda: gr.update(interactive=False))
    confirm: Any = field(default_factory=lambda: gr.update(visible=False))
    chart: Any = ""
    metrics: Any = field(default_factory=lambda: gr.update(value=None, visible=False))
    diff: Any = field(default_factory=lambda: gr.update(value=None, visible=False))


@dataclass(frozen=True, kw_only=True)
class RunsShown:
    """The Runs tab after a refresh: the table, the choices (the selection kept where it still exists), the
    selection's view and a message."""

    table: Any
    choices: Any
    selection: SelectionShown
    message: Any = ""  # a refresh clears the last action's message (a run resumed, then finished, say)


class RunsController:
    """The Runs tab's handlers; they share the app's `Controller` (who asks, the jobs, the access policy)."""

    def __init__(self, controller: Any):
        self.controller = controller
        self._downloads: Path | None = None

    def admit(self, request: Any, args: tuple[Any, ...], gate: str = "signed_in") -> str:
        """The app's door (see `app.ui._on`)."""
        return self.controller.admit(request, args, gate)

    def _mine(self, request: Any) -> tuple[str | None, list[RunInfo]]:
        """Who asks and their runs (none for someone who may not train)."""
        user, refusal = self.controller.who(request)
        if refusal:
            return user, []
        home = self.controller.access.home(self.controller.runs_dir, user)
        return user, list_runs(home, self._current(user))

    def _current(self, user: str | None) -> Any:
        status = self.controller.jobs.status()
        return status if self.controller.is_mine(status, user) else None

    @staticmethod
    def _names(names: Any) -> list[str]:
        return [n for n in (names if isinstance(names, (list, tuple)) else [names] if names else [])
                if isinstance(n, str)]

    def _picked(self, names: Any, runs: list[RunInfo]) -> list[RunInfo]:
        by_name = {r.name: r for r in runs}
        return [by_name[n] for n in self._names(names) if n in by_name]

    def refresh(self, selected: Any = None, *, request: Any = None) -> RunsShown:
        """List the user's runs; the runs still there stay selected."""
        _, runs = self._mine(request)
        picked = self._picked(selected, runs)
        # The selection is sent only when a selected run is gone: a refresh that lands after a click (the tab's
        # own, on opening it) must not untick what was just ticked.
        gone = len(picked) != len(self._names(selected))
        return RunsShown(table=runs_frame(runs),
                         choices=gr.update(choices=[r.name for r in runs],
                                           **({"value": [r.name for r in picked]} if gone else {})),
                         selection=self._selection(picked))

    def select(self, selected: Any, *, request: Any = None) -> SelectionShown:
        """Show the selected runs: one run's details and actions, or the comparison of two or more."""
        _, runs = self._mine(request)
        return self._selection(self._picked(selected, runs))

    def _selection(self, picked: list[RunInfo]) -> SelectionShown:
        if not picked:
            return SelectionShown(details="Select a run to see its config, command and log; select two or more to "
                                          "compare them.")
        frame = compare_frame(picked)
        chart = views.loss_chart_html(frame) if len(frame) else "No loss recorded yet."
        compared = {"metrics": gr.update(value=metrics_frame(picked), visible=True), "chart": chart}
        if len(picked) > 1:
            diff = config_diff(picked)
            return SelectionShown(details=f"Comparing {len(picked)} runs: {', '.join(f'`{r.name}`' for r in picked)}."
                                  " Select one run alone to download its log, resume or delete it.",
                                  diff=gr.update(value=diff, visible=True, label=f"Config: the {len(diff)} option(s) "
                                                 "that differ"), **compared)
        run = picked[0]
        title = views.STATE_TITLES.get(run.state, run.state)
        when = " · ".join(x for x in (f"started {_clock(run.started)}" if run.started else "",
                                      f"finished {_clock(run.finished)}" if run.finished else "") if x)
        details = f"**{run.name}** · {title}" + (f" · {when}" if when else "") + (
            f" · {headline(run.metrics)}" if run.metrics else "")
        config_file = run.path / ("launch.yaml" if (run.path / "launch.yaml").is_file() else "config.yaml")
        config_text = config_file.read_text(encoding="utf-8", errors="replace") if config_file.is_file() else ""
        command = f"finetune train {_shown_path(run.path / 'config.yaml')}" + (" resume=true" if run.resumable else "")
        return SelectionShown(details=details, config=config_text, command=command,
                              log=gr.update(value=self._log_file(run), interactive=True),
                              resume=gr.update(interactive=run.resumable and not self._busy()),
                              delete=gr.update(interactive=not run.active), **compared)

    def _busy(self) -> bool:
        return self.controller.jobs.status().active

    def _log_file(self, run: RunInfo) -> str:
        """The run's whole log as `<run>.log`, in a folder of this app's that Gradio may serve from (one folder per
        run folder: two users' runs of the same name never share a file)."""
        if self._downloads is None:
            self._downloads = Path(tempfile.mkdtemp(prefix="finetune-logs-"))
        folder = self._downloads / hashlib.sha256(str(run.path.resolve()).encode()).hexdigest()[:16]
        folder.mkdir(exist_ok=True)
        out = folder / f"{run.name}.log"
        out.write_text(full_log(run), encoding="utf-8")
        return str(out)

    def _one(self, selected: Any, request: Any) -> tuple[str | None, RunInfo | None, str]:
        user, refusal = self.controller.who(request)
        if refusal:
            return user, None, f"⚠️ {refusal}"
        _, runs = self._mine(request)
        picked = self._picked(selected, runs)
        if len(picked) != 1:
            return user, None, "Select one run (alone) first."
        return user, picked[0], ""

    def ask_delete(self, selected: Any, *, request: Any = None) -> dict[str, Any]:
        """Delete pressed: ask for a confirmation that names the run."""
        _, run, problem = self._one(selected, request)
        if run is None:
            return {"message": problem, "confirm": gr.update(visible=False)}
        return {"message": f"Delete run `{run.name}`? Its checkpoints, model, metrics and log are removed (files you "
                           "added to its folder are kept).", "confirm": gr.update(visible=True)}

    def cancel_delete(self, *, request: Any = None) -> dict[str, Any]:
        """Cancel: nothing is deleted."""
        return {"message": "Nothing was deleted.", "confirm": gr.update(visible=False)}

    def delete(self, selected: Any, *, request: Any = None) -> RunsShown:
        """Delete the one selected run (not one that is training): only what finetune wrote."""
        _, run, problem = self._one(selected, request)
        if run is not None and run.active:
            problem = "This run is training: stop it before deleting it."
        if run is None or problem:
            shown = self.refresh(selected, request=request)
            return RunsShown(table=shown.table, choices=shown.choices, selection=shown.selection,
                             message=f"⚠️ {problem}" if not problem.startswith("⚠️") else problem)
        kept = delete_run(run.path)
        note = f"Deleted run `{run.name}`." + (f" Kept {len(kept)} file(s) finetune did not write, in "
                                               f"`{_shown_path(run.path)}`." if kept else "")
        shown = self.refresh(selected, request=request)  # the deleted run unticked
        return RunsShown(table=shown.table, choices=shown.choices, selection=shown.selection, message=note)

    def resume(self, selected: Any, *, request: Any = None) -> str:
        """Continue the one selected run from its newest checkpoint."""
        user, run, problem = self._one(selected, request)
        if run is None:
            return problem
        if not run.resumable:
            return ("Nothing to resume: only a stopped or failed run with a checkpoint can be resumed (this one "
                    f"is {views.STATE_TITLES.get(run.state, run.state).lower()}"
                    + (", without a checkpoint)." if run.state in ("stopped", "failed") else ")."))
        if refused := self.controller._server_refuses(None):
            return f"⚠️ {refused}"
        try:
            self.controller.jobs.resume(run.path, owner=user)
        except JobBusy as e:
            return f"⚠️ {e}"
        return (f"Resuming `{run.name}` (follow it in the Train tab). From a terminal: "
                f"`finetune train {_shown_path(run.path / 'config.yaml')} resume=true`.")


def _shown_path(path: Path) -> str:
    from app.handlers import _display_path

    return _display_path(path)


class RunsTab:
    """The Runs tab's blocks, made inside the open `gr.Tab`; `wire` connects them (after the page's other events,
    as `app.ui` wires its own)."""

    def __init__(self, controller: Any):
        self.runs = RunsController(controller)
        with gr.Row():
            self.refresh_btn = gr.Button("Refresh", size="sm", scale=0, elem_id="runs-refresh")
            self.message = gr.Markdown(elem_id="runs-message")
        self.table = gr.Dataframe(runs_frame([]), label="Your runs", interactive=False, max_height=320, wrap=True,
                                  column_widths=COLUMN_WIDTHS, elem_id="runs-table")
        # A multiselect that takes any name (the handlers look names up among the user's runs): a run deleted
        # while a tick on it is on its way is dropped, rather than failing the event as a CheckboxGroup would.
        self.chosen = gr.Dropdown([], value=[], multiselect=True, allow_custom_value=True, filterable=True,
                                  label="Select runs (one: its details; two or more: compare them)",
                                  elem_id="runs-select")
        details = gr.Markdown(elem_id="runs-details")
        chart = gr.HTML(container=True, elem_id="runs-chart")
        metrics = gr.Dataframe(label="Final metrics", interactive=False, visible=False, elem_id="runs-metrics")
        diff = gr.Dataframe(label="Config: the options that differ", interactive=False, visible=False, wrap=True,
                            elem_id="runs-diff")
        with gr.Row():
            log_btn = gr.DownloadButton("Download log", interactive=False, size="sm", elem_id="runs-log")
            self.resume_btn = gr.Button("Resume run", interactive=False, size="sm", elem_id="runs-resume")
            self.delete_btn = gr.Button("Delete run", variant="stop", interactive=False, size="sm",
                                        elem_id="runs-delete")
        with gr.Row(visible=False) as self.confirm:
            self.confirm_btn = gr.Button("Yes, delete it", variant="stop", size="sm", elem_id="runs-confirm")
            self.cancel_btn = gr.Button("Cancel", size="sm", elem_id="runs-cancel")
        command = gr.Textbox(label="Command", interactive=False, buttons=["copy"], elem_id="runs-command")
        config = gr.Code(language="yaml", label="Config (YAML)", interactive=False, elem_id="runs-config")
        self.selection = {"details": details, "config": config, "command": command, "log": log_btn,
                          "resume": self.resume_btn, "delete": self.delete_btn, "confirm": self.confirm,
                          "chart": chart, "metrics": metrics, "diff": diff}
        self.listing = {"table": self.table, "choices": self.chosen, "selection": self.selection,
                        "message": self.message}

    def wire(self, on: Callable[..., Any], refresh_on: list[Any]) -> None:
        """Connect the blocks with `on` (`app.ui._on`); `refresh_on` are the events after which the list is read
        again by itself (the tab opened, a run's state changed)."""
        runs, chosen, private = self.runs, self.chosen, {"api_visibility": "private"}
        asked = {"message": self.message, "confirm": self.confirm}
        on(self.refresh_btn.click, runs.refresh, chosen, self.listing, show_progress="hidden", **private)
        for event in refresh_on:  # by itself: someone who may not train gets no toast for it
            on(event, runs.refresh, chosen, self.listing, gate="quiet", show_progress="hidden", **private)
        on(chosen.input, runs.select, chosen, self.selection, show_progress="hidden", **private)
        on(self.delete_btn.click, runs.ask_delete, chosen, asked, **private)
        on(self.cancel_btn.click, runs.cancel_delete, None, asked, **private)
        on(self.confirm_btn.click, runs.delete, chosen, self.listing, **private)
        on(self.resume_btn.click, runs.resume, chosen, {}, outputs=self.message, **private)
