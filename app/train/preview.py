"""The Dataset block: load a file or hub dataset, preview it, guess and check the column mapping, count labels.

The preview runs in the server process, for every visitor: a local file is read straight into memory (the first
rows, then only the label column), without the Arrow copy `datasets` would write into its cache; a hub dataset is
streamed (its first rows only) in a worker with a timeout, never downloaded whole.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import itertools
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from app.door.limits import short_text
from app.local import bounded
from app.mapping import COLUMN_FIELDS, task_label
from finetune import registry as kinds
from finetune.config.schema import Config
from finetune.data.load import (
    SANITY_ROWS,
    Columns,
    DataError,
    check_inputs,
    check_json_width,
    class_name,
    is_local,
    label_counts,
    load_table,
    not_text,
    resolve_columns,
)
from finetune.rows.chat import MESSAGES_NAMES

PREVIEW_ROWS = 5
UPLOAD_TYPES = [".csv", ".tsv", ".json", ".jsonl", ".parquet", ".zip"]  # a zip: an image folder (app/train/images.py)
HUB_TIMEOUT_S = 30.0
HUB_SAMPLE_ROWS = 1000  # rows of a hub dataset read for the preview and the label check
# What one preview may cost and send, for any visitor: a file wider than this is refused before its rows are read
# (200,000 columns took 39 s and a 32 MB answer), a cell is cut, and the label and column lists are shortened.
MAX_COLUMNS = 1000
MAX_HEADER_BYTES = 64 * 1024
MAX_PREVIEW_COLUMNS = 50
MAX_CELL_CHARS = 300
MAX_LISTED = 30  # labels or column names listed under the preview
JSONL_SCHEMA_ROWS = 100  # the first records of a JSON Lines file, whose types a read of only some columns takes
MAX_ERROR_CHARS = 600  # a data error lists the columns that exist: at most this much of it
TEXT_ROLES = {"text_column": "Text column", "text_pair_column": "Text pair column", "prompt_column": "Prompt column",
              "completion_column": "Completion column"}


@dataclass(frozen=True)
class DatasetView:
    """A dataset as the page shows it; `error` is one sentence to put next to the field ("" when fine)."""

    columns: list[str] = field(default_factory=list)
    preview: pd.DataFrame = field(default_factory=pd.DataFrame)
    rows: int = 0
    chosen: dict[str, str | None] = field(default_factory=dict)  # column field → column
    labels: dict[str, int] = field(default_factory=dict)  # label → rows
    targets: dict[str, float] = field(default_factory=dict)  # a kind without classes: min, mean, max of its numbers
    error: str = ""
    error_field: str = ""  # the column field the error is about, when it names one (shown at its dropdown)
    sampled: bool = False  # a hub dataset: `rows` and `labels` count only its first rows


def _in_memory(table: Any) -> Any:
    """A `datasets.Dataset` held in memory (no cache file) from a pyarrow table or a pandas frame."""
    import datasets
    import pyarrow as pa

    if isinstance(table, pd.DataFrame):
        table = pa.Table.from_pandas(table, preserve_index=False)
    return datasets.Dataset(datasets.table.InMemoryTable(table))


def _read_local(path: Path, columns: tuple[str, ...] | None, head: int | None) -> Any:
    """The first `head` rows (or all rows) of `columns` (or all columns) of a local file, read as `datasets` reads
    it (pandas for CSV, pyarrow for JSON lines and Parquet) but without writing an Arrow copy into its cache."""
    import pyarrow.json
    import pyarrow.parquet

    suffix, wanted = path.suffix.lower(), list(columns) if columns else None
    if suffix in (".csv", ".tsv"):
        return _in_memory(pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",", usecols=wanted, nrows=head))
    if suffix == ".parquet":
        if head is not None:
            batch = next(pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=head, columns=wanted), None)
            return _in_memory(pyarrow.Table.from_batches([batch]) if batch is not None else pyarrow.table({}))
        return _in_memory(pyarrow.parquet.read_table(path, columns=wanted))
    if suffix == ".jsonl":
        with open(path, "rb") as f:
            first = b"".join(itertools.islice(f, head or JSONL_SCHEMA_ROWS))
        table = pyarrow.json.read_json(io.BytesIO(first))
        if head is None and wanted:
            # Only the wanted columns are built (typed as the first rows have them): pyarrow makes a column of every
            # key it meets, and 40,000 records of one new key each (1.5 MB) took 123 s and 19.6 GB.
            schema = pyarrow.schema([table.schema.field(name) for name in wanted])
            table = pyarrow.json.read_json(path, parse_options=pyarrow.json.ParseOptions(
                explicit_schema=schema, unexpected_field_behavior="ignore"))
        elif head is None:
            table = pyarrow.json.read_json(path)
        return _in_memory(table.select(wanted) if wanted else table)
    raise ValueError(f"{suffix} is read by datasets")  # a .json array, say: only `datasets` reads every layout


def _header(path: Path) -> list[str] | None:
    """The column names of a local file, read from its first line (CSV, JSON lines) or its metadata (Parquet)
    without reading its rows; None for a layout only `datasets` reads (a .json array)."""
    import pyarrow.parquet

    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return list(pyarrow.parquet.read_schema(path).names)
    if suffix not in (".csv", ".tsv", ".jsonl"):
        return None
    with open(path, "rb") as f:
        line = f.readline(MAX_HEADER_BYTES + 1)
    if len(line) > MAX_HEADER_BYTES:
        raise DataError(f"The first line of {path.name!r} is longer than {MAX_HEADER_BYTES // 1024} KB: the app "
                        "previews files with a header (CSV) or a first record (JSON lines) shorter than that.")
    text = line.decode("utf-8", errors="replace")
    if suffix == ".jsonl":
        import json

        try:
            record = json.loads(text)
        except ValueError:
            return None  # `datasets` words the problem
        return list(record) if isinstance(record, dict) else None
    import csv

    return next(csv.reader([text], delimiter="\t" if suffix == ".tsv" else ","), [])


def _check_width(path: Path) -> None:
    """Refuse a file with more than `MAX_COLUMNS` columns before its rows are read."""
    try:
        names = _header(path)
    except DataError:
        raise
    except (OSError, ValueError):
        return  # reading it reports the problem in the data's own words
    if names is not None and len(names) > MAX_COLUMNS:
        raise DataError(f"{path.name!r} has {len(names):,} columns; the app reads files of at most {MAX_COLUMNS:,} "
                        "columns: keep only the columns you train on.")


@functools.lru_cache(maxsize=8)
def _json_width(source: str, stamp: Any) -> None:
    """`check_json_width` once per version of a JSON (Lines) file: its distinct keys over the whole file, counted
    before pyarrow reads any of it (a `DataError` past `MAX_RECORD_KEYS`)."""
    path = Path(source).expanduser()
    if path.suffix.lower() in (".json", ".jsonl") and path.is_file():
        check_json_width(path, source)


@functools.lru_cache(maxsize=8)
def _local(source: str, columns: tuple[str, ...] | None, head: int | None, stamp: Any) -> Any:
    # `stamp` (size and mtime of the file) makes an edited file load again.
    _check_width(Path(source).expanduser())
    _json_width(source, stamp)
    try:
        table = _read_local(Path(source).expanduser(), columns, head)
    except (ValueError, TypeError, KeyError, OSError):  # pandas/pyarrow errors: `datasets` reads it again, and
        table = None  # words the problem in its own message
    if table is None or len(table) == 0:
        table = load_table(source)  # raises the data's own message (or reads a layout only it knows)
        table = table.select_columns(list(columns)) if columns else table
    return table


def _hub_sample(source: str, config_name: str | None, split: str) -> Any:
    """The first rows of a hub dataset, streamed (nothing else of it is downloaded)."""
    import datasets

    datasets.disable_progress_bars()
    try:
        stream = datasets.load_dataset(source, config_name, split=split, streaming=True)
        rows = list(itertools.islice(stream, HUB_SAMPLE_ROWS))
    except (ValueError, OSError, datasets.exceptions.DatasetNotFoundError) as e:  # a bad name, config or split
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DataError(f"Dataset {source!r} is neither a local file nor readable from the Hugging Face Hub "
                        f"({reason}): check the name, config and split, or upload a file.") from None
    if not rows:
        raise DataError(f"Dataset {source!r} has no rows.")
    return datasets.Dataset.from_list(rows, features=stream.features) if stream.features else \
        datasets.Dataset.from_list(rows)


def _within(timeout_s: float, what: str, work: Callable[[], Any]) -> Any:
    """`work()` in a forked child (`app.local.bounded`); a `DataError` when it has not answered within `timeout_s`, and
    the child is killed then: a hub search that hangs does not go on holding a core after its answer."""
    try:
        return bounded.bounded(work, timeout_s, f"Dataset {what!r}")
    except bounded.Overrun:
        raise DataError(f"Dataset {what!r}: the hub did not answer within {timeout_s:g} s; check the id, or try "
                        "again later.") from None


@functools.lru_cache(maxsize=8)
def _hub(source: str, config_name: str | None, split: str) -> Any:
    return _within(HUB_TIMEOUT_S, source, lambda: _hub_sample(source, config_name, split))


def file_stamp(source: str) -> Any:
    """The size and modification time of a local file (None for anything else): a changed file reads again."""
    path = Path(source).expanduser()
    return (path.stat().st_size, path.stat().st_mtime_ns) if path.is_file() else None


def load(source: str, config_name: str | None = None, split: str = "train", columns: tuple[str, ...] | None = None,
         head: int | None = None) -> Any:
    """The table behind `source`: `columns` (default all) and the first `head` rows (default all) of a local file,
    or the first `HUB_SAMPLE_ROWS` rows of a hub dataset; cached while a local file is unchanged."""
    if is_local(source):
        return _local(source, columns, head, file_stamp(source))
    return _hub(source, config_name or None, split or "train")


def inspect(source: str | None, config_name: str | None, split: str | None, task: str,
            wanted: dict[str, str | None], settings: dict[str, Any] | None = None) -> DatasetView:
    """Load, preview and map the columns: keep the wanted ones that exist, guess the rest, check the labels.
    `settings` (the kind's, from Start's config) are what its column check also reads: GRPO's rewards and the
    columns they need."""
    if not source:
        return DatasetView(error="Choose a dataset: upload a file, or type a hub dataset id and press Enter.")
    try:
        head = load(source, config_name, split or "train", head=PREVIEW_ROWS)
    except DataError as e:
        return DatasetView(error=_said(e))
    columns = list(head.column_names)
    if len(columns) > MAX_COLUMNS:  # a hub dataset (a local file was refused before its rows were read)
        return DatasetView(error=f"Dataset {source!r} has {len(columns):,} columns; the app reads data of at most "
                                 f"{MAX_COLUMNS:,} columns.")
    preview = _short_cells(_named_classes(head.select(range(min(PREVIEW_ROWS, len(head)))).select_columns(
        columns[:MAX_PREVIEW_COLUMNS]).to_pandas(), head))
    sampled = not is_local(source)
    try:
        check_inputs(task, head, source)
    except DataError as e:  # images under a text task: said at the dataset, before any column is guessed
        return DatasetView(columns, preview, len(head), error=_said(e), sampled=sampled)
    kept = {k: v for k, v in wanted.items() if k in COLUMN_FIELDS and v and v in columns}
    kept = _for_task(kept, task)
    try:
        found = resolve_columns(Config(task=task, **kept, **(settings or {})), columns)
    except DataError as e:
        return DatasetView(columns, preview, len(head), kept, error=_conversation_hint(head, task) or _said(e),
                           sampled=sampled)
    chosen = {f"{role}_column": column for role, column in dataclasses.asdict(found).items()}
    if problem := _text_problem(source, config_name, split or "train", chosen, kept):
        return DatasetView(columns, preview, len(head), chosen, error=problem[0], error_field=problem[1],
                           sampled=sampled)
    # The rows and the labels need one column of the whole file (of a hub dataset: of its sample).
    try:
        table = load(source, config_name, split or "train", columns=(found.label or columns[0],))
    except DataError as e:
        return DatasetView(columns, preview, len(head), chosen, error=_said(e), sampled=sampled)
    view = DatasetView(columns, preview, len(table), chosen, sampled=sampled)
    return _check(view, table, source, task)


def _said(error: Exception) -> str:
    """A data error's sentence, cut to `MAX_ERROR_CHARS` (it may list every column of the file)."""
    return short_text(str(error), MAX_ERROR_CHARS)


