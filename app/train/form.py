"""The config form: one widget per schema field (`app.mapping` says which kind of widget, its label, help and
section), placed panel by panel as the Train tab is built, and the handlers that fill or trim it: the task a model
implies, only the fields that apply to the kind and the data, a reload's running config, each field's help or its
problem in its place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from app.device import DeviceMemory
from app.door import limits
from app.door.access import AccessError
from app.local.training import JobStatus
from app.mapping import (
    COLUMN_FIELDS,
    FIELD_NAMES,
    KIND_FIELDS,
    SPECS,
    WidgetSpec,
    changed_options,
    config_to_values,
    infer_task,
    load_config_file,
    model_choices,
    shown_fields,
    task_choices,
    task_label,
    to_widget,
)
from app.report import display_path
from app.results import DatasetShown, FormShown, keep
from app.state import AppState
from app.train.preview import DatasetView
from app.train.rewards import reward_choices
from finetune import registry as kinds
from finetune.config.exclusions import takes
from finetune.config.schema import FIELDS, Config, ConfigError, from_dict

NONE_CHOICE = ("—", "")
# The choices of a list of names, by field, from the caller's runs folder (None: no one's runs): GRPO's rewards.
SUGGESTIONS: dict[str, Callable[[Path | None], list[tuple[str, str]]]] = {"rewards": reward_choices}
RUN_FOLDER_FIELDS = ("output_dir", "overwrite", "resume")  # where a run goes: never carried into the next one
TASKS_PLACEHOLDER = "- name: sentiment\n  dataset: reviews.csv\n- name: topic\n  dataset: news.csv\n  weight: 0.5"


def suggested(name: str, home: Path | None) -> list[tuple[str, str]]:
    """The choices list field `name` offers (`SUGGESTIONS`), with those of the runs in `home`."""
    return SUGGESTIONS[name](home) if name in SUGGESTIONS else []


def widget(spec: WidgetSpec, value: Any, memory: DeviceMemory | None, data: DatasetView,
           shown: dict[str, bool], models: list[tuple[str, str]] | None = None) -> gr.components.Component:
    """The widget of one config field, holding `value`; hidden when the form does not show it (`shown`); the Model
    list offers `models` (default: the presets, `model_choices()`)."""
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
    if spec.kind == "names":  # suggestions (the caller's runs come with the task and on focus), or any typed in
        return gr.Dropdown(suggested(spec.name, None), multiselect=True, allow_custom_value=True, **common)
    if spec.kind == "numbers":  # a list whose items may repeat
        return gr.Textbox(placeholder="comma-separated: 1, 0.5", max_length=limits.MAX_INPUT_CHARS, **common)
    if spec.kind == "model":
        return gr.Dropdown(model_choices() if models is None else models, allow_custom_value=True, filterable=True,
                           **{**common, "info": f"{spec.info} Pick a preset (grouped by task), a model already on "
                              "this machine, or type any hub id or local folder."})
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


class Form:
    """The config widgets of one page, by field name, made section by section (`place`) inside the open panel."""

    def __init__(self, initial: Config, memory: DeviceMemory | None, data: DatasetView,
                 models: list[tuple[str, str]] | None = None):
        self.initial, self.memory, self.data, self.models = initial, memory, data, models
        self.fields: dict[str, gr.components.Component] = {}
        self._sections: dict[str, list[WidgetSpec]] = {}
        for spec in SPECS.values():
            self._sections.setdefault(spec.section, []).append(spec)

    def place(self, section: str, per_row: int = 3) -> None:
        """The widgets of `section`, in rows of `per_row`: the fields the form shows first, then the others (hidden
        until their kind is chosen), so that a kind's own fields sit together rather than in another kind's gaps."""
        shown = shown_fields(self.initial.task, self.initial.dataset)
        specs = sorted(self._sections.get(section, []), key=lambda s: not shown.get(s.name, True))
        for i in range(0, len(specs), per_row):
            with gr.Row():
                for spec in specs[i: i + per_row]:
                    value = to_widget(spec.name, getattr(self.initial, spec.name))
                    self.fields[spec.name] = widget(spec, value, self.memory, self.data, shown, self.models)

    @property
    def by_name(self) -> dict[str, gr.components.Component]:
        """Every field's widget, in `FIELD_NAMES` order (the order of a handler's `*values`)."""
        return {name: self.fields[name] for name in FIELD_NAMES}

    @property
    def values(self) -> list[gr.components.Component]:
        """The widgets whose values make the config, as a handler's inputs."""
        return list(self.by_name.values())

    @property
    def columns(self) -> dict[str, gr.components.Component]:
        """The column dropdowns, by field."""
        return {name: self.fields[name] for name in COLUMN_FIELDS}


class FieldNotes:
    """Each field's help as the page shows it (the page sets it: the budget's names the detected memory), and a
    field's problem in its place."""

    def __init__(self) -> None:
        self.infos: dict[str, str] = {name: spec.info for name, spec in SPECS.items()}

    def notes(self, problems: dict[str, str]) -> dict[str, Any]:
        """Each field's help, or (for the fields in `problems`) its problem in its place, marked: a bad value is
        shown next to its field, and a fixed one goes back to its help."""
        return {name: gr.update(info=f"⚠️ {problems[name]}" if name in problems else info,
                                elem_classes=["ft-invalid"] if name in problems else [])
                for name, info in self.infos.items()}

    def column(self, name: str, problems: dict[str, str]) -> dict[str, Any]:
        """A column dropdown's help, or its problem: the keyword arguments of its update."""
        if name in problems:
            return {"info": f"⚠️ {problems[name]}", "elem_classes": ["ft-invalid"]}
        return {"info": self.infos.get(name, ""), "elem_classes": []}


