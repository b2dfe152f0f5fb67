"""The Runs tab: every run of the user who asks (their own runs folder only), with its status, key metrics, times,
config and command; two or more selected are compared (loss curves, final metrics, the config keys that differ);
one selected can have its whole log downloaded, be resumed (stopped or failed, with a checkpoint), be taken off the
queue (one waiting there: "Queued (position N)") or be deleted (after a confirmation; only what finetune wrote, by its
manifest).

Runs are named by their folder's name and looked up in the user's own folder (`Access.home`), never by a path the
page sends: a name that is not one of the user's runs is refused like a run that does not exist.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import gradio as gr

from app import charts, report
from app.local.training import JobBusy
from app.runs.listing import (
    RunInfo,
    benchmarks_frame,
    clock,
    compare_frame,
    config_diff,
    delete_run,
    full_log,
    headline,
    list_runs,
    metrics_frame,
    runs_frame,
    runs_html,
    status_title,
)
from app.state import AppState

if TYPE_CHECKING:
    from app.tabs import Page


@dataclass(frozen=True, kw_only=True)
class SelectionShown:
    """What the selected runs show: the one run's details and actions, or the comparison of several."""

    details: Any = ""
    config: Any = ""
    command: Any = ""
    log: Any = field(default_factory=lambda: gr.update(value=None, interactive=False))
    resume: Any = field(default_factory=lambda: gr.update(interactive=False))
    cancel: Any = field(default_factory=lambda: gr.update(interactive=False))
    delete: Any = field(default_factory=lambda: gr.update(interactive=False))
    confirm: Any = field(default_factory=lambda: gr.update(visible=False))
    chart: Any = ""
    metrics: Any = field(default_factory=lambda: gr.update(value=None, visible=False))
    diff: Any = field(default_factory=lambda: gr.update(value=None, visible=False))
    benchmarks: Any = field(default_factory=lambda: gr.update(value=None, visible=False))


@dataclass(frozen=True, kw_only=True)
class RunsShown:
    """The Runs tab after a refresh: the table, the choices (the selection kept where it still exists), the
    selection's view and a message."""

    table: Any  # the runs, one row each (a DataFrame); the tab draws it as `table_html`
    choices: Any
    selection: SelectionShown
    message: Any = ""  # a refresh clears the last action's message (a run resumed, then finished, say)

    @property
    def table_html(self) -> str:
        """The table as the tab draws it."""
        return runs_html(self.table)