def _named_classes(frame: pd.DataFrame, table: Any) -> pd.DataFrame:
    """The preview with a ClassLabel column's ids as their class names (an image folder's `one`, not 1)."""
    named = {column: frame[column].map(lambda v, column=column: class_name(table, column, v))
             for column in frame.columns if getattr(table.features.get(column), "names", None)}
    return frame.assign(**named) if named else frame


def _short_cells(frame: pd.DataFrame) -> pd.DataFrame:
    """The preview with every cell as text cut to `MAX_CELL_CHARS` (a 100 MB cell was sent whole to the browser;
    a mapping or a list sent as itself showed as "[object Object]"), an image as its file's name."""
    def cut(value: Any) -> Any:
        if isinstance(value, dict) and value and set(value) <= {"bytes", "path"}:  # datasets' Image feature
            name = Path(str(value.get("path") or "")).name
            value = f"image {name}" if name else f"image ({len(value.get('bytes') or b''):,} bytes)"
        text = value if isinstance(value, str) else None
        if text is None and not isinstance(value, (int, float, bool)) and value is not None:
            text = str(value)[:MAX_CELL_CHARS + 1]  # a list of turns, a mapping: its text, cut
        return value if text is None else text if len(text) <= MAX_CELL_CHARS else text[:MAX_CELL_CHARS - 1] + "…"

    return frame.map(cut) if len(frame) else frame


