"""The Train tab: its layout (Model, Dataset, Memory and Training panels on the left, the Run panel and Results on
the right; at 400 px the Run panel comes first) and its events."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gradio as gr

from app import charts
from app.door import limits
from app.local.training import JobStatus
from app.mapping import COLUMN_FIELDS
from app.report import final_metrics
from app.train import run_report, scatter
from app.train.dataset import EXAMPLE_INPUTS, TASK_FIELDS, DatasetPanel, build_dataset_panel
from app.train.form import SUGGESTIONS, Form
from app.train.plan import Planning, PlanPanel, build_plan_panel
from app.train.run import RUN_PARTS, Checking, RunPanel, build_run_panel

if TYPE_CHECKING:
    from collections.abc import Callable

    from app.follow import Seen
    from app.tabs import Handlers, Page

PRIVATE = {"api_visibility": "private"}  # the page's own events: scripts get the named API of `app.api` instead


# A press of Start or Plan is answered by the browser at once, before the server's answer (which says the same, a
# round trip later: seconds on a busy machine): a class on <body> that the page's CSS (`pressed_css`) turns into the
# sentence in place of the last message, the button greyed and the old results dimmed. Nothing of Gradio's own DOM
# is touched (Svelte would lose track of it); the class goes once the server's answer is on the page.
PRESSES = {"ft-checking": ("run-message", Checking.note, "start-button", RUN_PARTS),
           "ft-planning": ("plan", Planning.text, "plan-button", ("plan-plot",))}


def pressed_js(name: str) -> str:
    """The browser's answer to a press (see `PRESSES`); returns no inputs for the handler."""
    return f"() => {{ document.body.classList.add({json.dumps(name)}); return []; }}"


def answered_js(name: str) -> str:
    """The server has answered the press: its own sentence and state are on the page."""
    return f"() => {{ document.body.classList.remove({json.dumps(name)}); }}"


def pressed_css() -> str:
    """The page's CSS for `PRESSES`."""
    rules = []
    for name, (note, text, button, stale) in PRESSES.items():
        rules += [f"body.{name} #{note} .prose {{ display: none; }}",
                  f"body.{name} #{note}::before {{ content: {json.dumps(text, ensure_ascii=False)}; }}",
                  f"body.{name} #{button} {{ opacity: 0.6; pointer-events: none; }}",
                  ", ".join(f"body.{name} #{part}" for part in stale) + " { opacity: 0.45; }"]
    return "\n".join(rules) + "\n"


@dataclass
class TrainTab:
    """The Train tab's form and panels."""

    form: Form
    model_note: Any
    model_fit: Any
    dataset: DatasetPanel
    plan: PlanPanel
    run: RunPanel

    @property
    def data_inputs(self) -> list[Any]:
        """What the preview is read from: the dataset, its config and split, the task and the column fields."""
        f = self.form.fields
        return [f["dataset"], f["dataset_config"], f["train_split"], f["task"], *self.form.columns.values()]

    @property
    def data_targets(self) -> dict[str, Any]:
        """Where a `DatasetShown` goes."""
        return {**self.dataset.shown, "columns": self.form.columns}

    @property
    def polled(self) -> dict[str, Any]:
        """Where the views of `refresh` go (the note over the form, which the page places, aside)."""
        run = self.run
        return {"status": run.status, "progress": run.progress, "stats": run.stats, "loss_curve": run.loss,
                "log": run.log, "metrics": run.metrics, "run_dir": run.run_dir, "start_button": run.start,
                "stop_button": run.stop, "resume_button": run.resume, "cancel_button": run.cancel,
                "trackers": run.trackers, "note": run.message, "scatter": run.scatter,
                "completions": run.completions}


TERMINAL = ("stopped", "done", "failed")


def refresh(seen: Seen) -> dict[str, Any]:
    """The Train tab's view of the run, for the poll (`app.follow`): the Run panel (its state line with the caller's
    queued runs, progress, log, buttons), Results, and the note over the form, emptied once a newer run is the
    current one."""
    status = seen.status
    text = "\n\n".join([run_report.status_markdown(status), *seen.lines]) if seen.mine else \
        "\n\n".join(seen.lines) or run_report.status_markdown(status)
    return {"status": text, "progress": run_report.progress_html(status), "stats": run_report.stats_markdown(status),
            "loss_curve": charts.curves_html(status.events), "log": run_report.log_text(status),
            "metrics": final_metrics(status) or None, "run_dir": seen.shown_path(status.run_dir),
            "start_button": gr.update(interactive=True), "stop_button": gr.update(interactive=status.active),
            "resume_button": gr.update(visible=status.resumable), "cancel_button": gr.update(visible=seen.queued),
            "form_note": "" if seen.newer_run else gr.skip(),
            "trackers": run_report.trackers_markdown(seen.options["report_to"], status.run_dir),
            # "Started…", "Stopping…" and the like answered an action on this run: its end replaces them.
            "note": "" if seen.changed_run and status.state in TERMINAL and seen.known else gr.skip(),
            "scatter": scatter.scatter_update(status), "completions": completions_update(status)}


