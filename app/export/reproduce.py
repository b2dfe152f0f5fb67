"""The Export tab's *Reproduce* block: the form as the YAML a CLI user would write (a file, and the command that
runs it), and a YAML config imported into the form."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import limits
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


class ReproduceHandlers:
    """Export and Import config: pure functions of the form and of a file (no state of the app's)."""

    def export(self, *values: Any, request: Any = None) -> ExportShown:
        """The form as the YAML a CLI user would write, a file to download and the command that runs it."""
        try:
            config = values_to_config(values)
        except ConfigError as e:
            return ExportShown(message=problems_markdown(e))
        path = Path(tempfile.mkdtemp(prefix="finetune-export-")) / "finetune-config.yaml"
        path.write_text(config_yaml(config, "finetune config, exported from the app.\nRun: finetune train "
                                    "finetune-config.yaml"), encoding="utf-8")
        return ExportShown(yaml=path.read_text(encoding="utf-8"), file=str(path),
                           command="finetune train finetune-config.yaml",
                           message="Exported: download the file, or copy the YAML.")

    def import_config(self, uploaded: str | None, *, request: Any = None) -> FormShown:
        """Fill every widget from a YAML config (its errors are the config's own)."""
        if not uploaded:
            return FormShown()
        if too_big := limits.config_size_problem(uploaded, is_file=True):  # before parsing: a 5 MB YAML takes minutes
            return FormShown(note=f"⚠️ {too_big}")
        try:
            config = load_config_file(uploaded)
        except ConfigError as e:  # in the file's words (its keys), not the form's: the file is what to fix
            return FormShown(note=f"⚠️ {problems_text(e)}")
        return FormShown(values=dict(zip(FIELD_NAMES, config_to_values(config), strict=True)),
                         note=f"Imported `{Path(uploaded).name}`.", yaml=config_yaml(config))
