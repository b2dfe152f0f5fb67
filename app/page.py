"""The page: a Gradio 6 Blocks layout whose config widgets are generated from the schema, wired to `Controller`."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from app import chatview, dataview, exportview, limits, runsview
from app.access import Access
from app.api import ScriptApi
from app.dataview import UPLOAD_TYPES, DatasetView, labels_markdown
from app.device import DeviceMemory
from app.handlers import CHAT_EXAMPLE_LABEL, NONE_CHOICE, Controller
from app.jobs import JobManager
from app.mapping import (
    COLUMN_FIELDS,
    FIELD_NAMES,
    SPECS,
    WidgetSpec,
    changed_options,
    model_choices,
    preset_config,
    shown_fields,
    task_choices,
    to_widget,
)
from app.tasksview import tasks_frame
from finetune.config.exclusions import takes
from finetune.config.schema import Config, from_dict

TASK_FIELDS = ("tasks", "mixing", "mixing_temperature", "mixing_cap")  # what the Tasks table is drawn from
TASKS_PLACEHOLDER = "- name: sentiment\n  dataset: reviews.csv\n- name: topic\n  dataset: news.csv\n  weight: 0.5"

CSS = """
.ft-progress { display: flex; align-items: center; gap: 12px; }
.ft-progress progress { flex: 1; height: 18px; accent-color: var(--color-accent); }
.ft-progress span { white-space: nowrap; font-variant-numeric: tabular-nums; }
.ft-error p { color: var(--error-text-color, #b91c1c); }
/* WCAG AA: help text 4.5:1 (Gradio's grey is 1.9:1 on white), white on the Start button 4.5:1 (2.8:1 on its orange). */
.info-text { color: #4b5563 !important; }
.dark .info-text { color: #d1d5db !important; }
button.primary { background: #c2410c !important; color: #fff !important; }
button.primary:hover:not(:disabled) { background: #9a3412 !important; }
button.stop:not(:disabled) { background: #b91c1c !important; color: #fff !important; }
.ft-chart svg { width: 100%; height: auto; display: block; }
/* A narrow window stacks the Train tab's columns: the Run panel (Start, progress) comes first. */
@media (max-width: 720px) {
  #train-row { flex-direction: column-reverse; }
  .gradio-container .column { min-width: 0 !important; max-width: 100% !important; }
  .gradio-container .row { flex-wrap: wrap !important; }
  #train-row > * { width: 100% !important; flex-basis: 100% !important; }
  .gradio-container .row > * { min-width: min(100%, 160px) !important; }
}
.ft-chart svg text { font-size: 12px; fill: var(--body-text-color, #1f2937); }
.ft-legend { display: flex; gap: 16px; flex-wrap: wrap; font-size: 13px; }
.ft-key { display: inline-flex; align-items: center; gap: 6px; white-space: nowrap; }
/* A field whose value is refused says so in its help line, in red, with a red frame. */
.ft-invalid .info-text { color: #b91c1c !important; }
.dark .ft-invalid .info-text { color: #fca5a5 !important; }
.ft-invalid input, .ft-invalid textarea { border-color: #b91c1c !important; }
.ft-plan-chart { display: flex; flex-direction: column; gap: 4px; font-size: 13px; }
.ft-bar-row { display: grid; grid-template-columns: minmax(90px, 34%) 1fr 76px; align-items: center; gap: 8px; }
.ft-bar-track { position: relative; height: 14px; background: #f3f4f6; }
.ft-bar { display: block; height: 100%; }
.ft-budget-mark { position: absolute; top: -3px; bottom: -3px; width: 2px; background: #4b5563; }
.ft-bar-size { text-align: right; font-variant-numeric: tabular-nums; }
.ft-bar-caption { margin: 4px 0 0; color: #4b5563; }
"""
# Gradio names number boxes and dropdowns by their label alone (aria-label) but a text box by its whole <label>,
# help text included; give text boxes the same short name, so people with screen readers (and browser tests that
# find fields by label) hear "Dataset", not the paragraph under it.
JS = """
() => {
  const name = () => document.querySelectorAll('label textarea[data-testid="textbox"]:not([aria-label]), '
    + 'label input[data-testid="textbox"]:not([aria-label])').forEach((box) => {
      const title = box.closest('label')?.querySelector('[data-testid="block-info"]');
      if (title && title.textContent.trim()) box.setAttribute('aria-label', title.textContent.trim());
    });
  name();
  new MutationObserver(name).observe(document.body, {childList: true, subtree: true});
}
"""
INTRO = ("# finetune\nFine-tune a Transformers model on your own data: pick a model and a dataset, check the plan "
         "against your memory, press **Start training**. Every run is a `finetune train` command you can "
         "reproduce from a terminal.")


@dataclass
class App:
    """The Blocks, the widget of every config field (by name) and the job manager behind them."""

    demo: gr.Blocks
    fields: dict[str, gr.components.Component]
    jobs: JobManager
    css: str = CSS
    js: str = JS


def _widget(spec: WidgetSpec, value: Any, memory: DeviceMemory | None, data: DatasetView,
            shown: dict[str, bool]) -> gr.components.Component:
    common = {"label": spec.label, "info": spec.info, "value": value, "elem_id": f"field-{spec.name}",
              "visible": shown.get(spec.name, True)}
    if spec.name == "memory_budget_gb" and memory is not None:
        common["info"] = f"{spec.info} Detected: {memory.gib:g} GiB of {memory.what}."
    if spec.kind == "checkbox":
        return gr.Checkbox(**common)
    if spec.name == "task":  # the registry's kinds, by what they train (a new kind appears by itself)
        return gr.Dropdown(task_choices(), **common)
    if spec.kind == "choice":
        return gr.Dropdown(list(spec.choices or ()), **common)
    if spec.kind == "multi":  # one box of several choices (nine checkboxes took six rows)
        return gr.Dropdown(list(spec.choices or ()), multiselect=True, **common)
    if spec.kind == "model":
        return gr.Dropdown(model_choices(), allow_custom_value=True, filterable=True, **{
            **common, "info": f"{spec.info} Pick a preset (grouped by task) or type any hub id or local folder."})
    if spec.kind == "column":
        value = value or data.chosen.get(spec.name) or ""
        choices = [NONE_CHOICE, *[(c, c) for c in data.columns]]
        if value and value not in data.columns:
            choices.append((value, value))
        return gr.Dropdown(choices, allow_custom_value=True, **{**common, "value": value})
    if spec.kind == "tasks":  # YAML, as in a config file; the Tasks table below shows what it means
        return gr.Textbox(lines=6, max_lines=30, placeholder=TASKS_PLACEHOLDER, max_length=limits.MAX_CONFIG_BYTES,
                          **common)
    if spec.kind in ("int", "float") and spec.optional:
        return gr.Textbox(placeholder="empty: default", max_length=100, **common)
    if spec.kind in ("int", "float"):
        return gr.Number(precision=0 if spec.kind == "int" else None, step=spec.step, **common)
    return gr.Textbox(max_length=limits.MAX_INPUT_CHARS, **common)


def _grid(specs: list[WidgetSpec], fields: dict, initial: Config, memory: DeviceMemory | None, data: DatasetView,
          per_row: int = 3) -> None:
    shown = shown_fields(initial.task, initial.dataset)
    # Rows of the fields the form shows first, then the others (hidden until their kind is chosen): a kind's own
    # fields then sit together rather than in gaps between another kind's.
    specs = sorted(specs, key=lambda s: not shown.get(s.name, True))
    for i in range(0, len(specs), per_row):
        with gr.Row():
            for spec in specs[i: i + per_row]:
                fields[spec.name] = _widget(spec, to_widget(spec.name, getattr(initial, spec.name)), memory, data,
                                            shown)


# Where each field of a handler's named result (`app.results`) goes: a component, or the targets of a nested result
# or of a group of values by name (the column dropdowns, the config form).
Targets = dict[str, Any]


def _components(targets: Targets) -> list[gr.components.Component]:
    """The components `targets` names, in order: a handler's outputs."""
    return [c for target in targets.values()
            for c in (_components(target) if isinstance(target, dict) else [target])]


def _updates(result: Any, targets: Targets) -> dict[gr.components.Component, Any]:
    """A named result as Gradio's {component: value} return; a nested result that is None, or a name missing from a
    group, leaves its components as they are."""
    out = {}
    for name, target in targets.items():
        if isinstance(result, dict) and name not in result:
            continue
        value = result[name] if isinstance(result, dict) else getattr(result, name)
        if isinstance(target, dict):
            out.update(_updates(value, target) if value is not None else {})
        else:
            out[target] = value
    return out


GATES = ("signed_in", "quiet", "public")


def _on(event: Callable[..., Any], handler: Callable[..., Any], inputs: Any, targets: Targets, *,
        gate: str = "signed_in", **kwargs: Any) -> Any:
    """Wire `handler` (a `Controller` method) to `event`, its named result going to the components of `targets`;
    the handler gets the request too (who asks, on a shared server).

    Every page event passes `Controller.admit` first: inputs too large are refused, and so, unless `gate` is
    "public", is a caller who may not train: with an error (Gradio's toast), or silently for a "quiet" event that
    runs by itself (on page load). tests/test_app_access.py walks the Blocks' events to check that none goes
    around it."""
    # Checked when the page is built, not when a button is pressed: a handler without `request` would turn its
    # outputs into Gradio's red "Error" badge only in the browser.
    if "request" not in inspect.signature(handler).parameters:
        raise TypeError(f"{getattr(handler, '__qualname__', handler)} is wired to the page but takes no request=")
    controller = handler.__self__

    # Gradio passes the request to a leading parameter typed gr.Request. Nothing to update is Gradio's skip: an
    # empty dict would read as one value for the first output.
    def run(request: gr.Request, *args: Any) -> Any:
        if refusal := controller.admit(request, args, gate):
            if gate == "quiet":
                return gr.skip()
            raise gr.Error(refusal)
        result = handler(*args, request=request)
        if not targets:
            return result
        return _updates(result, targets) or gr.skip()

    run.gate, run.handler = gate, handler  # what the event walk of the tests reads
    return event(run, inputs, _components(targets) if targets else kwargs.pop("outputs"), **kwargs)


def initial_config(preset: Path | None, memory: DeviceMemory | None, base: Path | None = None) -> Config:
    """What the page opens with: the preset (the bundled model on the sample data) and the detected memory."""
    config = preset_config(preset, base) if preset and preset.is_file() else Config()
    if memory is not None and config.memory_budget_gb is None:
        config = from_dict({**changed_options(config), "memory_budget_gb": memory.gib})
    return config


def build(runs_dir: Path, *, jobs: JobManager | None = None, memory: DeviceMemory | None = None,
          preset: Path | None = None, preset_base: Path | None = None, access: Access | None = None,
          server_limits: limits.Limits = limits.LOCAL) -> App:
    """The app: widgets for every config field, the run panel, results and reproducibility."""
    access = access or Access()
    # Locally the child inherits the app's environment as it is at each start, like a command typed in a terminal.
    jobs = jobs or JobManager(runs_dir, env=access.child_env(os.environ) if access.shared else None,
                              max_run_s=server_limits.max_run_s)
    initial = initial_config(preset, memory, preset_base)
    # The sample data the preset points at stays readable on a shared server, and so does the shipped ChatML
    # template (for conversation data on a model that has none).
    shipped = [Path(preset_base or Path.cwd()) / "assets" / "chatml.jinja"]
    samples = tuple(Path(p) for p in (initial.dataset, initial.eval_dataset, *shipped) if p and Path(p).is_file())
    controller = Controller(runs_dir, jobs, access=access, samples=samples, server_limits=server_limits)
    # The sample data is inspected before the page is served, so it opens with its preview and columns filled in
    # (a refresh on page load could finish after a quick upload and overwrite its preview).
    data = dataview.inspect(initial.dataset, initial.dataset_config, initial.train_split, initial.task,
                            {c: getattr(initial, c) for c in COLUMN_FIELDS}) if initial.dataset else DatasetView()
    fields: dict[str, gr.components.Component] = {}
    by_section: dict[str, list[WidgetSpec]] = {}
    for spec in SPECS.values():
        by_section.setdefault(spec.section, []).append(spec)

    def place(section: str, per_row: int = 3) -> None:
        _grid(by_section.get(section, []), fields, initial, memory, data, per_row)

    with gr.Blocks(title="finetune") as demo:
        gr.Markdown(INTRO)
        if access.mode == "space":  # only on a Space: elsewhere Gradio would mock the sign-in with a hub call
            gr.LoginButton("Sign in with Hugging Face to train")
        form_note = gr.Markdown(elem_id="form-note")  # where the form's values came from, after a reload
        # One tab per step of the work (as LlamaBoard and H2O LLM Studio have): train, try the model, take it away.
        with gr.Tabs(elem_id="steps"):
            with gr.Tab("Train", id="train", elem_id="tab-train"):
                with gr.Row(equal_height=False, elem_id="train-row"):
                    with gr.Column(scale=5):
                        with gr.Column(variant="panel"):
                            gr.Markdown("### 1 · Model")
                            place("model", per_row=2)
                            model_note = gr.Markdown()
                            model_fit = gr.Markdown(elem_classes="ft-error", elem_id="model-fit")
                        with gr.Column(variant="panel"):
                            gr.Markdown("### 2 · Dataset")
                            with gr.Row():
                                with gr.Column(scale=3):
                                    place("dataset", per_row=1)
                                upload = gr.File(label="Upload dataset", file_types=UPLOAD_TYPES, scale=2,
                                                 elem_id="upload-dataset", height=160)
                            data_error = gr.Markdown(f"⚠️ {data.error}" if data.error else "", elem_classes="ft-error",
                                                     elem_id="data-error")
                            preview = gr.Dataframe(data.preview, label="First rows", interactive=False, max_height=220,
                                                   wrap=True, max_chars=60)
                            place("columns", per_row=3)
                            labels_md = gr.Markdown(labels_markdown(data), elem_id="label-counts")
                            chat_note = gr.Markdown(elem_id="chat-example-note")
                            chat_example = gr.HighlightedText(
                                label=CHAT_EXAMPLE_LABEL,
                                color_map={"learned": "#22c55e", chatview.CHOSEN: "#22c55e",
                                           chatview.REJECTED: "#f87171"}, show_legend=False, show_inline_category=False,
                                show_whitespaces=False, visible=False, elem_id="chat-example")
                            with gr.Accordion("More data options", open=False):
                                place("data_more")
                            with gr.Accordion("Several datasets at once (multi-task)", open=bool(initial.tasks),
                                              visible=takes(initial.task, "tasks")) as tasks_section:
                                place("tasks", per_row=1)
                                tasks_note = gr.Markdown(elem_classes="ft-error", elem_id="tasks-note")
                                tasks_table = gr.Dataframe(tasks_frame(*[to_widget(n, getattr(initial, n))
                                                                         for n in TASK_FIELDS])[0],
                                                           label="Tasks", interactive=False, elem_id="tasks-table")
                        with gr.Column(variant="panel"):
                            gr.Markdown("### 3 · Memory budget and batch")
                            place("batch", per_row=2)
                            place("memory", per_row=2)
                            with gr.Row():
                                plan_device = gr.Radio(
                                    [("this machine", "here"), ("a CUDA GPU of the budget's memory", "cuda")],
                                    value="here", label="Plan for", elem_id="plan-device",
                                    info="A CUDA GPU: plan here for a GPU you will train on (precision bf16, the "
                                         "CUDA context counted); Start trains on this machine.")
                                plan_btn = gr.Button("Plan", scale=0)
                            plan_error = gr.Markdown(elem_classes="ft-error", elem_id="plan-error")
                            plan_md = gr.Markdown(elem_id="plan")
                            # Drawn by the app (app.views.plan_chart_html): bars scaled to the peak, the budget a
                            # marker, each part's size beside it (a 0.6 GiB part of a 24 GiB budget stays visible).
                            plan_plot = gr.HTML(visible=False, elem_id="plan-plot")
                        with gr.Column(variant="panel"):
                            gr.Markdown("### 4 · Training")
                            place("training")
                            place("run")
                            with gr.Accordion("Advanced", open=False):
                                place("advanced")
                    with gr.Column(scale=4):
                        with gr.Column(variant="panel"):
                            gr.Markdown("### Run")
                            with gr.Row():
                                start_btn = gr.Button("Start training", variant="primary")
                                stop_btn = gr.Button("Stop", variant="stop", interactive=False)
                                resume_btn = gr.Button("Resume", visible=False)
                            run_msg = gr.Markdown(elem_id="run-message")
                            status_md = gr.Markdown(elem_id="run-status")
                            progress = gr.HTML(elem_id="run-progress")
                            stats_md = gr.Markdown(elem_id="run-stats")
                            trackers_md = gr.Markdown(elem_id="run-trackers")
                            # Drawn by the app (app.views.loss_chart_html), not gr.LinePlot: Gradio 6.31 fixes a
                            # plot's colours from its first data (an eval split that comes later got no colour until
                            # a reload) and cuts its legend off below the frame.
                            loss_plot = gr.HTML(label="Loss per optimizer step", container=True, elem_id="loss-plot")
                            log_box = gr.Textbox(label="Log", lines=12, max_lines=12, autoscroll=True,
                                                 interactive=False)
                        with gr.Column(variant="panel"):
                            gr.Markdown("### Results")
                            metrics = gr.JSON(label="Final metrics", open=True)
                            scatter_plot = gr.ScatterPlot(None, x="true", y="predicted", height=260, visible=False,
                                                          label="Predicted against true values (evaluation rows)",
                                                          elem_id="regression-scatter")
                            run_dir_box = gr.Textbox(label="Run directory", interactive=False)
            with gr.Tab("Try it", id="try", elem_id="tab-try"):
                # Try it: a chat box for a run trained on conversations, a text box for the others (the poll
                # switches them when a run finishes; see Controller.try_panel).
                try_chat = gr.Chatbot(label="Chat with the trained model (through its chat template)",
                                      visible=False, height=280, elem_id="try-chat")
                with gr.Row():
                    try_box = gr.Textbox(label="Try it", placeholder="Type a text for the trained model",
                                         max_length=limits.MAX_INPUT_CHARS, scale=4, elem_id="try-box")
                    try_btn = gr.Button("Predict", scale=1, interactive=False, elem_id="try-button")
                new_chat = gr.ClearButton([try_chat], value="New chat", size="sm", visible=False)
                try_msg = gr.Markdown(elem_id="try-message")
                try_label = gr.Label(label="Prediction", num_top_classes=5, visible=False, elem_id="prediction")
                try_text = gr.Textbox(label="Generated continuation", visible=False, interactive=False)
                try_entities = gr.HighlightedText(label="Entities", visible=False, show_legend=True,
                                                  elem_id="try-entities")
            with gr.Tab("Runs", id="runs", elem_id="tab-runs") as runs_tab:
                runs_view = runsview.RunsTab(controller)
            with gr.Tab("Export", id="export", elem_id="tab-export"):
                gr.Markdown("### Download or push the model")
                download_btn = gr.DownloadButton("Download model", interactive=False)
                hub_md = gr.Markdown(elem_id="hub-note")
                with gr.Row():
                    push_repo = gr.Textbox(label="Hub repository", placeholder="your-name/my-model", scale=3,
                                           max_length=200, elem_id="push-repo")
                    push_private = gr.Checkbox(label="Private", value=True, scale=1)
                    push_btn = gr.Button("Push to the Hub", scale=1, interactive=False)
                push_msg = gr.Markdown(elem_id="push-message")
                exportview.place(controller, {"api_visibility": "private"})
                with gr.Column(variant="panel"):
                    gr.Markdown("### Reproduce")
                    with gr.Row():
                        export_btn = gr.Button("Export config")
                        import_btn = gr.UploadButton("Import config", file_types=[".yaml", ".yml"])
                    repro_msg = gr.Markdown(elem_id="repro-message")
                    command_box = gr.Textbox(label="Command", interactive=False, buttons=["copy"])
                    yaml_code = gr.Code(language="yaml", label="Config (YAML)", interactive=False)
                    config_file = gr.File(label="Config file", interactive=False)
        seen = gr.State(None)
        timer = gr.Timer(1.0)

        by_name = {name: fields[name] for name in FIELD_NAMES}
        controller.field_infos = {name: fields[name].info or "" for name in FIELD_NAMES}
        columns = {name: fields[name] for name in COLUMN_FIELDS}
        values = list(by_name.values())
        data_in = [fields["dataset"], fields["dataset_config"], fields["train_split"], fields["task"],
                   *columns.values()]
        data_out = {"preview": preview, "columns": columns, "labels": labels_md, "error": data_error}
        upload_out = {"dataset": fields["dataset"], "eval_dataset": fields["eval_dataset"],
                      "eval_split": fields["eval_split"], "eval_fraction": fields["eval_fraction"], "data": data_out}
        run_out = {"signature": seen, "status": status_md, "progress": progress, "stats": stats_md,
                   "loss_curve": loss_plot, "log": log_box, "metrics": metrics, "run_dir": run_dir_box,
                   "download": download_btn, "start_button": start_btn, "stop_button": stop_btn,
                   "resume_button": resume_btn,
                   "command": command_box, "trackers": trackers_md, "hub_note": hub_md, "push_repo": push_repo,
                   "try_panel": {"chat": try_chat, "label": try_label, "generated": try_text, "button": try_btn,
                                 "entities": try_entities,
                                 "new_chat": new_chat, "text": try_box, "message": try_msg, "push": push_btn},
                   "note": run_msg, "scatter": scatter_plot}
        try_out = {"label": try_label, "generated": try_text, "chat": try_chat, "text": try_box, "message": try_msg,
                   "entities": try_entities}
        chat_in = [fields[n] for n in ("dataset", "dataset_config", "train_split", "task", "messages_column", "model",
                                       "chat_template", "train_on", "max_length", "prompt_column", "chosen_column",
                                       "rejected_column")]
        chat_out = {"example": chat_example, "note": chat_note}
        # The page's own events are private: scripts get the named API of `app.api` instead. It is registered first,
        # so that its names are free (a private event still takes its function's name, e.g. `stop`).
        ScriptApi(controller).register()
        private = {"api_visibility": "private"}

        # .input, not .change: an imported config keeps its own task.
        picked = _on(fields["model"].input, controller.on_model, fields["model"],
                     {"task": fields["task"], "note": model_note}, **private)
        # Then whether it can fit the budget at all (even at 4-bit): the planner names the smallest budget that does.
        # (Only on a pick: a planner child on every blur of the budget would compete with the run for the cores.)
        _on(picked.then, controller.model_fit, values, {}, outputs=model_fit, concurrency_id="plan",
            concurrency_limit=limits.PLAN_CONCURRENCY, show_progress="hidden", **private)
        _on(fields["task"].change, controller.refresh_dataset, data_in, data_out, **private)
        # Only what applies: the chosen kind's fields, and no hub config or split for a local file.
        fields_out = {"fields": by_name, "tasks_section": tasks_section, "chat_example": chat_example}
        for event in (fields["task"].change, fields["dataset"].change):
            _on(event, controller.form_fields, [fields["task"], fields["dataset"]], fields_out, gate="public",
                show_progress="hidden", **private)
        for name in ("dataset", "dataset_config", "train_split"):
            _on(fields[name].submit, controller.refresh_dataset, data_in, data_out, **private)
            _on(fields[name].blur, controller.refresh_dataset, data_in, data_out, **private)
        for name in COLUMN_FIELDS:
            _on(fields[name].input, controller.refresh_dataset, data_in, data_out, **private)
        task_inputs = [fields[n] for n in TASK_FIELDS]
        for name in TASK_FIELDS:
            _on(fields[name].change, controller.tasks_table, task_inputs, {"table": tasks_table, "note": tasks_note},
                gate="quiet", **private)
        _on(upload.upload, controller.on_upload, [upload, *data_in[1:]], upload_out, **private)
        _on(plan_btn.click, controller.plan_for, [plan_device, *values],
            {"text": plan_md, "chart": plan_plot, "error": plan_error, "fields": by_name},
            concurrency_id="plan", concurrency_limit=limits.PLAN_CONCURRENCY, **private)
        _on(start_btn.click, controller.start, values,
            {"note": run_msg, "dataset_note": data_error, "fields": by_name}, **private)
        _on(stop_btn.click, controller.stop, None, {}, outputs=run_msg, gate="public", concurrency_limit=None,
            **private)
        _on(resume_btn.click, controller.resume, None, {}, outputs=run_msg, **private)
        _on(timer.tick, controller.poll, seen, run_out, gate="public", concurrency_limit=None,
            show_progress="hidden", **private)
        # A reload (or a second tab) shows the running job at once rather than at the next tick.
        _on(demo.load, controller.poll, seen, run_out, gate="public", show_progress="hidden", **private)
        _on(demo.load, controller.running_config, None, {"values": by_name, "note": form_note, "data": data_out},
            gate="public", show_progress="hidden", **private)
        _on(try_btn.click, controller.try_it, [try_box, try_chat], try_out, **private)
        _on(try_box.submit, controller.try_it, [try_box, try_chat], try_out, **private)
        _on(push_btn.click, controller.push, [push_repo, push_private], {"message": push_msg},
            concurrency_id="push", **private)
        # The example follows the data (its preview), the messages column, the model, the template and `train_on`.
        for event in (preview.change, fields["messages_column"].change, fields["model"].change,
                      fields["prompt_column"].input, fields["chosen_column"].input, fields["rejected_column"].input,
                      fields["chat_template"].submit, fields["chat_template"].blur, fields["train_on"].change,
                      fields["max_length"].blur, demo.load):
            _on(event, controller.chat_example, chat_in, chat_out, gate="quiet", show_progress="hidden", **private)
        _on(export_btn.click, controller.export, values, {"yaml": yaml_code, "file": config_file,
                                                          "command": command_box, "message": repro_msg}, **private)
        imported = _on(import_btn.upload, controller.import_config, import_btn,
                       {"values": by_name, "note": repro_msg, "yaml": yaml_code}, **private)
        refreshed = _on(imported.then, controller.refresh_dataset, data_in, data_out, show_progress="hidden",
                        **private)
        _on(refreshed.then, controller.clear_note, None, {}, outputs=model_note, gate="public", **private)
        # The list is read again when the tab is opened and when a run's state changes (a run finished, say).
        runs_view.wire(_on, [runs_tab.select, status_md.change, demo.load])
    return App(demo, fields, jobs)
