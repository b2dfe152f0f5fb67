"""Reusing encoded data without reading the source again: the second start on the same local files and settings
memory-maps the Arrow files that `encode` left in the datasets cache, with no `datasets` import, no CSV/JSON
reading and none of the column, label and empty-value checks (they ran, and passed, when those files were written).
What `load_data` returns is what is remembered: packed rows when `packing` is on, the conversations kept and the
counts of those left out, what `long_documents` did.

The key is everything loading, checking and encoding depend on: each source file's absolute path, size and
modification time (the same test `datasets` uses to reuse its own cache of a local file), every option `load_data`
reads, the tokenizer's fingerprint and chat template, and finetune's own data code (so a changed check is never
skipped on an old verdict). Hub datasets, folders of files and streams are not covered: they always take the full
path. An entry is one small JSON file in `$XDG_CACHE_HOME/finetune/data/` (by default `~/.cache/finetune/data/`)
naming the Arrow files, their row counts, the class names and the counts above; deleting the folder is always
safe, and an entry whose files are gone is ignored.

Columns a task kind computes once from a model before training (a preference run's precomputed reference
log-probabilities, distillation's top-k teacher log-probabilities per token) are stored beside the entry, one Arrow
file per part (`<key>-train.arrow`, `<key>-eval.arrow`), under a key of their own (`columns_key`): the data's key and
what the model's values depend on (its identity, the precision, how it is stored, the kind's own settings), so that a
changed reference or teacher computes them again and the encoding is reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from finetune import registry as kinds
from finetune.config.schema import COLUMN_KEYS, Config
from finetune.data.encoding import ENCODING_VERSION, Encoded, tokenizer_fingerprint
from finetune.rows.segments import Segmentation

# Every option load_data reads (tests/test_data_cache.py checks this list against the code of DATA_CODE).
DATA_OPTIONS = tuple(dict.fromkeys((
                "task", "model", "trust_remote_code", "dataset", "dataset_config", "train_split", "eval_dataset",
                "eval_split", "eval_fraction", "seed", "max_train_samples", "max_length", "text_column",
                "text_pair_column", "label_column", "prompt_column", "completion_column", "messages_column",
                "train_on", "chat_template", "long_documents", "stride", "packing", "segment_recurrence",
                "max_document_length", "streaming", *COLUMN_KEYS,
                # Every option a kind brings (a new kind's too). Most are read by the kind's module for its loss,
                # not its rows: keyed all the same, so that the test's walk over the data code stays a plain subset
                # check and a precomputed reference (the preference kind's) can join the entry ...
                *(o.name for e in kinds.ENTRIES.values() for o in e.declares), *kinds.OPTION_KEYS,
                # ... with its reference strategy, which LoRA chooses too.
                "lora",
                # Read by the causal-LM kind's module for its loss (chunked or whole), likewise.
                "chunked_loss")))
def _code_files(module: str) -> list[str]:
    """A kind's module as paths under finetune/: its file, or every file of its package (GRPO's)."""
    path = module.removeprefix("finetune.").replace(".", "/")
    package = Path(__file__).parents[1] / path
    return sorted(f"{path}/{p.name}" for p in package.glob("*.py")) if package.is_dir() else [f"{path}.py"]


# The modules whose code decides what load_data returns: a change to any of them never reuses an old entry.
# Paths under finetune/.
DATA_CODE = ("data/load.py", "data/encoding.py", "data/datacache.py", "rows/segments.py", "rows/chat.py",
             "data/packing.py", "rows/arrow.py", "kinds/base.py", "registry.py", "specs/__init__.py",
             "kinds/labelled.py",  # what the kinds with one label per sample share: their columns, their collation
             *(name for e in kinds.ENTRIES.values() if e.module.startswith("finetune.")
               for name in (*_code_files(e.module), f"specs/{e.name}.py")))  # the kinds' modules encode the rows


def cache_dir() -> Path:
    """Where entries are kept: the user's cache folder (XDG_CACHE_HOME), beside the plan cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune" / "data"


