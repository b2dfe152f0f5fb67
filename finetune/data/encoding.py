"""Tokenised data kept in Arrow: tokenised once by `datasets.map`, cached on disk, memory-mapped, collated per batch.

No Python list of the whole set is ever built. The encoded columns are `input_ids`, plus `token_type_ids` when the
tokenizer makes them, and the task kind's own columns (`finetune.kinds`: `label` for classification; `prompt_length`
and, for conversations, `loss_mask` with `num_targets` for a causal LM, whose targets are the input ids themselves,
derived in `collate` rather than stored as a second copy). `document`, `segment` and `dropped_tokens` say where each
row came from (`finetune.rows.segments`). Rows packed by `finetune.data.packing` are collated here too (`packed_batch`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from finetune.config.exclusions import RECURRENCE_NOT_FOR_CONVERSATIONS, takes
from finetune.config.schema import Config
from finetune.data.windows import Windows, epoch_windows
from finetune.errors import ConfigError, DataError
from finetune.kinds.base import IGNORE_INDEX, Columns, Encoding, TaskKind
from finetune.registry import kind as kind_named
from finetune.rows.arrow import numpy_of
from finetune.rows.chat import dropped_counts, dropped_reasons, require_template
from finetune.rows.segments import Segmentation, context_tokens, count_segments, resolve_mode

__all__ = ["IGNORE_INDEX", "Columns", "Encoded", "collate", "encode", "numpy_of", "packed_batch"]

# Bump when encode() changes what it stores, so that caches written by an older version are not reused.
ENCODING_VERSION = 3
# Below this many rows per process, starting worker processes costs more than it saves.
ROWS_PER_PROCESS = 50_000
MAX_PROCESSES = 8


class Encoded:
    """Tokenised samples as an Arrow table (memory-mapped from the cache files where there are any), with their
    lengths as one numpy array."""

    def __init__(self, table: pa.Table, files: list[str] | tuple[str, ...] = (), *,
                 segmentation: Segmentation | None = None, dropped: dict[str, int] | None = None,
                 messages: str | None = None, rows: Any = None) -> None:
        self.table = table
        self.files = list(files)  # the cache files the table is read from (none for data held in memory)
        self.segmentation = segmentation  # what `long_documents` did to the input rows
        self.messages = messages  # the conversation column these rows came from, if any
        self.dropped = dropped or {}  # conversations left out, per reason (see finetune.rows.chat.DROPPED)
        self._rows = rows
        self._batches: list[pa.RecordBatch] = []
        self._starts: np.ndarray | None = None  # where each record batch starts, for `columns`
        # A sample of a kind whose inputs are not tokens (an image) counts as one unit of length.
        self.lengths: np.ndarray = numpy_of(pc.list_value_length(table["input_ids"])).astype(np.int32) \
            if "input_ids" in table.column_names else np.ones(len(table), dtype=np.int32)
        self._widths: np.ndarray | None = None
        self._prompt = (numpy_of(table["prompt_length"]) if "prompt_length" in table.column_names
                        else np.zeros(len(table), dtype=np.int32))
        # Conversations and packed rows count their targets when they are written: the window's count stays one
        # array sum.
        self._targets = numpy_of(table["num_targets"]) if "num_targets" in table.column_names else None

    @classmethod
    def from_dataset(cls, rows: Any, *, segmentation: Segmentation | None = None,
                     dropped: dict[str, int] | None = None, messages: str | None = None) -> Encoded:
        """The encoding held by a `datasets.Dataset` (the output of `encode`'s map, or of packing)."""
        return cls(rows.with_format("arrow")[:], [f["filename"] for f in rows.cache_files],
                   segmentation=segmentation, dropped=dropped, messages=messages, rows=rows.with_format(None))

    @property
    def rows(self) -> Any:
        """These samples as a `datasets.Dataset`, built on first use (training reads `table`, which needs no
        `datasets` import)."""
        if self._rows is None:
            import datasets

            self._rows = (datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in self.files])
                          if self.files else datasets.Dataset(datasets.table.InMemoryTable(self.table)))
        return self._rows

    def __len__(self) -> int:
        return self.table.num_rows

    def add_columns(self, columns: dict[str, np.ndarray | pa.Array]) -> None:
        """Join columns computed after encoding (one value, or one list, per sample, in order), replacing any of the
        same name: `columns` and `collate` then read them like the encoded ones."""
        for name, values in columns.items():
            if name in self.table.column_names:
                self.table = self.table.drop_columns([name])
            self.table = self.table.append_column(name, pa.array(values))
        self._batches, self._starts = [], None

    def columns(self, indices: list[int]) -> pa.Table:
        """These samples' encoded columns, in this order."""
        # One-row slices of the record batches that hold them, found by binary search over where each batch starts
        # (datasets' fast_gather): `Table.take` on a table of thousands of batches costs 0.1 s per micro-batch.
        if self._starts is None:
            self._batches = self.table.to_batches()
            self._starts = np.cumsum([0] + [len(b) for b in self._batches])
        rows = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self._starts, rows, side="right") - 1
        picked = [self._batches[b].slice(i - self._starts[b], 1) for b, i in zip(which, rows, strict=True)]
        return pa.Table.from_batches(picked, schema=self.table.schema)

    @property
    def widths(self) -> np.ndarray:
        """The tokens each sample spans in a micro-batch: its longest sequence of token ids (every `*_ids` list
        column: a preference pair's rejected sequence may be longer than its chosen one), what the planner plans for.
        """
        if self._widths is None:
            widths = self.lengths
            schema = self.table.schema
            for name in self.table.column_names:
                if name.endswith("_ids") and name != "input_ids" and pa.types.is_list(schema.field(name).type):
                    widths = np.maximum(widths, numpy_of(pc.list_value_length(self.table[name])).astype(np.int32))
            self._widths = widths
        return self._widths

    def num_tokens(self, indices: list[int]) -> int:
        """Tokens in these samples."""
        return int(self.lengths[indices].sum())

    @property
    def stored_targets(self) -> np.ndarray | None:
        """Each sample's targets as counted when it was written (a `num_targets` column), or None."""
        return self._targets

    @property
    def prompt_lengths(self) -> np.ndarray:
        """Each sample's leading tokens that are not targets (zeros without a `prompt_length` column)."""
        return self._prompt

    def num_targets(self, indices: list[int], kind: TaskKind) -> int:
        """What the loss is averaged over, as the task kind counts it (samples, next-token targets, …)."""
        return kind.num_targets(self, indices)

    def windows(self, size: int, *, seed: int, epoch: int, shuffle: bool, group_by_length: bool) -> Windows:
        """The epoch's order in windows of `size` (see `epoch_windows`)."""
        return epoch_windows(self.lengths, size, seed=seed, epoch=epoch, shuffle=shuffle,
                             group_by_length=group_by_length)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What identifies a tokenizer's encoding: its vocabulary, normaliser, pre- and post-processing rules; for a
    processor that expands images into tokens, its tokenizer's and its image processor's settings."""
    if (parts := getattr(tokenizer, "fingerprint_parts", None)) is not None:
        inner, settings = parts()
        return hashlib.sha256(f"{tokenizer_fingerprint(inner)}\n{settings}".encode()).hexdigest()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        from datasets.fingerprint import Hasher

        return Hasher.hash(tokenizer)
    # Truncation and padding are set per call (the call's own arguments), not part of what the tokenizer is: its
    # serialisation is taken without them (hashing the text as it is: parsing and re-sorting its JSON took 0.05 s).
    truncation, padding = backend.truncation, backend.padding
    backend.no_truncation()
    backend.no_padding()
    try:
        state = backend.to_str()
    finally:
        if truncation:
            backend.enable_truncation(**truncation)
        if padding:
            backend.enable_padding(**padding)
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{state}".encode()).hexdigest()


def num_processes_for(rows: int) -> int:
    """Tokenising processes for `rows` rows: one per core up to MAX_PROCESSES, one for small sets."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_PROCESSES, rows // ROWS_PER_PROCESS))


