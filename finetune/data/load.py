"""Loading and checking the data, and tokenising it into Arrow (`finetune.data.encoding`) or reading it as a stream.

A file or hub dataset becomes a memory-mapped `datasets.Dataset`; its columns are checked, its labels named and its
rows tokenised once, in Arrow, into a cache that the next run with the same rows and settings reuses (from a local
file, without reading or checking the file again: `finetune.data.datacache`). With
`streaming: true` the training rows are read as a stream instead (`finetune.data.stream`). The window order lives in
`finetune.data.windows`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import re
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from finetune.config.batch import resolve_batch
from finetune.config.schema import Config
from finetune.data import datacache
from finetune.data.encoding import IGNORE_INDEX, Columns, Encoded, collate, encode
from finetune.data.packing import check_architecture, pack
from finetune.data.stream import StreamData
from finetune.data.windows import epoch_windows, micro_batches, windows_per_epoch
from finetune.errors import ConfigError, DataError, summary
from finetune.registry import entry, kind, names

__all__ = ["IGNORE_INDEX", "Columns", "DataError", "Encoded", "collate", "encode", "epoch_windows", "load_data",
           "load_table", "micro_batches", "resolve_columns", "windows_per_epoch"]

FILE_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# A stream's class names, when its features do not list them, are the distinct labels of its first rows.
LABEL_PEEK = 10_000
# The most distinct fields the records of one JSON file may have together. `datasets` (pyarrow) makes a column of
# every key it meets: a JSON Lines file whose second record had 200,000 keys took 97.8 s before it failed, and many
# records each with a few new keys widen the table as much. A real file has a few dozen.
MAX_RECORD_KEYS = 1_000
SANITY_ROWS = 200  # rows of a text column read to tell text from numbers or ids
ID_LIKE = re.compile(r"^[A-Za-z0-9_.:#/-]{1,64}$")
TEXT_ROLES = ("text", "text_pair", "prompt", "completion")  # the columns that must hold text, of `Columns`


@functools.cache
def builder_names() -> frozenset[str]:
    """The names `datasets.load_dataset` takes as its own file builders (csv, json, text, parquet, imagefolder, …):
    each reads files from the working folder when given no `data_files`, so none of them is a hub dataset id.

    Read from the installed package's `packaged_modules` folder, without importing `datasets` (a repeated run's
    fast path imports neither datasets nor pandas)."""
    spec = importlib.util.find_spec("datasets")
    names = {"csv", "json", "text", "parquet", "arrow", "pandas", "imagefolder", "audiofolder", "videofolder",
             "webdataset", "xml", "sql", "generator", "spark", "cache"}  # if the folder cannot be read
    for root in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(root) / "packaged_modules"
        if folder.is_dir():
            names.update(p.name for p in folder.iterdir() if p.is_dir() and (p / f"{p.name}.py").is_file())
    return frozenset(names)


def is_local(source: str) -> bool:
    """Whether `source` names a file on disk rather than a hub dataset id (a `datasets` builder name such as `csv`
    counts as local: it would read files from the working folder)."""
    if source.lower() in builder_names() or "\x00" in source:
        return True
    try:
        exists = Path(source).exists()
    except (OSError, ValueError):  # a name too long or with a null byte is no hub id either
        return True
    return Path(source).suffix.lower() in FILE_FORMATS or exists or source.startswith((".", "/", "~"))


def load_table(source: str, config_name: str | None = None, split: str = "train", *, streaming: bool = False
               ) -> Any:
    """A `datasets.Dataset` from a local file or a hub dataset id (an `IterableDataset` when `streaming`)."""
    import datasets

    datasets.disable_progress_bars()
    # A failed read is reported once, in our words; datasets would also log it at ERROR level.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    if is_local(source):
        path = Path(source).expanduser()
        fmt = FILE_FORMATS.get(path.suffix.lower())
        if path.is_dir():  # a folder of images, one subfolder per class (datasets' imagefolder)
            return _image_folder(path, source, streaming)
        if source.lower() in builder_names() and not path.is_file():
            raise DataError(f"{source!r} is the name of a `datasets` file builder, not a dataset: give the path of "
                            "your file (such as data.csv) or a hub dataset id.")
        if not path.is_file():
            raise DataError(f"Dataset file {source!r} does not exist: check the path.")
        if fmt is None:
            raise DataError(f"Dataset file {source!r} has an unknown type: use .csv, .tsv, .json, .jsonl or .parquet.")
        if _blank(path):  # `datasets` says "An error occurred while generating the dataset"
            raise DataError(f"Dataset file {source!r} is empty: give a file with one example per row (a CSV's first "
                            "line names its columns).")
        if fmt == "json":
            check_json_width(path, source)
        kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
        try:
            table = datasets.load_dataset(fmt, data_files=str(path), split="train", streaming=streaming,
                                          **kwargs)
        except Exception as e:  # datasets raises many types for a malformed file; all mean the same to a user
            if fmt == "csv" and (header := _header_only(path)) is not None:  # "Instruction "train" corresponds…"
                raise DataError(f"Dataset file {source!r} has a header line ({header}) but no rows: add one "
                                "example per line under it.") from None
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise DataError(f"Dataset file {source!r} could not be read as {path.suffix} ({reason}): check its "
                            "format.") from None
    else:
        try:
            table = datasets.load_dataset(source, config_name, split=split, streaming=streaming)
        except ValueError as e:
            raise DataError(f"Dataset {source!r} could not be loaded: {str(e).splitlines()[0][:300]}") from None
        except (OSError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as e:
            raise DataError(f"Dataset {source!r} is neither a local file nor reachable on the Hugging Face Hub "
                            f"({type(e).__name__}): check the name, or give a .csv/.tsv/.json/.jsonl/.parquet "
                            "file.") from None
    if not streaming and len(table) == 0:
        raise DataError(f"Dataset {source!r} has no rows.")
    return table


def _blank(path: Path) -> bool:
    """Whether the file holds nothing but white space (read a block at a time, stopping at the first text)."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            if block.strip():
                return False
    return True