def _file_identity(source: str) -> list[Any] | None:
    path = Path(source).expanduser()
    try:
        if not path.is_file():
            return None  # a hub id, or a path load_data will refuse in its own words
        stat = path.stat()
    except OSError:
        return None
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def data_key(c: Config, tokenizer: Any) -> str | None:
    """The key of `c`'s encoded data with this tokenizer; None when it must not be reused this way."""
    if c.streaming:
        return None
    files = []
    for source in (c.dataset, c.eval_dataset):  # (a `chat_template` file is read into the tokenizer's template)
        if source:
            identity = _file_identity(source)
            if identity is None:
                return None
            files.append(identity)
    code = Path(__file__).parents[1]
    parts = {
        "version": ENCODING_VERSION,
        "files": files,
        "options": {name: getattr(c, name) for name in DATA_OPTIONS},
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "template": getattr(tokenizer, "chat_template", None),  # the fingerprint covers the vocabulary, not this
        "code": hashlib.sha256(b"".join((code / name).read_bytes() for name in DATA_CODE)).hexdigest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _read(part: dict[str, Any] | None) -> Encoded | None:
    """The encoding an entry's part names, memory-mapped; a missing file or a different row count raises."""
    if part is None:
        return None
    tables = [pa.ipc.open_stream(pa.memory_map(name)).read_all() for name in part["files"]]
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if table.num_rows != part["rows"] or "input_ids" not in table.column_names:
        raise ValueError("the cache file does not hold the rows the entry describes")
    segmentation = part["segmentation"]
    return Encoded(table, part["files"], segmentation=Segmentation(**segmentation) if segmentation else None,
                   dropped=part["dropped"], messages=part["messages"])


def load(key: str | None) -> tuple[Encoded, Encoded | None, list[str] | None] | None:
    """(training data, evaluation data, class names) stored under `key`, or None."""
    if key is None:
        return None
    try:
        entry = json.loads((cache_dir() / f"{key}.json").read_text(encoding="utf-8"))
        return _read(entry["train"]), _read(entry["eval"]), entry["label_names"]
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException):  # gone, cut short, or from elsewhere
        return None


def _part(data: Encoded | None) -> dict[str, Any] | None:
    if data is None:
        return None
    return {"files": data.files, "rows": len(data), "dropped": data.dropped, "messages": data.messages,
            "segmentation": dataclasses.asdict(data.segmentation) if data.segmentation else None}


def save(key: str | None, train: Encoded, evaluation: Encoded | None, label_names: list[str] | None) -> None:
    """Remember where this encoding lives; data held only in memory (no cache files) is not remembered."""
    if key is None or not train.files or (evaluation is not None and not evaluation.files):
        return
    path = cache_dir() / f"{key}.json"
    # Processes of a launch may write the same entry at once: each writes its own file and renames it.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    entry = {"train": _part(train), "eval": _part(evaluation), "label_names": label_names}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entry, indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError:  # a cache that cannot be written only costs the next start the full path
        tmp.unlink(missing_ok=True)


def columns_key(data_key: str | None, depends_on: dict[str, Any]) -> str | None:
    """The key of columns computed from a model over the data under `data_key` (None: the data is not cached)."""
    if data_key is None:
        return None
    return hashlib.sha256(json.dumps([data_key, depends_on], sort_keys=True, default=str).encode()).hexdigest()[:32]


def load_columns(key: str | None, part: str, rows: int) -> dict[str, np.ndarray] | None:
    """The columns stored under `key` for `part` (train, eval), or None when absent or not of `rows` rows."""
    if key is None:
        return None
    try:
        table = pa.ipc.open_stream(pa.memory_map(str(cache_dir() / f"{key}-{part}.arrow"))).read_all()
    except (OSError, pa.ArrowException):
        return None
    if table.num_rows != rows:
        return None
    # A list per sample (values per token) stays Arrow, memory-mapped; one value per sample is a numpy array.
    return {name: table.column(name).combine_chunks() if pa.types.is_large_list(table.column(name).type)
            else table.column(name).to_numpy() for name in table.column_names}


def save_columns(key: str | None, part: str, columns: dict[str, np.ndarray | pa.Array]) -> None:
    """Store computed columns under `key` (written under a temporary name and renamed, as entries are)."""
    if key is None:
        return
    path = cache_dir() / f"{key}-{part}.arrow"
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    table = pa.table({name: pa.array(values) for name, values in columns.items()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