def _tokenize(batch: dict[str, list], indices: list[int], *, tokenizer: Any, task: str, cols: dict[str, str | None],
              max_length: int, label_index: dict[str, int] | None, eos: list[int], mode: str,
              context: int, chat: dict[str, Any] | None = None, options: dict[str, Any] | None = None
              ) -> dict[str, list]:
    """One batch of rows → its encoded rows, as the task kind encodes them (runs inside `datasets.map`, possibly in
    a worker process, which finds the kind by name); a long plain text may give several rows."""
    return kind_named(task).encode_rows(batch, indices, Encoding(tokenizer, cols, max_length, label_index, eos, mode,
                                                                 context, chat, options))


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


def _features(kind: TaskKind, cols: Columns, tokenizer: Any, documents: bool = False) -> Any:
    from datasets import Features, List, Value

    spec = {"input_ids": List(Value("int32"))} if kind.entry.inputs == "tokens" else {}
    if documents:  # segment recurrence: whole documents (`_tokenize_documents`)
        return Features({**spec, "prompt_length": Value("int32")} if cols.prompt else spec)
    spec.update(kind.features(cols, tokenizer))
    spec.update(document=Value("int64"), segment=Value("int32"), dropped_tokens=Value("int32"))
    return Features(spec)


def _file_column(table: Any, column: str) -> pa.ChunkedArray:
    # The rows as stored, before any select or split: a split table is read through an index, and gathering a
    # column through it would copy it into memory. Row numbers in messages are then the file's own.
    return table.data.column(column)


