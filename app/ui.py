"""The page: a Gradio 6 Blocks layout whose config widgets are generated from the schema, wired to `Controller`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from app import dataview, limits
from app.access import Access
from app.api import ScriptApi
from app.dataview import UPLOAD_TYPES, DatasetView, labels_markdown
from app.device import DeviceMemory
from app.handlers import NONE_CHOICE, TASK_COLUMNS, Controller
from app.jobs import JobManager
from app.mapping import (
    COLUMN_FIELDS,
    FIELD_NAMES,
    MODEL_PRESETS,
    SPECS,
    WidgetSpec,
    changed_options,
    preset_config,
    to_widget,
)
from app.tasksview import tasks_frame
from finetune.config.schema import Config, from_dict

TASK_FIELDS = ("tasks", "mixing", "mixing_temperature", "mixing_cap")  # what the Tasks table is drawn from
TASKS_PLACEHOLDER = "- name: sentiment\n  dataset: reviews.csv\n- name: topic\n  dataset: news.csv\n  weight: 0.5"

CSS = """
.ft-progress { display: flex; align-items: center; gap: 12px; }
.ft-progress progress { flex: 1; height: 18px; accent-color: var(--color-accent); }
.ft-progress span { white-space: nowrap; font-variant-numeric: tabular-nums; }
.ft-error p { color: var(--error-text-color, #b91c1c); }
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
            task: str) -> gr.components.Component:
    common = {"label": spec.label, "info": spec.info, "value": value, "elem_id": f"field-{spec.name}"}
    if spec.name == "memory_budget_gb" and memory is not None:
        common["info"] = f"{spec.info} Detected: {memory.gib:g} GiB of {memory.what}."
    if spec.kind == "checkbox":
        return gr.Checkbox(**common)
    if spec.kind == "choice":
        return gr.Dropdown(list(spec.choices or ()), **common)
    if spec.kind == "multi":
        return gr.CheckboxGroup(list(spec.choices or ()), **common)
    if spec.kind == "model":
        return gr.Dropdown(list(MODEL_PRESETS), allow_custom_value=True, filterable=True, **{
            **common, "info": f"{spec.info} Pick a preset or type any hub id or local folder."})
    if spec.kind == "column":
        value = value or data.chosen.get(spec.name) or ""
        choices = [NONE_CHOICE, *[(c, c) for c in data.columns]]
        if value and value not in data.columns:
            choices.append((value, value))
        return gr.Dropdown(choices, allow_custom_value=True, visible=spec.name in TASK_COLUMNS.get(task, ()),
                           **{**common, "value": value})
    if spec.kind == "tasks":  # YAML, as in a config file; the Tasks table below shows what it means
        return gr.Textbox(lines=6, max_lines=30, placeholder=TASKS_PLACEHOLDER, **common)
    if spec.kind in ("int", "float") and spec.optional:
        return gr.Textbox(placeholder="empty: default", **common)
    if spec.kind in ("int", "float"):
        return gr.Number(precision=0 if spec.kind == "int" else None, step=spec.step, **common)
    return gr.Textbox(**common)


def _grid(specs: list[WidgetSpec], fields: dict, initial: Config, memory: DeviceMemory | None, data: DatasetView,
          per_row: int = 3) -> None:
    for i in range(0, len(specs), per_row):
        with gr.Row():
            for spec in specs[i: i + per_row]:
                fields[spec.name] = _widget(spec, to_widget(spec.name, getattr(initial, spec.name)), memory, data,
                                            initial.task)


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


def _on(event: Callable[..., Any], handler: Callable[..., Any], inputs: Any, targets: Targets,
        **kwargs: Any) -> Any:
    """Wire `handler` to `event`, its named result going to the components of `targets`; the handler gets the
    request too (who asks, on a shared server)."""

    # Gradio passes the request to a leading parameter typed gr.Request. Nothing to update is Gradio's skip: an
    # empty dict would read as one value for the first output.
    def run(request: gr.Request, *args: Any) -> Any:
        return _updates(handler(*args, request=request), targets) or gr.skip()

    return event(run, inputs, _components(targets), **kwargs)


def _asking(handler: Callable[..., Any]) -> Callable[..., Any]:
    """`handler` with no inputs but the request."""

    def run(request: gr.Request) -> Any:
        return handler(request=request)

    return run


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
        with gr.Row(equal_height=False):
            with gr.Column(scale=5):
                with gr.Column(variant="panel"):
                    gr.Markdown("### 1 · Model")
                    place("model", per_row=2)
                    model_note = gr.Markdown()
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
                    chat_example = gr.HighlightedText(label="The first conversation as the model sees it (learned "
                                                      "tokens highlighted)", color_map={"learned": "#22c55e"},
                                                      show_legend=False, show_inline_category=False,
                                                      show_whitespaces=False, visible=False, elem_id="chat-example")
                    with gr.Accordion("More data options", open=False):
                        place("data_more")
                    with gr.Accordion("Several datasets at once (multi-task)", open=bool(initial.tasks)):
                        place("tasks", per_row=1)
                        tasks_note = gr.Markdown(elem_classes="ft-error", elem_id="tasks-note")
                        tasks_table = gr.Dataframe(tasks_frame(*[to_widget(n, getattr(initial, n))
                                                                 for n in TASK_FIELDS])[0],
                                                   label="Tasks", interactive=False, elem_id="tasks-table")
                with gr.Column(variant="panel"):
                    gr.Markdown("### 3 · Memory budget and batch")
                    place("batch", per_row=2)
                    place("memory", per_row=2)
                    plan_btn = gr.Button("Plan")
                    plan_error = gr.Markdown(elem_classes="ft-error", elem_id="plan-error")
                    plan_md = gr.Markdown(elem_id="plan")
                    # One bar per term, named on the axis: Gradio 6.31 cuts a plot's legend off below its frame.
                    plan_plot = gr.BarPlot(None, x="part", y="GiB", color="kind", x_title=" ", height=260,
                                           label="Predicted peak and its parts vs the budget (GiB)",
                                           color_map={"term": "#60a5fa", "predicted peak": "#2563eb",
                                                      "budget": "#9ca3af"}, visible=False, elem_id="plan-plot")
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
                    # Starts as None, never as an empty frame: a plot first drawn empty draws later lines with no
                    # colour at all (Gradio 6.31).
                    loss_plot = gr.LinePlot(None, x="step", y="loss", color="split", height=260,
                                            label="Loss per optimizer step (blue: train; orange: eval, when "
                                                  "Eval every is set)",
                                            color_map={"train": "#2563eb", "eval": "#f97316"}, elem_id="loss-plot")
                    log_box = gr.Textbox(label="Log", lines=12, max_lines=12, autoscroll=True, interactive=False)
                with gr.Column(variant="panel"):
                    gr.Markdown("### Results")
                    metrics = gr.JSON(label="Final metrics", open=True)
                    scatter_plot = gr.ScatterPlot(None, x="true", y="predicted", height=260, visible=False,
                                                  label="Predicted against true values (evaluation rows)",
                                                  elem_id="regression-scatter")
                    run_dir_box = gr.Textbox(label="Run directory", interactive=False)
                    download_btn = gr.DownloadButton("Download model", interactive=False)
                    with gr.Row():
                        try_box = gr.Textbox(label="Try it", placeholder="Type a text for the trained model",
                                             scale=4)
                        try_btn = gr.Button("Predict", scale=1)
                    try_msg = gr.Markdown()
                    try_label = gr.Label(label="Prediction", num_top_classes=5, visible=False, elem_id="prediction")
                    try_text = gr.Textbox(label="Generated continuation", visible=False, interactive=False)
                    hub_md = gr.Markdown(elem_id="hub-note")
                    with gr.Row():
                        push_repo = gr.Textbox(label="Hub repository", placeholder="your-name/my-model", scale=3,
                                               elem_id="push-repo")
                        push_private = gr.Checkbox(label="Private", value=True, scale=1)
                        push_btn = gr.Button("Push to the Hub", scale=1)
                    push_msg = gr.Markdown(elem_id="push-message")
                    try_chat = gr.Chatbot(label="Chat with the trained model (through its chat template)",
                                          visible=False, height=280, elem_id="try-chat")
                    gr.ClearButton([try_chat], value="New chat", size="sm")
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
        columns = {name: fields[name] for name in COLUMN_FIELDS}
        values = list(by_name.values())
        data_in = [fields["dataset"], fields["dataset_config"], fields["train_split"], fields["task"],
                   *columns.values()]
        data_out = {"preview": preview, "columns": columns, "labels": labels_md, "error": data_error}
        upload_out = {"dataset": fields["dataset"], "eval_dataset": fields["eval_dataset"],
                      "eval_split": fields["eval_split"], "eval_fraction": fields["eval_fraction"], "data": data_out}
        run_out = {"signature": seen, "status": status_md, "progress": progress, "stats": stats_md,
                   "loss_curve": loss_plot, "log": log_box, "metrics": metrics, "run_dir": run_dir_box,
                   "download": download_btn, "stop_button": stop_btn, "resume_button": resume_btn,
                   "command": command_box, "trackers": trackers_md, "hub_note": hub_md, "push_repo": push_repo,
                   "scatter": scatter_plot}
        try_out = {"label": try_label, "generated": try_text, "chat": try_chat, "text": try_box, "message": try_msg}
        chat_in = [fields[n] for n in ("dataset", "dataset_config", "train_split", "task", "messages_column", "model",
                                       "chat_template", "train_on", "max_length")]
        chat_out = {"example": chat_example, "note": chat_note}
        # The page's own events are private: scripts get the named API of `app.api` instead. It is registered first,
        # so that its names are free (a private event still takes its function's name, e.g. `stop`).
        ScriptApi(controller).register()
        private = {"api_visibility": "private"}

        # .input, not .change: an imported config keeps its own task.
        _on(fields["model"].input, controller.on_model, fields["model"],
            {"task": fields["task"], "note": model_note}, **private)
        _on(fields["task"].change, controller.refresh_dataset, data_in, data_out, **private)
        for name in ("dataset", "dataset_config", "train_split"):
            _on(fields[name].submit, controller.refresh_dataset, data_in, data_out, **private)
            _on(fields[name].blur, controller.refresh_dataset, data_in, data_out, **private)
        for name in COLUMN_FIELDS:
            _on(fields[name].input, controller.refresh_dataset, data_in, data_out, **private)
        task_inputs = [fields[n] for n in TASK_FIELDS]
        for name in TASK_FIELDS:
            fields[name].change(tasks_frame, task_inputs, [tasks_table, tasks_note], **private)
        _on(upload.upload, controller.on_upload, [upload, *data_in[1:]], upload_out, **private)
        _on(plan_btn.click, controller.plan, values, {"text": plan_md, "chart": plan_plot, "error": plan_error},
            concurrency_id="plan", concurrency_limit=limits.PLAN_CONCURRENCY, **private)
        _on(start_btn.click, controller.start, values, {"note": run_msg, "dataset_note": data_error}, **private)
        stop_btn.click(_asking(controller.stop), None, run_msg, concurrency_limit=None, **private)
        resume_btn.click(_asking(controller.resume), None, run_msg, **private)
        _on(timer.tick, controller.poll, seen, run_out, concurrency_limit=None, show_progress="hidden", **private)
        # A reload (or a second tab) shows the running job at once rather than at the next tick.
        _on(demo.load, controller.poll, seen, run_out, show_progress="hidden", **private)
        _on(demo.load, controller.running_config, None, {"values": by_name, "note": repro_msg, "data": data_out},
            show_progress="hidden", **private)
        _on(try_btn.click, controller.try_it, [try_box, try_chat], try_out, **private)
        _on(try_box.submit, controller.try_it, [try_box, try_chat], try_out, **private)
        _on(push_btn.click, controller.push, [push_repo, push_private], {"message": push_msg},
            concurrency_id="push", **private)
        # The example follows the data (its preview), the messages column, the model, the template and `train_on`.
        for event in (preview.change, fields["messages_column"].change, fields["model"].change,
                      fields["chat_template"].submit, fields["chat_template"].blur, fields["train_on"].change,
                      fields["max_length"].blur, demo.load):
            _on(event, controller.chat_example, chat_in, chat_out, show_progress="hidden", **private)
        _on(export_btn.click, controller.export, values, {"yaml": yaml_code, "file": config_file,
                                                          "command": command_box, "message": repro_msg}, **private)
        imported = _on(import_btn.upload, controller.import_config, import_btn,
                       {"values": by_name, "note": repro_msg, "yaml": yaml_code}, **private)
        refreshed = _on(imported.then, controller.refresh_dataset, data_in, data_out, show_progress="hidden",
                        **private)
        refreshed.then(lambda: "", None, model_note, **private)
    return App(demo, fields, jobs)