def _header_only(path: Path) -> str | None:
    """The header of a CSV or TSV file that has no line after it (its first column names), None otherwise."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in itertools.islice(f, 1000) if line.strip()]
    if len(lines) != 1:
        return None
    return summary(lines[0].strip(), 120)


def _image_folder(path: Path, source: str, streaming: bool) -> Any:
    """The images of a folder with one subfolder per class, labelled by their subfolder (`datasets`' imagefolder:
    each row keeps its image's path; nothing is decoded here)."""
    import datasets

    try:
        table = datasets.load_dataset("imagefolder", data_dir=str(path), split="train", streaming=streaming)
    except (ValueError, FileNotFoundError, datasets.exceptions.DataFilesNotFoundError) as e:
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise DataError(f"Dataset folder {source!r} could not be read as an image folder ({reason}): give a folder "
                        "with one subfolder of images per class, or a data file.") from None
    if not streaming and len(table) == 0:
        raise DataError(f"Dataset folder {source!r} has no images.")
    return table


def check_json_width(path: Path, source: str) -> None:
    """A `DataError` for a JSON or JSON Lines file whose records have more than `MAX_RECORD_KEYS` distinct keys
    together (one record with all of them, or many records each with new ones: `datasets` makes a column of each),
    found before `datasets` reads it, in one pass over the records."""
    import json

    paths: set[tuple[str, ...]] = set()  # the key paths of the records so far
    with open(path, "rb") as f:
        is_array = f.read(1) == b"["
    with open(path, encoding="utf-8", errors="replace") as f:
        lines: Any = _array_records(f) if is_array else enumerate(f, start=1)
        for number, line in lines:
            if not is_array:
                try:
                    line = json.loads(line) if line.strip() else None
                except (ValueError, RecursionError):
                    return  # `datasets` words the problem
            if line is _MALFORMED:
                return
            if _fields(line, paths) > MAX_RECORD_KEYS:
                where = f"record {number:,}" if is_array else f"line {number:,}"
                raise DataError(f"Dataset file {source!r}: its records have more than {MAX_RECORD_KEYS:,} distinct "
                                f"fields together by {where} (nested ones counted), and a file may have at most "
                                f"{MAX_RECORD_KEYS:,}: keep only the fields you train on.")


_MALFORMED = object()  # what `_array_records` yields where the array is no JSON: `datasets` words the problem


def _array_records(f: Any, chunk: int = 1 << 20) -> Any:
    """(number, record) of a JSON array's records, read from `f` a chunk at a time, not as one document (a record
    longer than a chunk doubles the next read); `_MALFORMED` once where the text is no JSON array."""
    import json

    decoder, text, at, number, size = json.JSONDecoder(), f.read(chunk), 1, 0, chunk
    ended = len(text) < chunk
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at < len(text) and text[at] == "]":
            return
        try:
            record, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            if ended:
                yield 0, _MALFORMED
                return
            more = f.read(size)
            size *= 2
            ended = len(more) < size // 2
            text, at = text[at:] + more, 0
            continue
        if end == len(text) and not ended:  # a number may go on in the next chunk: read it whole
            more = f.read(size)
            ended = len(more) < size
            text, at = text[at:] + more, 0
            continue
        number += 1
        yield number, record
        at = end
        if at > chunk and not ended:  # keep the text from growing: drop what was read
            more = f.read(chunk)
            ended = len(more) < chunk
            text, at = text[at:] + more, 0


def _fields(value: Any, paths: set[tuple[str, ...]] | None = None) -> int:
    """The columns and struct fields a JSON value makes in Arrow: its distinct key paths, nested mappings included
    (the mappings of a list share one struct, so a long conversation's turns count once), added to `paths` (the
    other records' paths); stops past the bound."""
    paths = set() if paths is None else paths
    stack: list[tuple[tuple[str, ...], Any]] = [((), value)]
    while stack and len(paths) <= MAX_RECORD_KEYS:
        prefix, item = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                paths.add((*prefix, str(key)))
                if isinstance(inner, (dict, list)):
                    stack.append(((*prefix, str(key)), inner))
        elif isinstance(item, list):
            stack.extend(((*prefix, "[]"), v) for v in item if isinstance(v, (dict, list)))
    return len(paths)


def image_columns(table: Any) -> list[str]:
    """The columns of `table` that hold images (`datasets`' Image feature: an image folder's, or a hub dataset's)."""
    features = getattr(table, "features", None) or {}
    return [name for name, feature in features.items() if type(feature).__name__ == "Image"]


def check_inputs(task: str, table: Any, source: str) -> None:
    """A `DataError` for images under a kind that reads text, which names the kind that reads images: an image
    folder under the default task was cast to text deep inside `datasets` (a pyarrow traceback). The app's Dataset
    block and `finetune train` both ask."""
    found = image_columns(table)
    if not found or task not in names() or entry(task).inputs == "images":
        return
    reader = next(name for name in names() if entry(name).inputs == "images")
    model = next(iter(entry(reader).presets), "")
    raise DataError(f"Dataset {summary(source)} holds images (column {found[0]!r}), which a "
                    f"{entry(task).summary} model cannot learn from: set task={reader}"
                    + (f" and an image model (model={model}, say)" if model else "") + " to train on them.")


def resolve_columns(c: Config, columns: list[str]) -> Columns:
    """The columns to use, from the config or guessed from common names, as the task kind reads them; a `DataError`
    naming what is missing."""
    return kind(c.task).resolve_columns(c, columns)


def not_text(values: list[Any]) -> str | None:
    """Why a column whose first rows are `values` cannot be a text column ("holds numbers", "looks like ids (one
    distinct code per row)"), or None when it may hold text. The app's Dataset block and `finetune train` both ask."""
    values = [v for v in values if v is not None]
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return "holds numbers"
    strings = [v for v in values if isinstance(v, str)]
    if len(strings) >= 2 and len(set(strings)) == len(strings) and all(
            ID_LIKE.match(v) and any(ch.isdigit() for ch in v) for v in strings):
        return "looks like ids (one distinct code per row)"
    return None


def check_text_columns(c: Config, cols: Columns, rows: dict[str, list[Any]], columns: list[str]) -> None:
    """A `DataError` for a text column (text, text pair, prompt, completion) whose first rows are numbers or ids: a
    CSV of `id,score` would otherwise train on the ids, without a word."""
    for role in TEXT_ROLES:
        column = getattr(cols, role)
        if not column or column not in rows:
            continue
        if reason := not_text(rows[column][:SANITY_ROWS]):
            option = f"{role}_column"
            how = "" if getattr(c, option, None) == column else f" (guessed: no `{option}` was given)"
            others = [name for name in columns if name not in dataclasses.astuple(cols)]
            where = f"set {option}= to the column with the text" + (f" (the others are: {', '.join(others[:20])})"
                                                                     if others else "")
            raise DataError(f"Column {column!r}, the `{option}`{how}, {reason}, not text: {where}, or add one to "
                            "the file.")



def load_data(c: Config, tokenizer: Any, *, num_processes: int = 1
              ) -> tuple[Encoded | StreamData, Encoded | None, list[str] | None]:
    """Training and evaluation data, tokenised, and the class names (classification). A stream's length is the
    samples that `max_steps` windows read, which depends on the effective batch and so on `num_processes`."""
    if not c.dataset:
        raise ConfigError(["No `dataset` given: set dataset=<file or hub id> (for example "
                           "dataset=assets/sst2_sample.csv)."])
    if c.packing:  # before anything is tokenised: some architectures cannot keep packed samples apart
        check_architecture(c)
    if c.streaming:
        return _load_stream(c, tokenizer, resolve_batch(c, num_processes).effective_batch_size)
    key = datacache.data_key(c, tokenizer)
    cached = datacache.load(key)
    if cached is not None:  # the same files and settings were loaded, checked and encoded before
        return _for_training(c, cached)
    table, cols, names, eval_table = load_tables(c)
    train_data = encode(table, cols, c, tokenizer, names, c.dataset)
    if c.packing:  # the packed row becomes the sample unit of windows, micro-batches and the plan
        train_data = pack(train_data, c.max_length)
    eval_data = encode(eval_table, cols, c, tokenizer, names, c.eval_dataset or c.dataset) \
        if eval_table is not None else None
    datacache.save(key, train_data, eval_data, names)
    return _for_training(c, (train_data, eval_data, names))


def _for_training(c: Config, loaded: tuple[Encoded, Encoded | None, list[str] | None]
                  ) -> tuple[Encoded, Encoded | None, list[str] | None]:
    """The loaded data with the columns a kind marks its training rows with (images to augment), which the
    evaluation rows lack."""
    train_data = loaded[0]
    marks = kind(c.task).training_columns(c, len(train_data))
    if marks is not None:
        train_data.add_columns(marks)
    return loaded


def load_tables(c: Config) -> tuple[Any, Columns, list[str] | None, Any | None]:
    """The training rows (after `max_train_samples` and the hold-out), their columns, the class names and the
    evaluation rows (a separate set, a split, the hold-out, or None), untokenised."""
    table = load_table(c.dataset, c.dataset_config, c.train_split)
    check_inputs(c.task, table, c.dataset)
    cols = resolve_columns(c, list(table.column_names))
    texts = [getattr(cols, role) for role in TEXT_ROLES if getattr(cols, role)]
    check_text_columns(c, cols, table.select(range(min(SANITY_ROWS, len(table)))).select_columns(texts).to_dict(),
                       list(table.column_names))
    if c.max_train_samples:
        table = table.select(range(min(c.max_train_samples, len(table))))
    # Named before the hold-out is split off: a split table is read through an index, and its distinct labels
    # would need a copy of the column.
    names = kind(c.task).label_names(table, cols, c.dataset)
    eval_table = _eval_table(c, cols)
    if eval_table is None and c.eval_fraction > 0 and len(table) >= 10:
        parts = table.train_test_split(test_size=c.eval_fraction, seed=c.seed)
        table, eval_table = parts["train"], parts["test"]
    return table, cols, names, eval_table


def _eval_table(c: Config, cols: Columns) -> Any | None:
    """The separate evaluation table (`eval_dataset`/`eval_split`, never streamed), with the training columns."""
    if not (c.eval_dataset or c.eval_split):
        return None
    eval_table = load_table(c.eval_dataset or c.dataset, c.dataset_config, c.eval_split or "train")
    missing = [x for x in dataclasses.astuple(cols) if x and x not in eval_table.column_names]
    if missing:
        where = f"eval_dataset={summary(c.eval_dataset)}" if c.eval_dataset else f"eval_split={c.eval_split!r}"
        raise DataError(f"The evaluation data ({where}) lacks column(s) {', '.join(missing)}; its columns are: "
                        f"{', '.join(eval_table.column_names)}: give evaluation data with the training data's "
                        "columns, or set eval_dataset and eval_split empty to hold out eval_fraction of the "
                        "training data.")
    return eval_table


def _load_stream(c: Config, tokenizer: Any, window_size: int) -> tuple[StreamData, Encoded | None, list[str] | None]:
    """Training rows read as a stream and tokenised a window at a time; evaluation data read whole."""
    import datasets

    stream = load_table(c.dataset, c.dataset_config, c.train_split, streaming=True)
    if c.max_train_samples:
        stream = stream.take(c.max_train_samples)
    head = list(itertools.islice(stream, LABEL_PEEK if entry(c.task).has_labels else 1))
    if not head:
        raise DataError(f"Dataset {c.dataset!r} has no rows.")
    check_inputs(c.task, stream, c.dataset)
    cols = resolve_columns(c, list(head[0]))
    check_text_columns(c, cols, {name: [row.get(name) for row in head[:SANITY_ROWS]] for name in head[0]},
                       list(head[0]))
    # A `ClassLabel` feature of the stream names the classes; else the first rows do.
    names = kind(c.task).label_names(datasets.Dataset.from_list(head, features=stream.features), cols, c.dataset) \
        if entry(c.task).has_labels else None
    eval_table = _eval_table(c, cols)

    def encode_window(rows: list[dict[str, Any]]) -> Encoded:
        return encode(datasets.Dataset.from_list(rows, features=stream.features), cols, c, tokenizer, names,
                      c.dataset)

    eval_data = encode(eval_table, cols, c, tokenizer, names, c.eval_dataset or c.dataset) \
        if eval_table is not None else None
    return StreamData(stream, encode_window, num_samples=c.max_steps * window_size), eval_data, names


def label_counts(table: Any, column: str) -> dict[str, int]:
    """How many rows each label value has, most frequent first (for previews and messages), a class id by its class
    name (an image folder's subfolder, a hub dataset's ClassLabel); counted in Arrow."""
    counts = pc.value_counts(table.with_format("arrow")[column]).to_pylist()
    return {class_name(table, column, c["values"]): c["counts"] for c in sorted(counts, key=lambda c: -c["counts"])}


def class_name(table: Any, column: str, value: Any) -> str:
    """A label value as text: a class id of a ClassLabel column by its name (the digit folder `one`, not 1)."""
    feature = (getattr(table, "features", None) or {}).get(column)
    names = getattr(feature, "names", None)
    if names and isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(names):
        return str(names[value])
    return str(value)