# The kind that trains on conversations (its Dataset block shows the first one).
TALKER = next((n for n in kinds.names() if kinds.entry(n).data_preview == "conversation"), kinds.DEFAULT)


def _conversation_hint(head: Any, task: str) -> str:
    """For conversation data under the form's default kind (a classifier): the advice to switch to the kind that
    trains on conversations ("" otherwise)."""
    # The one kind compared: conversation data lands in the default kind when Task is left as the form opened (the
    # commonest mistake); another kind's own column errors already say what it needs.
    if task != kinds.DEFAULT:
        return ""
    for name in head.column_names:
        first = head[0][name] if len(head) else None
        turns = isinstance(first, list) and first and all(isinstance(t, dict) and "role" in t for t in first)
        if name in MESSAGES_NAMES or turns:
            return (f"Column `{name}` holds conversations, which a classifier cannot learn from: set Task to "
                    f"{task_label(TALKER)} and pick a causal LM model (one with a chat template) to fine-tune "
                    "on them.")
    return ""


def _text_problem(source: str, config_name: str | None, split: str, chosen: dict[str, str | None],
                  given: dict[str, str]) -> tuple[str, str] | None:
    """Why a text column cannot be the text, and which column field it is (None when it can): numbers, or ids (one
    distinct short token per row); a guessed column (the only one left beside the label) says so."""
    for role, what in TEXT_ROLES.items():
        column = chosen.get(role)
        if not column:
            continue
        try:
            table = load(source, config_name, split, columns=(column,), head=SANITY_ROWS)
        except DataError:
            return None  # the full check below words the problem
        how = "" if given.get(role) == column else " (guessed: it is the only column beside the label)"
        # The same check as `finetune train`'s (finetune.data.load.not_text), in the form's words.
        if reason := not_text(table[column][:SANITY_ROWS]):
            return (f"{what} `{column}`{how} {reason}, not text: pick the column with the text under {what}, or "
                    "add one to the file.", role)
    return None


