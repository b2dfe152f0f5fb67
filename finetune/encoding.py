"""Tokenised data kept in Arrow: tokenised once by `datasets.map`, cached on disk, memory-mapped, collated per batch.

No Python list of the whole set is ever built. The encoded columns are `input_ids`, plus `token_type_ids` when the
tokenizer makes them, `label` (classification) and `prompt_length` (prompt/completion causal LM): a causal LM's
targets are the input ids themselves, so they are derived in `collate` rather than stored as a second copy.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from finetune.config import Config
from finetune.errors import DataError
from finetune.windows import Windows, epoch_windows

IGNORE_INDEX = -100
# Bump when encode() changes what it stores, so that caches written by an older version are not reused.
ENCODING_VERSION = 1
# Below this many rows per process, starting worker processes costs more than it saves.
ROWS_PER_PROCESS = 50_000
MAX_PROCESSES = 8


@dataclass(frozen=True)
class Columns:
    """Which data columns feed the model."""

    text: str | None = None
    text_pair: str | None = None
    label: str | None = None
    prompt: str | None = None
    completion: str | None = None


class Encoded:
    """Tokenised samples in an Arrow-backed `datasets.Dataset`, with their lengths as one numpy array."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows
        self._arrow = rows.with_format("arrow")
        self.lengths: np.ndarray = pc.list_value_length(self._arrow["input_ids"]).to_numpy().astype(np.int32)
        self._prompt = (self._arrow["prompt_length"].to_numpy() if "prompt_length" in rows.column_names
                        else np.zeros(len(rows), dtype=np.int32))

    def __len__(self) -> int:
        return len(self.rows)

    def columns(self, indices: list[int]) -> pa.Table:
        """These samples' encoded columns, in this order."""
        return self._arrow[indices]

    def num_tokens(self, indices: list[int]) -> int:
        """Tokens in these samples."""
        return int(self.lengths[indices].sum())

    def num_targets(self, indices: list[int], causal: bool) -> int:
        """What the loss is averaged over: samples for classification, next-token targets for a causal LM."""
        if not causal:
            return len(indices)
        # Positions 1.. of a sample are targets unless they belong to the prompt.
        return int(np.maximum(self.lengths[indices] - np.maximum(self._prompt[indices], 1), 0).sum())

    def windows(self, size: int, *, seed: int, epoch: int, shuffle: bool, group_by_length: bool) -> Windows:
        """The epoch's order in windows of `size` (see `epoch_windows`)."""
        return epoch_windows(self.lengths, size, seed=seed, epoch=epoch, shuffle=shuffle,
                             group_by_length=group_by_length)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What identifies a tokenizer's encoding: its vocabulary, normaliser, pre- and post-processing rules."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        from datasets.fingerprint import Hasher

        return Hasher.hash(tokenizer)
    state = json.loads(backend.to_str())
    # Truncation and padding are set per call (the call's own arguments), not part of what the tokenizer is.
    state.pop("truncation", None)
    state.pop("padding", None)
    return hashlib.sha256(json.dumps([type(tokenizer).__name__, state], sort_keys=True).encode()).hexdigest()