class RunsHandlers:
    """The Runs tab's handlers, over the app's shared state (who asks, the jobs, the access policy)."""

    def __init__(self, state: AppState):
        self.state = state

    def _mine(self, request: Any) -> tuple[str | None, list[RunInfo]]:
        """Who asks and their runs (none for someone who may not train)."""
        user, refusal = self.state.policy.who(request)
        if refusal:
            return user, []
        home = self.state.access.home(self.state.runs_dir, user)
        queued = {q.run_dir: n for q, n in self.state.jobs.queued(user)}
        return user, list_runs(home, self._current(user), queued)

    def _current(self, user: str | None) -> Any:
        status = self.state.jobs.status()
        return status if self.state.policy.is_mine(status, user) else None

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
        chart = charts.loss_chart_html(frame) if len(frame) else "No loss recorded yet."
        scores = benchmarks_frame(picked)
        compared = {"metrics": gr.update(value=metrics_frame(picked), visible=True), "chart": chart,
                    "benchmarks": gr.update(value=scores, visible=not scores.empty)}
        if len(picked) > 1:
            diff = config_diff(picked)
            return SelectionShown(details=f"Comparing {len(picked)} runs: {', '.join(f'`{r.name}`' for r in picked)}."
                                  " Select one run alone to download its log, resume or delete it.",
                                  diff=gr.update(value=diff, visible=True, label=f"Config: the {len(diff)} option(s) "
                                                 "that differ"), **compared)
        run = picked[0]
        title = status_title(run)
        when = " · ".join(x for x in (f"started {clock(run.started)}" if run.started else "",
                                      f"finished {clock(run.finished)}" if run.finished else "") if x)
        details = f"**{run.name}** · {title}" + (f" · {when}" if when else "") + (
            f" · {headline(run.metrics)}" if run.metrics else "")
        config_file = run.path / ("launch.yaml" if (run.path / "launch.yaml").is_file() else "config.yaml")
        config_text = config_file.read_text(encoding="utf-8", errors="replace") if config_file.is_file() else ""
        command = (f"finetune train {report.display_path(run.path / 'config.yaml')}"
                   + (" resume=true" if run.resumable else ""))
        return SelectionShown(details=details, config=config_text, command=command,
                              log=gr.update(value=self._log_file(run), interactive=True),
                              resume=gr.update(interactive=run.resumable),
                              cancel=gr.update(interactive=run.state == "queued"),
                              delete=gr.update(interactive=not run.active and run.state != "queued"), **compared)

    def _log_file(self, run: RunInfo) -> str:
        """The run's whole log as `<run>.log`, to download."""
        return self.state.downloads.text(run.path, f"{run.name}.log", full_log(run))

    def _one(self, selected: Any, request: Any) -> tuple[str | None, RunInfo | None, str]:
        user, refusal = self.state.policy.who(request)
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
        if run is not None and run.state == "queued":
            problem = "This run is waiting in the queue: cancel it before deleting it."
        if run is None or problem:
            shown = self.refresh(selected, request=request)
            return RunsShown(table=shown.table, choices=shown.choices, selection=shown.selection,
                             message=f"⚠️ {problem}" if not problem.startswith("⚠️") else problem)
        kept = delete_run(run.path)
        note = f"Deleted run `{run.name}`." + (f" Kept {len(kept)} file(s) finetune did not write, in "
                                               f"`{report.display_path(run.path)}`." if kept else "")
        shown = self.refresh(selected, request=request)  # the deleted run unticked
        return RunsShown(table=shown.table, choices=shown.choices, selection=shown.selection, message=note)

    def resume(self, selected: Any, *, request: Any = None) -> str:
        """Continue the one selected run from its newest checkpoint."""
        user, run, problem = self._one(selected, request)
        if run is None:
            return problem
        if not run.resumable:
            return ("Nothing to resume: only a stopped or failed run with a checkpoint can be resumed (this one "
                    f"is {report.STATE_TITLES.get(run.state, run.state).lower()}"
                    + (", without a checkpoint)." if run.state in ("stopped", "failed") else ")."))
        if refused := self.state.jobs.server_refusal(None):
            return f"⚠️ {refused}"
        try:
            position = self.state.jobs.resume(run.path, owner=user)
        except JobBusy as e:
            return f"⚠️ {e}"
        doing = f"`{run.name}`: {report.queued_words(position)}" if position else \
            f"Resuming `{run.name}` (follow it in the Train tab)."
        return f"{doing} From a terminal: `finetune train {report.display_path(run.path / 'config.yaml')} resume=true`."

    def evaluate(self, selected: Any, benchmarks: Any, base: Any = False, limit: Any = None, *,
                 request: Any = None) -> str:
        """Score the one selected finished run with lm-evaluation-harness (`finetune eval RUN --benchmarks …`) in a
        child process with a time limit; its scores join the comparison when it ends."""
        user, run, problem = self._one(selected, request)
        if run is None:
            return problem
        names = [n.strip() for n in str(benchmarks or "").split(",") if n.strip()]
        if not run.finished or run.state != "done":
            return "Only a finished run can be evaluated: wait for it to finish (or resume it)."
        if not names:
            return "Name one or more benchmarks: registry tasks (hellaswag, arc_easy) or task YAML files."
        if self.state.access.shared and any("/" in n or n.lower().endswith((".yaml", ".yml")) for n in names):
            return ("⚠️ A shared server evaluates registry tasks only (hellaswag, arc_easy): a task file would be "
                    "read from the server's disk.")
        if limit not in (None, "") and not (isinstance(limit, (int, float)) and limit >= 1):
            return "The limit is a number of examples per task (1 or more), or empty for all of them."
        command = [sys.executable, "-m", "finetune", "eval", str(run.path), "--benchmarks", ",".join(names),
                   *(["--base"] if base else []), *(["--limit", str(int(limit))] if limit not in (None, "") else [])]
        try:
            self.state.jobs.start_evaluation(command, run.path, user)
        except JobBusy as e:
            return f"⚠️ {e}"
        return (f"Evaluating `{run.name}` (its log: `benchmarks.log` in the run's folder); Refresh once it ends to see "
                f"the scores. From a terminal: `finetune {' '.join(command[3:])}`.")

    def cancel(self, selected: Any, *, request: Any = None) -> RunsShown:
        """Take the one selected run off the queue (its folder too, when nothing had run in it)."""
        user, run, problem = self._one(selected, request)
        if run is not None and run.state != "queued":
            problem = "This run is not waiting in the queue: only a queued run can be cancelled."
        said = self.state.jobs.cancel(run.path, user) if run is not None and not problem else ""
        if run is not None and not problem and not said:
            problem = "This run has already started: stop it in the Train tab instead."
        note = f"⚠️ {problem.removeprefix('⚠️ ')}" if problem else said
        shown = self.refresh(selected, request=request)
        return RunsShown(table=shown.table, choices=shown.choices, selection=shown.selection, message=note)


