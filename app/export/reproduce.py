"""The Export tab's *Reproduce* block: the form as the YAML a CLI user would write (a file, and the command that
runs it), and a YAML config imported into the form."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.door import limits
from app.downloads import Downloads
from app.mapping import (
    FIELD_NAMES,
    config_to_values,
    config_yaml,
    load_config_file,
    problems_markdown,
    problems_text,
    values_to_config,
)
from app.results import FormShown, keep
from finetune.config.schema import ConfigError


@dataclass(frozen=True, kw_only=True)
class ExportShown:
    """Export config: the YAML, the file to download, the command that runs it and a message."""

    yaml: Any = keep()
    file: Any = keep()
    command: Any = keep()
    message: str


@dataclass(frozen=True, kw_only=True)
class ImportShown(FormShown):
    """Import config: the form filled from the file, and the Reproduce box and the form's note saying so (the
    command of a run, a YAML exported before and the imported one no longer share the box)."""

    command: Any = keep()
    file: Any = keep()
    form_note: Any = keep()  # the note over the form: whose settings it shows


class ReproduceHandlers:
    """Export and Import config: functions of the form and of a file; an exported file is handed out with the app's
    downloads (swept with them, not left in the system's temporary folder for good)."""

    def __init__(self, downloads: Downloads) -> None:
        self.downloads = downloads

    def export(self, *values: Any, request: Any = None) -> ExportShown:
        """The form as the YAML a CLI user would write, a file to download and the command that runs it."""
        try:
            config = values_to_config(values)
        except ConfigError as e:
            return ExportShown(message=problems_markdown(e))
        text = config_yaml(config, "finetune config, exported from the app.\nRun: finetune train finetune-config.yaml")
        return ExportShown(yaml=text, file=self.downloads.content("finetune-config.yaml", text),
                           command="finetune train finetune-config.yaml",
                           message="Exported: download the file, or copy the YAML.")

    def import_config(self, uploaded: str | None, *, request: Any = None) -> ImportShown:
        """Fill every widget from a YAML config (its errors are the config's own); the Reproduce box shows that
        config alone, and the note over the form names the file."""
        if not uploaded:
            return ImportShown()
        if too_big := limits.config_size_problem(uploaded, is_file=True):  # before parsing: a 5 MB YAML takes minutes
            return ImportShown(note=f"⚠️ {too_big}")
        try:
            config = load_config_file(uploaded)
        except ConfigError as e:  # in the file's words (its keys), not the form's: the file is what to fix
            return ImportShown(note=f"⚠️ {problems_text(e)}")
        name = Path(uploaded).name
        return ImportShown(values=dict(zip(FIELD_NAMES, config_to_values(config), strict=True)),
                           note=f"Imported `{name}`.", yaml=config_yaml(config),
                           command=shlex.join(["finetune", "train", name]), file=None,
                           form_note=f"The form shows the settings imported from `{name}`.")