def completions_update(status: JobStatus) -> Any:
    """The sample completions table of the run's latest evaluation, shown only when the run wrote one."""
    table = run_report.samples_html(status.events)
    return gr.update(value=table, visible=bool(table))


def build(page: Page) -> TrainTab:
    """The Train tab's widgets, inside the open `gr.Tab`: the page's config form, panel by panel, and the Run panel
    (with the places to run this app offers)."""
    form = page.form
    with gr.Row(equal_height=False, elem_id="train-row"):
        with gr.Column(scale=5):
            with gr.Column(variant="panel"):
                gr.Markdown("## 1 · Model")
                form.place("model", per_row=2)
                model_note = gr.Markdown(elem_id="model-note")
                model_fit = gr.Markdown(elem_classes="ft-error", elem_id="model-fit")
            with gr.Column(variant="panel"):
                dataset = build_dataset_panel(form)
            with gr.Column(variant="panel"):
                plan = build_plan_panel(form)
            with gr.Column(variant="panel"):
                gr.Markdown("## 4 · Training")
                form.place("training")
                form.place("run")
                with gr.Accordion("Advanced", open=False):
                    form.place("advanced")
        with gr.Column(scale=4):
            run = build_run_panel(page.run_on)
    return TrainTab(form=form, model_note=model_note, model_fit=model_fit, dataset=dataset, plan=plan, run=run)


