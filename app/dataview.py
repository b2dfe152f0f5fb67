"""The Dataset block: load a file or hub dataset, preview it, guess and check the column mapping, count labels."""

from __future__ import annotations

import functools
import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from app.mapping import COLUMN_FIELDS
from finetune.config import Config
from finetune.data import DataError, is_local, label_counts, label_names_of, load_table, resolve_columns

PREVIEW_ROWS = 5
UPLOAD_TYPES = [".csv", ".tsv", ".json", ".jsonl", ".parquet"]


@dataclass(frozen=True)
class DatasetView:
    """A dataset as the page shows it; `error` is one sentence to put next to the field ("" when fine)."""

    columns: list[str] = field(default_factory=list)
    preview: pd.DataFrame = field(default_factory=pd.DataFrame)
    rows: int = 0
    chosen: dict[str, str | None] = field(default_factory=dict)  # column field → column
    labels: dict[str, int] = field(default_factory=dict)  # label → rows
    error: str = ""


@functools.lru_cache(maxsize=4)
def _load(source: str, config_name: str | None, split: str, stamp: Any) -> Any:
    # `stamp` (size and mtime of a local file) makes an edited file load again.
    return load_table(source, config_name, split)


def load(source: str, config_name: str | None = None, split: str = "train") -> Any:
    """The table behind `source` (a local file or a hub id), cached while the file is unchanged."""
    path = Path(source).expanduser()
    stamp = (path.stat().st_size, path.stat().st_mtime_ns) if is_local(source) and path.is_file() else None
    return _load(source, config_name or None, split or "train", stamp)


def inspect(source: str | None, config_name: str | None, split: str | None, task: str,
            wanted: dict[str, str | None]) -> DatasetView:
    """Load, preview and map the columns: keep the wanted ones that exist, guess the rest, check the labels."""
    if not source:
        return DatasetView(error="Choose a dataset: upload a file, or type a hub dataset id and press Enter.")
    try:
        table = load(source, config_name, split or "train")
    except DataError as e:
        return DatasetView(error=str(e))
    columns = list(table.column_names)
    preview = table.select(range(min(PREVIEW_ROWS, len(table)))).to_pandas()
    kept = {k: v for k, v in wanted.items() if k in COLUMN_FIELDS and v and v in columns}
    kept = _for_task(kept, task)
    try:
        found = resolve_columns(Config(task=task, **kept), columns)
    except DataError as e:
        return DatasetView(columns, preview, len(table), kept, error=str(e))
    chosen = {"text_column": found.text, "text_pair_column": found.text_pair, "label_column": found.label,
              "prompt_column": found.prompt, "completion_column": found.completion}
    view = DatasetView(columns, preview, len(table), chosen)
    return _check(view, table, source)


def _for_task(columns: dict[str, str], task: str) -> dict[str, str]:
    """Only the column options that belong to `task` (the config refuses the others)."""
    wrong = ("prompt_column", "completion_column") if task == "classification" else ("label_column",
                                                                                       "text_pair_column")
    return {k: v for k, v in columns.items() if k not in wrong}


def _check(view: DatasetView, table: Any, source: str) -> DatasetView:
    used = [v for v in view.chosen.values() if v]
    if len(used) != len(set(used)):
        return DatasetView(view.columns, view.preview, view.rows, view.chosen,
                           error="The same column is mapped twice: pick a different column for each role.")
    label = view.chosen.get("label_column")
    if not label:
        return view
    try:
        label_names_of(table, label, source)
    except DataError as e:
        return DatasetView(view.columns, view.preview, view.rows, view.chosen, error=str(e))
    return DatasetView(view.columns, view.preview, view.rows, view.chosen, label_counts(table, label))


def labels_markdown(view: DatasetView) -> str:
    """Label names and counts, or the dataset's size for causal LM."""
    if view.error or not view.columns:
        return ""
    if not view.labels:
        return f"{view.rows} rows · columns: {', '.join(view.columns)}"
    counts = " · ".join(f"`{name}` {n}" for name, n in view.labels.items())
    return f"{view.rows} rows · {len(view.labels)} labels: {counts}"


def keep_upload(uploaded: str, folder: Path) -> Path:
    """A stable copy of an uploaded file (Gradio's temporary copy may be cleaned up before a run reads it).

    The name carries a content hash, so a new file of the same name never changes the data of an earlier run."""
    src = Path(uploaded)
    digest = hashlib.sha256()
    with open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    # Gradio names its copy after the original file; keep that name for people reading the config.
    target = folder / f"{src.stem}-{digest.hexdigest()[:8]}{src.suffix.lower()}"
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    return target