def _is_list(table: Any, column: str) -> bool:
    kind = _file_column(table, column).type
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


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


def encode(table: Any, cols: Columns, c: Config, tokenizer: Any, label_names: list[str] | None,
           source: str) -> Encoded:
    """Tokenise a table for the configured task, or reuse the cached encoding of the same rows and settings."""
    kind = kind_named(c.task)
    # Lists of messages (conversational preference pairs) are checked by the kind, and rendered by the template.
    listed = [column for column in (cols.prompt, cols.chosen, cols.rejected) if column and _is_list(table, column)]
    for column in (cols.text, cols.text_pair, cols.prompt, cols.completion, cols.chosen, cols.rejected):
        if column and column not in listed:
            check_strings(table, column, source)
    table = kind.undecoded(table, cols)  # a kind that decodes its media at batch time (images): the rows as stored
    eos = kind.end_of_document(tokenizer)
    documents = c.segment_recurrence and takes(c.task, "segment_recurrence")  # whole documents, split by the loop
    if documents and cols.messages:  # a conversation column guessed from the data
        raise ConfigError([RECURRENCE_NOT_FOR_CONVERSATIONS])
    mode = "whole" if documents else resolve_mode(c, plain_text=not (cols.prompt or cols.messages))
    kind.check_rows(table, cols, label_names, source)
    settings = {"task": c.task, "cols": asdict(cols), "max_length": c.max_length, "eos": eos,
                "label_index": {name: i for i, name in enumerate(label_names)} if label_names else None,
                "mode": mode, "context": context_tokens(c, mode)}
    if kind.entry.options:  # the kind's own options (only for a kind that has some: the others' keys stay as they were)
        settings["options"] = {key: getattr(c, key) for key in kind.entry.options}
    if (own := kind.encoding_options(table, cols, source)) is not None:  # what it reads of the data (image paths)
        settings["options"] = {**settings.get("options", {}), **own}
    if documents:
        settings = {"task": c.task, "cols": asdict(cols), "eos": eos, "max_length": c.max_document_length or 0,
                    "label_index": settings["label_index"]}
    if cols.messages:
        # The template is part of the key: the tokenizer's fingerprint covers its vocabulary, not its template.
        template = require_template(tokenizer, c.model, tools=bool(cols.tools))  # refused here: before training
        settings |= {"eos": [], "chat": {"train_on": c.train_on, "template": template}}
    # The cache key: the rows (datasets' fingerprint of the table: its files and every select/split applied) and
    # everything that changes their encoding. Computed here rather than by hashing the map function, whose
    # tokenizer argument hashes differently once it has been called.
    # The columns in use only: a kind that adds a field to `Columns` leaves the other kinds' keys as they were.
    keyed = {**settings, "cols": {role: column for role, column in settings["cols"].items() if column}}
    if listed:  # the template is part of the key of rows it renders
        keyed["template"] = getattr(tokenizer, "chat_template", None)
    key = hashlib.sha256(json.dumps([ENCODING_VERSION, table._fingerprint, keyed, tokenizer_fingerprint(tokenizer)]
                                    + (["documents"] if documents else []),
                                    sort_keys=True).encode()).hexdigest()[:32]
    workers = num_processes_for(len(table)) if table.cache_files else 1
    tokenize = _tokenize_documents if documents else _tokenize
    rows = table.map(tokenize, batched=True, with_indices=not documents,
                     fn_kwargs={"tokenizer": tokenizer, **settings},
                     remove_columns=table.column_names, features=_features(kind, cols, tokenizer, documents),
                     num_proc=workers if workers > 1 else None, new_fingerprint=key)  # num_proc=1 still uses a pool
    if cols.messages:
        return _kept_conversations(rows, source, cols.messages, mode, c.max_length)
    counts = None if documents or kind.entry.inputs != "tokens" else count_segments(rows, mode, c.max_length,
                                                   splittable=takes(c.task, "split_documents") and not cols.prompt)
    data = Encoded.from_dataset(rows, segmentation=counts)
    data.source_rows = len(table)  # a kind may leave rows out (preference pairs cut by max_length)
    kind.check_encoded(data, cols, c, source, documents)
    return data