@dataclass(frozen=True, kw_only=True)
class TaskGuess:
    """The task told from a model name, and a note on how (or why not)."""

    task: Any = keep()
    note: str


@dataclass(frozen=True, kw_only=True)
class FieldsShown:
    """Which fields the form shows for the chosen task kind and data source (only what applies)."""

    fields: dict[str, Any]  # field → visibility update
    tasks_section: Any = keep()  # the multi-task accordion: only for kinds that train several tasks at once
    chat_example: Any = keep()  # the first example: hidden for a kind whose entry names no data preview


def asked_config(status: JobStatus) -> Path:
    """The config the user asked for (`launch.yaml`, what the form held at Start: `auto` where it said auto), not
    the one the run resolved (`config.yaml`, which a resumed run is launched with: micro-batch 32, LoRA false…)."""
    launched = status.run_dir / "launch.yaml" if status.run_dir is not None else None
    return launched if launched is not None and launched.is_file() else status.config_path


class FormHandlers:
    """The form's own handlers; `refresh` is the Dataset panel's (a reload's config shows its data too)."""

    def __init__(self, state: AppState, refresh: Any):
        self.state = state
        self.refresh = refresh  # DatasetHandlers.refresh_dataset

    def on_model(self, model: str, *, request: Any = None) -> TaskGuess:
        """Infer the task from a preset or a local model folder."""
        try:
            self.state.access.check_source((model or "").strip(), "model", ())
        except AccessError as e:
            return TaskGuess(note=f"⚠️ {e}")
        task = infer_task((model or "").strip())
        if task is None:
            return TaskGuess(note="The task cannot be told offline for this model: choose it under Task.")
        return TaskGuess(task=task, note=f"Task inferred from the model: **{task_label(task)}**.")

    def form_fields(self, task: str, source: str, *, request: Any = None) -> FieldsShown:
        """Only what applies: the fields of the chosen task kind and, for a local file, no hub config or split.

        Whether a path is a file is told only of the user's own files: the fields must not tell a visitor which
        paths exist on a shared server."""
        policy = self.state.policy
        user, refusal = policy.who(request)
        try:
            if refusal:
                raise AccessError(refusal)
            self.state.access.check_source((source or "").strip(), "dataset", policy.readable(user))
        except AccessError:
            source = ""
        shown = shown_fields(task, source)
        known = task in kinds.names()
        # A list field's choices of the caller's own runs (GRPO's reward runs), listed when the kind shows it.
        home = policy.runs_home(user, refusal)
        choices = {name: {"choices": suggested(name, home)} for name in SUGGESTIONS if shown.get(name, True)}
        # A hidden kind option goes back to its default: a value set for another kind (preference's β, say) is
        # not sent with this one, where the config would refuse it at a field no one can see. (Columns are set by
        # refresh_dataset for the kind; the hub fields and the one-control fields only hide.)
        reset = {name for name, visible in shown.items()
                 if not visible and name in KIND_FIELDS and name not in COLUMN_FIELDS}
        return FieldsShown(fields={name: gr.update(visible=visible, **(
                               {"value": to_widget(name, FIELDS[name].default)} if name in reset else {}),
                               **choices.get(name, {}))
                               for name, visible in shown.items()},
                           tasks_section=gr.update(visible=takes(task, "tasks") if known else True),
                           chat_example=gr.skip() if not known or kinds.entry(task).data_preview else
                           gr.update(visible=False))

    def suggestions(self, *, request: Any = None) -> dict[str, Any]:
        """The choices of the lists of names (`SUGGESTIONS`) with the caller's runs, read again as such a field is
        focused: a reward run that finished while the page was open is offered too."""
        user, refusal = self.state.policy.who(request)
        home = self.state.policy.runs_home(user, refusal)
        return {name: gr.update(choices=suggested(name, home)) for name in SUGGESTIONS}

    def running_config(self, *, request: Any = None) -> FormShown:
        """On page load: the form (and its dataset preview) shows the config of the owner's current or last run, as
        the Run panel does, clearly labelled; its run folder is left out, so the next Start makes a new run rather
        than meeting the running one's folder."""
        user = self.state.access.identify(request)
        status = self.state.jobs.status()
        if status.config_path is None or not self.state.policy.is_mine(status, user):
            return FormShown()
        try:
            config = load_config_file(asked_config(status))
        except ConfigError:  # a config the app did not write, which no longer validates: keep the form
            return FormShown()
        config = from_dict({k: v for k, v in changed_options(config).items() if k not in RUN_FOLDER_FIELDS})
        data: DatasetShown = self.refresh(config.dataset or "", config.dataset_config or "", config.train_split,
                                          config.task, *[getattr(config, c) or "" for c in COLUMN_FIELDS],
                                          request=request)
        return FormShown(values=dict(zip(FIELD_NAMES, config_to_values(config), strict=True)), data=data,
                         note=f"The form shows the settings of run `{display_path(status.run_dir)}`. Start makes a "
                              "new run (in a new folder) from them.")

    def clear_note(self, *, request: Any = None) -> str:
        """Empty the model's note (after an import: the imported model may differ; after a task picked by hand)."""
        return ""
