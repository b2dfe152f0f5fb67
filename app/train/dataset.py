"""The Train tab's Dataset panel: the dataset field and an upload, the preview with the column dropdowns filled from
the data's real columns, the label counts, the first example its kind's entry names (a conversation or a pair), and
the multi-task section with its Tasks table; and the handlers behind them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from app.door import cleanup
from app.door.access import AccessError
from app.mapping import COLUMN_FIELDS, field_problems, in_form_words, plain_words, to_widget
from app.report import display_path
from app.results import DatasetShown, hidden, keep
from app.state import AppState
from app.train import examples, images, preview
from app.train.form import NONE_CHOICE, FieldNotes, Form
from app.train.tasks import tasks_config, tasks_frame
from finetune import registry as kinds
from finetune.config.exclusions import takes
from finetune.config.schema import FIELDS, ConfigError
from finetune.errors import DataError

TASK_COLUMNS = {name: kinds.entry(name).columns for name in kinds.names()}  # the column widgets each kind shows
TASK_FIELDS = ("tasks", "mixing", "mixing_temperature", "mixing_cap")  # what the Tasks table is drawn from
CHAT_EXAMPLE_LABEL = "The first conversation as the model sees it (learned tokens highlighted)"
PAIR_EXAMPLE_LABEL = "The first pair as the model sees it (scored tokens highlighted)"
# The inputs of the first example, in the order of `DatasetHandlers.chat_example`'s parameters.
EXAMPLE_INPUTS = ("dataset", "dataset_config", "train_split", "task", "messages_column", "model", "chat_template",
                  "train_on", "max_length", "prompt_column", "chosen_column", "rejected_column")


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
class ChatExampleShown:
    """The first example of the data (a conversation, a pair), its scored tokens highlighted (hidden for other
    data), and a note."""

    example: Any = hidden()
    note: str = ""


class DatasetHandlers:
    """The Dataset panel's handlers: what the data looks like, to the user who asks, from their own files only."""

    def __init__(self, state: AppState, notes: FieldNotes):
        self.state, self.notes = state, notes

    def _check_data(self, source: str, request: Any) -> tuple[str | None, str]:
        """Who asks, and why they may not read `source` ("" when they may)."""
        policy = self.state.policy
        user, refusal = policy.who(request)
        try:
            if refusal:
                raise AccessError(refusal)
            self.state.access.check_source((source or "").strip(), "dataset", policy.readable(user))
        except AccessError as e:
            return user, str(e)
        return user, ""

    def refresh_dataset(self, source: str, config_name: str, split: str, task: str, *columns: str,
                        request: Any = None) -> DatasetShown:
        """Preview the dataset and fill the column dropdowns from its real columns."""
        wanted = dict(zip(COLUMN_FIELDS, columns, strict=True))
        _, refused = self._check_data(source, request)
        if refused:  # no preview, and no columns, of a file that is not the user's
            view = preview.DatasetView(error=refused)
        else:
            view = preview.inspect((source or "").strip(), (config_name or "").strip() or None,
                                   (split or "").strip() or "train", task, wanted)
        shown = TASK_COLUMNS.get(task, COLUMN_FIELDS)
        # A missing or unusable column is said beside its dropdown too, not only under the dataset.
        about = field_problems(ConfigError([view.error])) if view.error else {}
        if view.error_field:
            about = {view.error_field: plain_words(view.error)}
        updates = {}
        for name in COLUMN_FIELDS:
            value = view.chosen.get(name) if view.columns else wanted.get(name)
            choices = [NONE_CHOICE, *[(c, c) for c in view.columns]] if view.columns else [NONE_CHOICE]
            if value and value not in view.columns:
                choices.append((value, value))  # an imported mapping stays visible until the data is there
            # Without columns read there is nothing new to say of a value: it is left as the page has it, not set
            # back to what it was when the event fired (a "—" picked just after clearing the dataset stays picked).
            chosen = {"value": value or ""} if view.columns else {}
            updates[name] = gr.update(choices=choices, visible=name in shown, **chosen,
                                      **self.notes.column(name, about))
        return DatasetShown(preview=view.preview, columns=updates, labels=preview.labels_markdown(view),
                            error=f"⚠️ {in_form_words(view.error)}" if view.error else "",
                            images=self._grid(view, source, config_name, split, task))

    def _grid(self, view: preview.DatasetView, source: str, config_name: str, split: str, task: str) -> Any:
        """The first images with their labels, for a kind whose inputs are images (hidden otherwise)."""
        column = view.chosen.get("image_column") if view.columns and not view.error else None
        if task not in kinds.names() or kinds.entry(task).inputs != "images" or not column:
            return gr.update(visible=False)
        label = view.chosen.get("label_column")
        try:  # both columns of every row (a hub dataset's sample): the grid takes images from every class
            table = preview.load(source.strip(), (config_name or "").strip() or None,
                                 (split or "").strip() or "train", columns=(column, label) if label else (column,))
        except DataError:
            return gr.update(visible=False)
        return gr.update(value=images.grid(table, column, label, source.strip()), visible=True)

    def tasks_table(self, text: str, mixing: str, temperature: Any, cap: Any, *, request: Any = None) -> TasksShown:
        """The Tasks table of the multi-task YAML: each task's data, columns, weight and share, after the same file
        policy as a run (a task's `dataset` is a file like any other)."""
        policy = self.state.policy
        user, refusal = policy.who(request)
        try:
            if refusal:
                raise AccessError(refusal)
            self.state.access.check_config(tasks_config(text, mixing, temperature, cap), policy.readable(user))
        except AccessError as e:
            return TasksShown(table=tasks_frame("", mixing, temperature, cap)[0], note=f"⚠️ {e}")
        except ConfigError:
            pass  # the table words the config's own problem
        table, note = tasks_frame(text, mixing, temperature, cap)
        return TasksShown(table=table, note=note)

    def on_upload(self, uploaded: str | None, config_name: str, split: str, task: str, *columns: str,
                  request: Any = None) -> UploadShown:
        """Keep a stable copy of the uploaded file, point `dataset` at it and preview it.

        The evaluation settings go back to a hold-out of the new file: an evaluation set chosen for other data
        (the sample's, say) would not have this file's columns."""
        if not uploaded:
            return UploadShown()
        user, refusal = self.state.policy.who(request)
        if refusal:
            return UploadShown(data=self.refresh_dataset("", "", split, task, *columns, request=request))
        folder = self.state.access.uploads(self.state.runs_dir, user)
        quota, runs_dir = self.state.limits.upload_quota, self.state.runs_dir
        zipped = Path(uploaded).suffix.lower() == ".zip"  # an image folder, unpacked beside the user's other uploads
        try:
            # A zip's images are counted by the unpacked bytes its directory declares, checked before a byte of
            # them is written (a 2 MB zip held a 1.9 GiB image).
            unpacked = images.unpacked_size(Path(uploaded)) if zipped else None
            over = cleanup.upload_quota_problem(runs_dir, folder, Path(uploaded), quota, unpacked)
            if over is None and unpacked is not None:
                over = cleanup.room_problem(runs_dir, unpacked, self.state.limits.min_free_gb)
        except DataError as e:
            over = str(e)
        if over:
            Path(uploaded).unlink(missing_ok=True)  # Gradio's copy: refused, so not kept either
            return UploadShown(data=DatasetShown(preview=gr.skip(), columns={}, labels="", error=f"⚠️ {over}"))
        kept = preview.keep_upload(uploaded, folder)
        if zipped:
            try:
                unpacked_folder = images.unpack_images(kept, folder)
            except DataError as e:
                kept.unlink(missing_ok=True)
                return UploadShown(data=DatasetShown(preview=gr.skip(), columns={}, labels="", error=f"⚠️ {e}"))
            kept.unlink(missing_ok=True)  # the images are kept, not their zip
            kept = unpacked_folder
        source = display_path(kept)
        data = self.refresh_dataset(source, "", split, task, *columns, request=request)
        fraction = FIELDS["eval_fraction"].default
        note = f"Evaluation: {fraction:.0%} of this file is held out (More data options sets another evaluation set)."
        labels = f"{data.labels}\n\n{note}" if data.labels else data.labels
        return UploadShown(dataset=source, eval_dataset="", eval_split="", eval_fraction=fraction,
                           data=DatasetShown(preview=data.preview, columns=data.columns, labels=labels,
                                             error=data.error, images=data.images))

    def chat_example(self, source: str, config_name: str, split: str, task: str, column: str, model: str,
                     chat_template: str, train_on: str, max_length: Any, prompt_column: str = "",
                     chosen_column: str = "", rejected_column: str = "", *, request: Any = None) -> ChatExampleShown:
        """The first example the kind's entry names (`data_preview`): for conversation data the first conversation
        as the model sees it, the learned tokens highlighted; for preference pairs the first pair, its scored
        (completion) tokens highlighted."""
        shows = kinds.entry(task).data_preview if task in kinds.names() else ""
        if not source or not (shows == "pair" or (shows == "conversation" and column)):
            return ChatExampleShown()
        user, refused = self._check_data(source, request)
        try:
            if refused:
                raise AccessError(refused)
            self.state.access.check_source((model or "").strip(), "model", ())
            self.state.access.check_source((chat_template or "").strip(), "chat_template",
                                           self.state.policy.readable(user))
        except AccessError as e:
            return ChatExampleShown(note=f"⚠️ {e}")
        try:
            length = int(max_length)
        except (TypeError, ValueError):
            length = FIELDS["max_length"].default
        where = (source.strip(), (config_name or "").strip() or None, (split or "").strip() or "train")
        if shows == "pair":
            columns = (prompt_column or "prompt", chosen_column or "chosen", rejected_column or "rejected")
            pieces, note = examples.pair_example(*where, columns, (model or "").strip(), length, task)
            label = PAIR_EXAMPLE_LABEL
        else:
            pieces, note = examples.example(*where, column, (model or "").strip(),
                                            (chat_template or "").strip() or None, train_on or "assistant", length,
                                            task)
            label = CHAT_EXAMPLE_LABEL
        return ChatExampleShown(example=gr.update(value=pieces, visible=bool(pieces), label=label), note=note)