def _for_task(columns: dict[str, str], task: str) -> dict[str, str]:
    """Only the column options that belong to `task` (the config refuses the others)."""
    allowed = kinds.entry(task).columns if task in kinds.names() else COLUMN_FIELDS
    return {k: v for k, v in columns.items() if k in allowed}


def _check(view: DatasetView, table: Any, source: str, task: str = kinds.DEFAULT) -> DatasetView:
    used = [v for v in view.chosen.values() if v]
    if len(used) != len(set(used)):
        return DatasetView(view.columns, view.preview, view.rows, view.chosen, sampled=view.sampled,
                           error="The same column is mapped twice: pick a different column for each role.")
    label = view.chosen.get("label_column")
    if not label:
        return view
    # The kind's own checks of its label column: class names (classification), numbers in every row (regression).
    kind = kinds.kind(task if task in kinds.names() else kinds.DEFAULT)
    try:
        names = kind.label_names(table, Columns(label=label), source)
        if names is None:
            kind.check_rows(table, Columns(label=label), None, source)
    except DataError as e:
        return DatasetView(view.columns, view.preview, view.rows, view.chosen, error=_said(e), sampled=view.sampled)
    if names is None:
        return DatasetView(view.columns, view.preview, view.rows, view.chosen, sampled=view.sampled,
                           targets=target_summary(table, label))
    return DatasetView(view.columns, view.preview, view.rows, view.chosen, label_counts(table, label),
                       sampled=view.sampled)


