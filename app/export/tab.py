"""The Export tab: download the model, push it to the Hub, export it for local inference, and the config that
reproduces the run; its widgets and events (the poll, `app.follow`, enables Download and Push once a run is done)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gradio as gr

from app.export import publish
from app.export.inference import place_export_block
from app.local.training import JobStatus
from app.picks import newest_pick

if TYPE_CHECKING:
    from app.follow import Seen
    from app.tabs import Page

PRIVATE = {"api_visibility": "private"}


@dataclass
class ExportTab:
    """The Export tab's components (the inference block's stay inside it)."""

    download: Any
    hub_note: Any
    push_repo: Any
    push_private: Any
    push: Any
    push_message: Any
    export_config: Any
    import_config: Any
    message: Any
    command: Any
    yaml: Any
    config_file: Any
    export_pick: Any  # the run or checkpoint every button of the tab acts on (`app.picks`, `app.export.picked`)

    @property
    def polled(self) -> dict[str, Any]:
        """Where the views of `refresh` go."""
        return {"command": self.command, "config_yaml": self.yaml, "config_file": self.config_file,
                "hub_note": self.hub_note, "push_repo": self.push_repo,
                "export_pick": self.export_pick}


def refresh(seen: Seen) -> dict[str, Any]:
    """The Export tab's view of the run, for the poll (`app.follow`): how its last push went, the Reproduce box
    when the run's command changed, and the picker (the newest run picked: its change enables Download and Push)
    after the run changed."""
    status, new_command = seen.status, seen.new_command
    return {"command": seen.command if new_command else gr.skip(),
            "config_yaml": config_text(status) if new_command else gr.skip(),
            "config_file": None if new_command else gr.skip(),
            "hub_note": publish.hub_markdown(status, on_space=bool(seen.state.restart_notice)),
            "push_repo": seen.options["push_to_hub"] or gr.skip(),
            **({"export_pick": newest_pick(seen)} if seen.changed_run else {})}


def config_text(status: JobStatus) -> str:
    """The config the run's command runs, as the Reproduce box shows it."""
    try:
        return status.config_path.read_text(encoding="utf-8", errors="replace") if status.config_path else ""
    except OSError:  # deleted meanwhile: the command alone
        return ""


def build(page: Page) -> ExportTab:
    """The Export tab's widgets, inside the open `gr.Tab` (the inference block wired as it is made)."""
    on, h = page.on, page.h
    # One pick for the whole tab: Download, Push, Export model and Push the export act on the same model.
    export_pick = gr.Dropdown([], value=None, label="Model to download, push or export", elem_id="export-run",
                              info="Your finished runs (newest first) and the checkpoints of stopped ones")
    gr.Markdown("## Download or push the model")
    download = gr.DownloadButton("Download model", interactive=False, elem_id="download-model")
    hub_note = gr.Markdown(elem_id="hub-note")
    with gr.Row():
        push_repo = gr.Textbox(label="Hub repository", placeholder="your-name/my-model", scale=3, max_length=200,
                               elem_id="push-repo")
        push_private = gr.Checkbox(label="Private", value=True, scale=1)
        push = gr.Button("Push to the Hub", scale=1, interactive=False)
    push_message = gr.Markdown(elem_id="push-message")
    place_export_block(on, h.inference, export_pick, page.load)
    with gr.Column(variant="panel"):
        gr.Markdown("## Reproduce")
        with gr.Row():
            export_config = gr.Button("Export config")
            import_config = gr.UploadButton("Import config", file_types=[".yaml", ".yml"])
        message = gr.Markdown(elem_id="repro-message")
        command = gr.Textbox(label="Command", interactive=False, buttons=["copy"], elem_id="repro-command")
        yaml_code = gr.Code(language="yaml", label="Config (YAML)", interactive=False)
        config_file = gr.File(label="Config file", interactive=False)
    return ExportTab(export_pick=export_pick,
                     download=download, hub_note=hub_note, push_repo=push_repo, push_private=push_private, push=push,
                     push_message=push_message, export_config=export_config, import_config=import_config,
                     message=message, command=command, yaml=yaml_code, config_file=config_file)


def wire(page: Page, tab: ExportTab) -> None:
    """The picker's list read again when the tab is opened and the page loads (the pick kept); Push, Export config
    and Import config (which fills the Train tab's form, then reads its data again, and names the file in the note
    over the form)."""
    on, h, train, form_note = page.on, page.h, page.built["train"], page.form_note
    for event in (page.selected["export"], page.load):
        on(event, h.inference.choices, tab.export_pick, {}, outputs=tab.export_pick, gate="quiet",
           show_progress="hidden", **PRIVATE)
    on(tab.push.click, h.publish.push, [tab.push_repo, tab.push_private, tab.export_pick],
       {"message": tab.push_message}, concurrency_id="push", **PRIVATE)
    # A pick by hand, or the newest after a run finished (the poll, `app.follow`): the buttons act on it.
    on(tab.export_pick.change, h.publish.model, tab.export_pick, {"download": tab.download, "push": tab.push},
       show_progress="hidden", **PRIVATE)
    on(tab.export_config.click, h.reproduce.export, train.form.values,
       {"yaml": tab.yaml, "file": tab.config_file, "command": tab.command, "message": tab.message}, **PRIVATE)
    imported = on(tab.import_config.upload, h.reproduce.import_config, tab.import_config,
                  {"values": train.form.by_name, "note": tab.message, "yaml": tab.yaml, "command": tab.command,
                   "file": tab.config_file, "form_note": form_note}, **PRIVATE)
    refreshed = on(imported.then, h.dataset.refresh_dataset, train.data_inputs, train.data_targets,
                   show_progress="hidden", **PRIVATE)
    on(refreshed.then, h.form.clear_note, None, {}, outputs=train.model_note, gate="public", **PRIVATE)