@dataclass
class DatasetPanel:
    """The Dataset panel's own components (its config fields are the form's)."""

    upload: Any
    error: Any
    preview: Any
    labels: Any
    example_note: Any
    example: Any
    tasks_section: Any
    tasks_note: Any
    tasks_table: Any
    images: Any

    @property
    def shown(self) -> dict[str, Any]:
        """Where `DatasetShown` goes, but the column dropdowns (the form's)."""
        return {"preview": self.preview, "labels": self.labels, "error": self.error, "images": self.images}


def build_dataset_panel(form: Form) -> DatasetPanel:
    """The Dataset panel, inside the open Train tab column: its fields, the upload, the preview and the rest."""
    data, initial = form.data, form.initial
    gr.Markdown("## 2 · Dataset")
    with gr.Row():
        with gr.Column(scale=3):
            form.place("dataset", per_row=1)
        upload = gr.File(label="Upload dataset", file_types=preview.UPLOAD_TYPES, scale=2, elem_id="upload-dataset",
                         height=160)
    error = gr.Markdown(f"⚠️ {data.error}" if data.error else "", elem_classes="ft-error", elem_id="data-error")
    first_rows = gr.Dataframe(data.preview, label="First rows", interactive=False, max_height=220, wrap=True,
                              max_chars=60)
    form.place("columns", per_row=3)
    grid = gr.Gallery(label="First images", columns=6, height=200, visible=False, elem_id="image-grid",
                      interactive=False)
    labels = gr.Markdown(preview.labels_markdown(data), elem_id="label-counts")
    example_note = gr.Markdown(elem_id="chat-example-note")
    example = gr.HighlightedText(label=CHAT_EXAMPLE_LABEL, color_map={
        examples.LEARNED: "#22c55e", examples.CHOSEN: "#22c55e", examples.REJECTED: "#f87171"}, show_legend=False,
        show_inline_category=False, show_whitespaces=False, visible=False, elem_id="chat-example")
    with gr.Accordion("More data options", open=False):
        form.place("data_more")
    with gr.Accordion("Several datasets at once (multi-task)", open=bool(initial.tasks),
                      visible=takes(initial.task, "tasks")) as tasks_section:
        form.place("tasks", per_row=1)
        tasks_note = gr.Markdown(elem_classes="ft-error", elem_id="tasks-note")
        table = gr.Dataframe(tasks_frame(*[to_widget(n, getattr(initial, n)) for n in TASK_FIELDS])[0],
                             label="Tasks", interactive=False, elem_id="tasks-table")
    return DatasetPanel(upload=upload, error=error, preview=first_rows, labels=labels, example_note=example_note,
                        example=example, tasks_section=tasks_section, tasks_note=tasks_note, tasks_table=table,
                        images=grid)