def wire(page: Page, tab: TrainTab) -> None:
    """The Train tab's events, to its handlers (the page's load event among them)."""
    on, h, load = page.on, page.h, page.load
    fields, values, by_name = tab.form.fields, tab.form.values, tab.form.by_name
    data_in, data_out = tab.data_inputs, tab.data_targets
    # .input, not .change: an imported config keeps its own task.
    picked = on(fields["model"].input, h.form.on_model, fields["model"],
                {"task": fields["task"], "note": tab.model_note}, **PRIVATE)
    # Then whether it can fit the budget at all (even at 4-bit): the planner names the smallest budget that does.
    # (Only on a pick: a planner child on every blur of the budget would compete with the run for the cores.)
    on(picked.then, h.plan.model_fit, values, {}, outputs=tab.model_fit, concurrency_id="plan",
       concurrency_limit=limits.PLAN_CONCURRENCY, show_progress="hidden", **PRIVATE)
    # A task the user picks makes "Task inferred from the model" untrue: the note goes.
    on(fields["task"].input, h.form.clear_note, None, {}, outputs=tab.model_note, gate="public",
       show_progress="hidden", **PRIVATE)
    on(fields["task"].change, h.dataset.refresh_dataset, data_in, data_out, **PRIVATE)
    # Only what applies: the chosen kind's fields, and no hub config or split for a local file.
    fields_out = {"fields": by_name, "tasks_section": tab.dataset.tasks_section, "chat_example": tab.dataset.example}
    for event in (fields["task"].change, fields["dataset"].change):
        on(event, h.form.form_fields, [fields["task"], fields["dataset"]], fields_out, gate="public",
           show_progress="hidden", **PRIVATE)
    for name in SUGGESTIONS:  # their choices of the caller's own runs, as they are when the field is opened
        on(fields[name].focus, h.form.suggestions, None, {name: fields[name]}, gate="quiet", show_progress="hidden",
           **PRIVATE)
    for name in ("dataset", "dataset_config", "train_split"):
        on(fields[name].submit, h.dataset.refresh_dataset, data_in, data_out, **PRIVATE)
        on(fields[name].blur, h.dataset.refresh_dataset, data_in, data_out, **PRIVATE)
    for name in COLUMN_FIELDS:
        on(fields[name].input, h.dataset.refresh_dataset, data_in, data_out, **PRIVATE)
    task_inputs = [fields[n] for n in TASK_FIELDS]
    for name in TASK_FIELDS:
        on(fields[name].change, h.dataset.tasks_table, task_inputs,
           {"table": tab.dataset.tasks_table, "note": tab.dataset.tasks_note}, gate="quiet", **PRIVATE)
    upload_out = {"dataset": fields["dataset"], "eval_dataset": fields["eval_dataset"],
                  "eval_split": fields["eval_split"], "eval_fraction": fields["eval_fraction"], "data": data_out}
    on(tab.dataset.upload.upload, h.dataset.on_upload, [tab.dataset.upload, *data_in[1:]], upload_out, **PRIVATE)
    # Plan and Start answer at once (a sentence, the button off, the old results dimmed), then do their checks with
    # no spinner over the form: their outputs include every field's help line. `.success`: a press the door refuses
    # gets its one toast, and no second.
    plan = tab.plan
    planning = on(plan.button.click, h.plan.planning, None,
                  {"text": plan.text, "error": plan.error, "chart": plan.chart, "button": plan.button},
                  show_progress="hidden", js=pressed_js("ft-planning"), **PRIVATE)
    planning.then(None, js=answered_js("ft-planning"))  # refused or not
    on(planning.success, h.plan.plan_for, [plan.device, tab.run.run_on, *values],
       {"text": plan.text, "chart": plan.chart, "error": plan.error, "fields": by_name, "button": plan.button},
       concurrency_id="plan", concurrency_limit=limits.PLAN_CONCURRENCY, show_progress="hidden", **PRIVATE)
    run = tab.run
    panel = {"status": run.status, "progress": run.progress, "stats": run.stats, "loss": run.loss, "log": run.log,
             "metrics": run.metrics}
    checking = on(run.start.click, h.run.checking, None,
                  {"note": run.message, "start_button": run.start, "panel": panel}, show_progress="hidden",
                  js=pressed_js("ft-checking"), **PRIVATE)
    checking.then(None, js=answered_js("ft-checking"))
    started = on(checking.success, h.run.start_on, [run.run_on, *values, *run.backend_inputs],
                 {"note": run.message, "dataset_note": tab.dataset.error, "fields": by_name, "start_button": run.start,
                  "panel": panel}, show_progress="hidden", **PRIVATE)
    page.run_moves.append(started.then)
    page.run_moves.append(wire_sweep(on, h, tab, panel).then)
    on(run.run_on.change, h.run.run_on_note, run.run_on, {}, outputs=run.message, gate="quiet",
       show_progress="hidden", **PRIVATE)
    on(run.run_on.change, h.run.backend_form, run.run_on, run.backend_groups, gate="quiet", show_progress="hidden",
       **PRIVATE)
    on(run.stop.click, h.run.stop, None, {}, outputs=run.message, gate="public", concurrency_limit=None, **PRIVATE)
    for button, action in ((run.resume, h.run.resume), (run.cancel, h.run.cancel)):
        page.run_moves.append(on(button.click, action, None, {}, outputs=run.message, **PRIVATE).then)
    # The example follows the data (its preview), the messages column, the model, the template and `train_on`.
    example_in = [fields[n] for n in EXAMPLE_INPUTS]
    example_out = {"example": tab.dataset.example, "note": tab.dataset.example_note}
    for event in (tab.dataset.preview.change, fields["messages_column"].change, fields["model"].change,
                  fields["prompt_column"].input, fields["chosen_column"].input, fields["rejected_column"].input,
                  fields["chat_template"].submit, fields["chat_template"].blur, fields["train_on"].change,
                  fields["max_length"].blur, load):
        on(event, h.dataset.chat_example, example_in, example_out, gate="quiet", show_progress="hidden", **PRIVATE)


def wire_sweep(on: Callable[..., Any], h: Handlers, tab: TrainTab, panel: dict[str, Any]) -> Any:
    """The Sweep section's events: its objectives follow the task, Start sweep starts (into the Run panel); returns
    Start sweep's event."""
    sweep, fields = tab.run.sweep, tab.form.fields
    objective, direction = sweep.widgets["objective"], sweep.widgets["direction"]
    on(fields["task"].change, h.sweep.objective_choices, fields["task"],
       {"objective": objective, "direction": direction}, gate="quiet", show_progress="hidden", **PRIVATE)
    on(objective.input, h.sweep.direction, objective, {}, outputs=direction, gate="quiet", show_progress="hidden",
       **PRIVATE)
    return on(sweep.button.click, h.sweep.start_on, [tab.run.run_on, *sweep.inputs, *tab.form.values],
              {"note": sweep.message, "fields": tab.form.by_name, "panel": panel}, show_progress="minimal", **PRIVATE)
