"""What the handlers answer, by name: one small frozen dataclass per handler, which `ui.py` maps to its widgets.

A field left at `keep()` leaves its widget as it is; a nested result left at None leaves all of its widgets alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from app.mapping import in_form_words


def keep() -> Any:
    """A field default that leaves the widget as it is (Gradio's skip)."""
    return field(default_factory=gr.skip)


def hidden() -> Any:
    """A field default that hides the widget."""
    return field(default_factory=lambda: gr.update(visible=False))


@dataclass(frozen=True, kw_only=True)
class TaskGuess:
    """The task told from a model name, and a note on how (or why not)."""

    task: Any = keep()
    note: str


@dataclass(frozen=True, kw_only=True)
class DatasetShown:
    """The Dataset block: preview, one dropdown update per column field, label counts and the error line."""

    preview: Any
    columns: dict[str, Any]  # column field → dropdown update
    labels: str
    error: str


@dataclass(frozen=True, kw_only=True)
class TasksShown:
    """The Tasks table of a multi-task config and its note (the config's sentence, or why it is refused)."""

    table: Any
    note: str


@dataclass(frozen=True, kw_only=True)
class UploadShown:
    """An upload: the dataset field points at the kept copy, evaluation goes back to a hold-out, and its preview."""

    dataset: Any = keep()
    eval_dataset: Any = keep()
    eval_split: Any = keep()
    eval_fraction: Any = keep()
    data: DatasetShown | None = None


@dataclass(frozen=True, kw_only=True)
class PlanShown:
    """The plan as text and as a bar chart, or the error next to the Plan button."""

    text: str = ""
    chart: Any = hidden()
    error: str = ""
    fields: dict[str, Any] | None = None  # each field's help, or its problem in its place (None: left as they are)


@dataclass(frozen=True, kw_only=True)
class FieldsShown:
    """Which fields the form shows for the chosen task kind and data source (only what applies)."""

    fields: dict[str, Any]  # field → visibility update
    tasks_section: Any = keep()  # the multi-task accordion: only for kinds that train several tasks at once
    chat_example: Any = keep()  # the first conversation: hidden for a kind that reads none


@dataclass(frozen=True, kw_only=True)
class Started:
    """What a Start did; the button and the API's `start` report the same. Messages are plain sentences."""

    started: bool
    message: str
    run_dir: str | None = None
    command: str = ""  # the command that reproduces the run from a terminal
    data_error: str = ""  # the dataset's problem, when that is what stopped the start
    form_message: str = ""  # the message in the form's words, when they differ from the config's (the API's)
    fields: dict[str, Any] | None = None  # the page: each field's help, or its problem in its place

    @property
    def note(self) -> str:
        """The message as the page shows it, in the form's words: a refusal gets a warning sign."""
        return self.message if self.started else f"⚠️ {in_form_words(self.form_message or self.message)}"

    @property
    def dataset_note(self) -> Any:
        """The line under the Dataset field: its problem, cleared by a start, else left as it is."""
        if self.data_error:
            return f"⚠️ {in_form_words(self.data_error)}"
        return "" if self.started else gr.skip()


@dataclass(frozen=True, kw_only=True)
class TryPanel:
    """Try it, set when the run (or its state) changes: a chat box for a run trained on conversations, a text box for
    the others, Predict only once a model is finished; a new run's model starts a new chat."""

    chat: Any = keep()
    label: Any = keep()
    generated: Any = keep()
    button: Any = keep()
    new_chat: Any = keep()
    text: Any = keep()
    message: Any = keep()
    push: Any = keep()  # Push, like Predict, acts only on a finished model
    entities: Any = keep()  # token classification: the words with their entities highlighted


@dataclass(frozen=True, kw_only=True)
class RunShown:
    """The run panel and results, refreshed by the poll; all left as they are when nothing changed."""

    signature: Any = keep()  # what the poll last showed, to tell whether anything changed
    status: Any = keep()
    progress: Any = keep()
    stats: Any = keep()
    loss_curve: Any = keep()
    log: Any = keep()
    metrics: Any = keep()
    run_dir: Any = keep()
    download: Any = keep()
    start_button: Any = keep()  # disabled while the user's own run is active (someone else's: Start says why not)
    stop_button: Any = keep()
    resume_button: Any = keep()
    command: Any = keep()
    trackers: Any = keep()  # how to open the run's TensorBoard / trackio dashboard
    hub_note: Any = keep()  # the last push, or (on a Space) the advice to push
    push_repo: Any = keep()  # the repository box, filled from the run's push_to_hub
    try_panel: TryPanel | None = None  # None: Try it stays as it is
    note: Any = keep()  # the last action's message (Start, Stop, Resume), cleared when the run ends
    scatter: Any = keep()  # a finished regression run: predicted against true values (app.regressionview)


@dataclass(frozen=True, kw_only=True)
class FormShown:
    """The config form filled from a config (by field name; none given: left as it is), and a note on where from."""

    values: dict[str, Any] = field(default_factory=dict)
    note: Any = keep()
    yaml: Any = keep()
    data: DatasetShown | None = None


@dataclass(frozen=True, kw_only=True)
class PredictionShown:
    """Try it: label probabilities, a generated continuation or the chat with the model (the others hidden), or a
    message; `text` clears the box once a chat message is answered."""

    label: Any = keep()
    generated: Any = keep()
    chat: Any = keep()
    text: Any = keep()
    message: str = ""
    entities: Any = hidden()  # token classification: the words, each entity highlighted with its type


@dataclass(frozen=True, kw_only=True)
class PushShown:
    """Push to the Hub: how it went, in one line."""

    message: str


@dataclass(frozen=True, kw_only=True)
class ChatExampleShown:
    """Conversation data: the first conversation with its learned tokens highlighted (hidden for other data)."""

    example: Any = hidden()
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class ExportShown:
    """Export config: the YAML, the file to download, the command that runs it and a message."""

    yaml: Any = keep()
    file: Any = keep()
    command: Any = keep()
    message: str