class RunsTab:
    """The Runs tab's blocks, made inside the open `gr.Tab`; `wire` connects them to its handlers."""

    def __init__(self, handlers: RunsHandlers):
        self.runs = handlers
        with gr.Row():
            self.refresh_btn = gr.Button("Refresh", size="sm", scale=0, elem_id="runs-refresh")
            self.message = gr.Markdown(elem_id="runs-message")
        gr.Markdown("## Your runs")
        self.table = gr.HTML(runs_html(runs_frame([])), elem_id="runs-table")
        # A multiselect that takes any name (the handlers look names up among the user's runs): a run deleted
        # while a tick on it is on its way is dropped, rather than failing the event as a CheckboxGroup would.
        self.chosen = gr.Dropdown([], value=[], multiselect=True, allow_custom_value=True, filterable=True,
                                  label="Select runs (one: its details; two or more: compare them)",
                                  elem_id="runs-select")
        details = gr.Markdown(elem_id="runs-details")
        chart = gr.HTML(container=True, elem_id="runs-chart")
        metrics = gr.Dataframe(label="Final metrics", interactive=False, visible=False, elem_id="runs-metrics")
        benchmarks = gr.Dataframe(label="Benchmarks (lm-evaluation-harness): fine-tuned and base, value ± standard "
                                  "error", interactive=False, visible=False, elem_id="runs-benchmarks")
        diff = gr.Dataframe(label="Config: the options that differ", interactive=False, visible=False, wrap=True,
                            elem_id="runs-diff")
        with gr.Row():
            log_btn = gr.DownloadButton("Download log", interactive=False, size="sm", elem_id="runs-log")
            self.resume_btn = gr.Button("Resume run", interactive=False, size="sm", elem_id="runs-resume")
            self.cancel_queued_btn = gr.Button("Cancel queued run", interactive=False, size="sm",
                                               elem_id="runs-cancel-queued")
            self.delete_btn = gr.Button("Delete run", variant="stop", interactive=False, size="sm",
                                        elem_id="runs-delete")
        with gr.Row(visible=False) as self.confirm:
            self.confirm_btn = gr.Button("Yes, delete it", variant="stop", size="sm", elem_id="runs-confirm")
            self.cancel_btn = gr.Button("Cancel", size="sm", elem_id="runs-cancel")
        with gr.Accordion("Evaluate with lm-evaluation-harness (one finished run)", open=False):
            with gr.Row():
                self.bench_names = gr.Textbox(label="Benchmarks", placeholder="hellaswag,arc_easy or my_task.yaml",
                                              scale=3, elem_id="runs-bench-names")
                self.bench_base = gr.Checkbox(label="Also the base model", value=True, elem_id="runs-bench-base")
                self.bench_limit = gr.Number(label="Examples per task (empty: all)", value=None, precision=0,
                                             minimum=1, elem_id="runs-bench-limit")
            self.bench_btn = gr.Button("Evaluate", size="sm", elem_id="runs-evaluate")
        command = gr.Textbox(label="Command", interactive=False, buttons=["copy"], elem_id="runs-command")
        config = gr.Code(language="yaml", label="Config (YAML)", interactive=False, elem_id="runs-config")
        self.selection = {"details": details, "config": config, "command": command, "log": log_btn,
                          "resume": self.resume_btn, "cancel": self.cancel_queued_btn, "delete": self.delete_btn,
                          "confirm": self.confirm, "chart": chart, "metrics": metrics, "diff": diff,
                          "benchmarks": benchmarks}
        self.listing = {"table_html": self.table, "choices": self.chosen, "selection": self.selection,
                        "message": self.message}

    def wire(self, on: Callable[..., Any], refresh_on: list[Any]) -> list[Any]:
        """Connect the blocks through the door (`RequestPolicy.on`); `refresh_on` are the events after which the list
        is read again by itself (the tab opened, a run's state changed). Returns the presses after which a run may
        have started or left the queue (Resume run, Cancel, Delete, Evaluate), to follow them with the poll."""
        runs, chosen, private = self.runs, self.chosen, {"api_visibility": "private"}
        asked = {"message": self.message, "confirm": self.confirm}
        on(self.refresh_btn.click, runs.refresh, chosen, self.listing, show_progress="hidden", **private)
        for event in refresh_on:  # by itself: someone who may not train gets no toast for it
            on(event, runs.refresh, chosen, self.listing, gate="quiet", show_progress="hidden", **private)
        on(chosen.input, runs.select, chosen, self.selection, show_progress="hidden", **private)
        on(self.delete_btn.click, runs.ask_delete, chosen, asked, **private)
        on(self.cancel_btn.click, runs.cancel_delete, None, asked, **private)
        return [on(self.confirm_btn.click, runs.delete, chosen, self.listing, **private).then,
                on(self.resume_btn.click, runs.resume, chosen, {}, outputs=self.message, **private).then,
                on(self.cancel_queued_btn.click, runs.cancel, chosen, self.listing, **private).then,
                on(self.bench_btn.click, runs.evaluate, [chosen, self.bench_names, self.bench_base, self.bench_limit],
                   {}, outputs=self.message, **private).then]


def build(page: Page) -> RunsTab:
    """The Runs tab's blocks, inside the open `gr.Tab`."""
    return RunsTab(page.h.runs)


def wire(page: Page, tab: RunsTab) -> None:
    """The Runs tab's events; the list is read again when the tab is opened, when the current run's state changes
    (a run finished, say: the Train tab's status line) and when the page loads; the poll follows its presses that
    may start a run or take one off the queue."""
    page.run_moves += tab.wire(page.on, [page.selected["runs"], page.built["train"].run.status.change, page.load])