def target_summary(table: Any, column: str) -> dict[str, float]:
    """The smallest, mean and largest target of a column of numbers (checked by the kind before)."""
    import pyarrow.compute as pc

    values = pc.cast(table.with_format("arrow")[column], "float64")
    return {"min": pc.min(values).as_py(), "mean": pc.mean(values).as_py(), "max": pc.max(values).as_py()}


def summary_markdown(rows: str, summary: dict[str, float]) -> str:
    """The preview's line for a target column: how many rows, and the range of the numbers."""
    return f"{rows} · numbers from {summary['min']:g} to {summary['max']:g} (mean {summary['mean']:.4g})"


def labels_markdown(view: DatasetView) -> str:
    """Label names and counts, or the dataset's size for causal LM."""
    if view.error or not view.columns:
        return ""
    rows = f"the first {view.rows} rows (streamed)" if view.sampled else f"{view.rows} rows"
    if view.targets:
        return summary_markdown(rows, view.targets)
    if not view.labels:
        return f"{rows} · columns: {_listed(view.columns)}"
    counts = _listed([f"`{str(name)[:MAX_CELL_CHARS]}` {n}" for name, n in view.labels.items()], " · ")
    return f"{rows} · {len(view.labels)} labels: {counts}"


def _listed(items: list[str], sep: str = ", ") -> str:
    """At most `MAX_LISTED` items, and how many more there are."""
    shown = sep.join(items[:MAX_LISTED])
    return f"{shown}{sep}… ({len(items) - MAX_LISTED:,} more)" if len(items) > MAX_LISTED else shown


def keep_upload(uploaded: str, folder: Path) -> Path:
    """The uploaded file, kept once in `folder` (Gradio's temporary copy may be cleaned up before a run reads it).

    The file is moved (hard-linked, then Gradio's name removed), never copied, when both are on one disk; it appears
    under its final name in one rename, so a run never reads half of it. The name carries a content hash, so a new
    file of the same name never changes the data of an earlier run."""
    src = Path(uploaded)
    digest = hashlib.sha256()
    with open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    # Gradio names its copy after the original file; keep that name for people reading the config.
    target = folder / f"{src.stem}-{digest.hexdigest()[:8]}{src.suffix.lower()}"
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{target.name}.{uuid.uuid4().hex}.part"
        try:
            os.link(src, tmp)
        except OSError:  # another disk (or no hard links): one copy, still renamed into place
            shutil.copyfile(src, tmp)
        os.replace(tmp, target)
    if src.resolve() != target.resolve():
        src.unlink(missing_ok=True)  # the upload is kept once: Gradio's copy goes
    return target