def _kept_conversations(rows: Any, source: str, column: str, mode: str, max_length: int) -> Encoded:
    """The conversations that have something to learn; the others are counted by reason, never trained as empty."""
    dropped = dropped_counts(rows.with_format("arrow")["dropped"])
    if dropped and sum(dropped.values()) == len(rows):
        raise DataError(f"None of the {len(rows)} conversation(s) of {source!r} can be trained on "
                        f"({dropped_reasons(dropped)}): check `chat_template`, `train_on` and `max_length`.")
    if dropped:
        rows = rows.filter(_is_kept, input_columns=["dropped"], batched=True).flatten_indices()
    rows = rows.remove_columns("dropped")
    return Encoded.from_dataset(rows, segmentation=count_segments(rows, mode, max_length, splittable=False),
                                dropped=dropped, messages=column)


def _is_kept(dropped: list[int]) -> list[bool]:
    return [d == 0 for d in dropped]


def collate(data: Any, indices: list[int], pad_id: int, kind: TaskKind) -> dict[str, torch.Tensor]:
    """A micro-batch of these samples from their Arrow rows, as the task kind collates them (right-padded only to the
    longest of them); packed rows as `packed_batch` does."""
    rows = data.columns(indices)
    if "segment_lengths" in rows.column_names:  # packed rows (finetune/data/packing.py)
        return packed_batch(rows, pad_id)
    return kind.collate_rows(rows, pad_id)


def packed_batch(rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
    """A micro-batch of packed rows: input ids right-padded to the longest row, position ids restarting at every
    sample (and at the padding), labels with each sample's first token and its prompt masked; no attention mask,
    so that the model builds the block-diagonal mask from the position ids."""
    ids = rows.column("input_ids").combine_chunks()
    lengths = numpy_of(pc.list_value_length(ids))
    width = int(lengths.max())
    present = np.arange(width) < lengths[:, None]  # row-major, like the flattened values
    flat_ids = numpy_of(ids.flatten()).astype(np.int64)
    segments = numpy_of(rows.column("segment_lengths").combine_chunks().flatten()).astype(np.int64)
    segment_starts = np.concatenate([[0], np.cumsum(segments)[:-1]])
    positions = np.arange(len(flat_ids)) - np.repeat(segment_starts, segments)
    prompts = numpy_of(rows.column("segment_prompts").combine_chunks().flatten()) if "segment_prompts" in \
        rows.column_names else np.zeros(len(segments), dtype=np.int64)
    learned = positions >= np.repeat(np.maximum(prompts, 1), segments)
    if "loss_mask" in rows.column_names:  # conversations: only their learned tokens
        learned &= numpy_of(rows.column("loss_mask").combine_chunks().flatten()).astype(bool)

    input_ids = np.full((len(lengths), width), pad_id, dtype=np.int64)
    input_ids[present] = flat_ids
    # Padding restarts its positions too: it is a sequence of its own, which no real token can see (causal, after).
    position_ids = np.arange(width)[None, :] - lengths[:, None]
    position_ids[present] = positions
    labels = np.full_like(input_ids, IGNORE_INDEX)
    labels[present] = np.where(learned, flat_ids, IGNORE_INDEX)
    return {"input_ids": torch.from_numpy(input_ids), "position_ids": torch.from_numpy(position_ids),
            "labels": torch.from_numpy(labels)}