def num_processes_for(rows: int) -> int:
    """Tokenising processes for `rows` rows: one per core up to MAX_PROCESSES, one for small sets."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_PROCESSES, rows // ROWS_PER_PROCESS))


def _label_key(v: Any) -> str:
    return str(int(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _tokenize(batch: dict[str, list], *, tokenizer: Any, task: str, cols: dict[str, str | None], max_length: int,
              label_index: dict[str, int] | None, eos: list[int]) -> dict[str, list]:
    """One batch of rows → its encoded columns (runs inside `datasets.map`, possibly in a worker process)."""
    def texts(column: str) -> list[str]:
        return [str(v) for v in batch[column]]

    if task == "classification":
        pairs = texts(cols["text_pair"]) if cols["text_pair"] else None
        enc = tokenizer(texts(cols["text"]), pairs, truncation=True, max_length=max_length)
        out = {"input_ids": enc["input_ids"], "label": [label_index[_label_key(v)] for v in batch[cols["label"]]]}
        if "token_type_ids" in enc:
            out["token_type_ids"] = enc["token_type_ids"]
        return out
    if cols["prompt"]:
        prompts = tokenizer(texts(cols["prompt"]), add_special_tokens=True)["input_ids"]
        completions = tokenizer(texts(cols["completion"]), add_special_tokens=False)["input_ids"]
        return {"input_ids": [(p + comp + eos)[:max_length] for p, comp in zip(prompts, completions, strict=True)],
                "prompt_length": [len(p) for p in prompts]}
    enc = tokenizer(texts(cols["text"]), truncation=True, max_length=max(max_length - 1, 2))
    return {"input_ids": [(x + eos)[:max_length] for x in enc["input_ids"]]}


def _tokenize_documents(batch: dict[str, list], *, tokenizer: Any, task: str, cols: dict[str, str | None],
                        max_length: int | None, label_index: dict[str, int] | None, eos: list[int]
                        ) -> dict[str, list]:
    """Whole causal-LM documents for segment recurrence, cut only at `max_length` (the optional
    `max_document_length`): the training loop splits them into segments itself."""
    def texts(column: str) -> list[str]:
        return [str(v) for v in batch[column]]

    cap = max_length or None
    if cols["prompt"]:
        prompts = tokenizer(texts(cols["prompt"]), add_special_tokens=True)["input_ids"]
        completions = tokenizer(texts(cols["completion"]), add_special_tokens=False)["input_ids"]
        return {"input_ids": [(p + comp + eos)[:cap] for p, comp in zip(prompts, completions, strict=True)],
                "prompt_length": [len(p) for p in prompts]}
    # verbose=False: a document longer than the model's own maximum is the point here, not a mistake.
    enc = tokenizer(texts(cols["text"]), verbose=False)
    return {"input_ids": [(x + eos)[:cap] for x in enc["input_ids"]]}


def _features(c: Config, cols: Columns, tokenizer: Any) -> Any:
    from datasets import Features, List, Value

    spec = {"input_ids": List(Value("int32"))}
    if c.task == "classification":
        spec["label"] = Value("int64")
        if "token_type_ids" in tokenizer.model_input_names:
            spec["token_type_ids"] = List(Value("int8"))
    elif cols.prompt:
        spec["prompt_length"] = Value("int32")
    return Features(spec)


def _file_column(table: Any, column: str) -> pa.ChunkedArray:
    # The rows as stored, before any select or split: a split table is read through an index, and gathering a
    # column through it would copy it into memory. Row numbers in messages are then the file's own.
    return table.data.column(column)


def check_strings(table: Any, column: str, source: str) -> None:
    """A `DataError` if a text column has empty values (counted in Arrow, one stored chunk at a time)."""
    count, first, offset = 0, None, 0
    for chunk in _file_column(table, column).chunks:
        text = chunk if pa.types.is_string(chunk.type) or pa.types.is_large_string(chunk.type) else \
            pc.cast(chunk, pa.string())
        bad = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(text), ""), True)
        found = pc.sum(bad).as_py() or 0
        if found and first is None:
            first = offset + pc.index(bad, True).as_py()
        count, offset = count + found, offset + len(chunk)
    if count:
        raise DataError(f"Column {column!r} of {source!r} has {count} empty value(s) (first at row {first + 1}): "
                        "fill or remove those rows.")


def check_labels(table: Any, column: str, label_names: list[str], source: str) -> None:
    """A `DataError` naming the first label that is not among the training labels."""
    col = _file_column(table, column)
    known = set(label_names)
    unknown = [v for v in pc.unique(col).to_pylist() if _label_key(v) not in known]
    if unknown:
        row = pc.index(col, unknown[0]).as_py()
        raise DataError(f"Label {unknown[0]!r} at row {row + 1} of {source!r} is not among the training labels "
                        f"({', '.join(label_names)}).")


def encode(table: Any, cols: Columns, c: Config, tokenizer: Any, label_names: list[str] | None,
           source: str) -> Encoded:
    """Tokenise a table for the configured task, or reuse the cached encoding of the same rows and settings."""
    for column in (cols.text, cols.text_pair, cols.prompt, cols.completion):
        if column:
            check_strings(table, column, source)
    if c.task == "classification":
        check_labels(table, cols.label, label_names, source)
    eos = [tokenizer.eos_token_id] if c.task == "causal_lm" and tokenizer.eos_token_id is not None else []
    documents = c.segment_recurrence and c.task == "causal_lm"
    settings = {"task": c.task, "cols": asdict(cols), "eos": eos,
                "max_length": (c.max_document_length or 0) if documents else c.max_length,
                "label_index": {name: i for i, name in enumerate(label_names)} if label_names else None}
    # The cache key: the rows (datasets' fingerprint of the table: its files and every select/split applied) and
    # everything that changes their encoding. Computed here rather than by hashing the map function, whose
    # tokenizer argument hashes differently once it has been called.
    key = hashlib.sha256(json.dumps([ENCODING_VERSION, table._fingerprint, settings, tokenizer_fingerprint(tokenizer)]
                                    + (["documents"] if documents else []),
                                    sort_keys=True).encode()).hexdigest()[:32]
    workers = num_processes_for(len(table)) if table.cache_files else 1
    tokenize = _tokenize_documents if documents else _tokenize
    rows = table.map(tokenize, batched=True, fn_kwargs={"tokenizer": tokenizer, **settings},
                     remove_columns=table.column_names, features=_features(c, cols, tokenizer),
                     num_proc=workers if workers > 1 else None, new_fingerprint=key)  # num_proc=1 still uses a pool
    data = Encoded(rows)
    if c.task == "causal_lm" and cols.prompt and len(data) and data.num_targets(list(range(len(data))), True) == 0:
        cut = f"max_document_length={c.max_document_length}" if documents else f"max_length={c.max_length}"
        raise DataError(f"Every completion of {source!r} is cut off by {cut}: raise it.")
    return data


def collate(data: Any, indices: list[int], pad_id: int, causal: bool) -> dict[str, torch.Tensor]:
    """A right-padded micro-batch of these samples (padding only to the longest of them), from Arrow rows."""
    rows = data.columns(indices)
    ids = rows.column("input_ids").combine_chunks()
    lengths = pc.list_value_length(ids).to_numpy()
    width = int(lengths.max())
    present = np.arange(width) < lengths[:, None]  # row-major, like the flattened values
    input_ids = np.full((len(indices), width), pad_id, dtype=np.int64)
    input_ids[present] = ids.flatten().to_numpy()
    batch = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(present.astype(np.int64))}
    if "token_type_ids" in rows.column_names:
        types = np.zeros_like(input_ids)
        types[present] = rows.column("token_type_ids").combine_chunks().flatten().to_numpy()
        batch["token_type_ids"] = torch.from_numpy(types)
    if causal:
        labels = np.where(present, input_ids, IGNORE_INDEX)
        if "prompt_length" in rows.column_names:
            prompt = rows.column("prompt_length").to_numpy()
            labels[np.arange(width) < prompt[:, None]] = IGNORE_INDEX
        batch["labels"] = torch.from_numpy(labels)
    else:
        batch["labels"] = torch.from_numpy(rows.column("label").to_numpy().astype(np.int64))
    return batch
