"""Tokenised data kept in Arrow: tokenised once by `datasets.map`, cached on disk, memory-mapped, collated per batch.

No Python list of the whole set is ever built. The encoded columns are `input_ids`, plus `token_type_ids` when the
tokenizer makes them, `label` (classification), `prompt_length` (causal LM: the tokens at the start of a row that
are masked out of the loss, a prompt or the context a block repeats from the one before) and, for conversations
(`finetune.data.chat`), `loss_mask` with `num_targets`: a causal LM's targets are the input ids themselves, so they are
derived in `collate` rather than stored as a second copy. `document`, `segment` and `dropped_tokens` say where each
row came from (`finetune.data.segments`). Rows packed by `finetune.data.packing` are collated here too (`packed_batch`).
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

from finetune.config.schema import RECURRENCE_NOT_FOR_CONVERSATIONS, Config
from finetune.data.chat import (
    check_conversations,
    dropped_counts,
    dropped_reasons,
    encode_conversations,
    require_template,
)
from finetune.data.segments import Segmentation, context_tokens, count_segments, resolve_mode, split_documents
from finetune.data.windows import Windows, epoch_windows
from finetune.errors import ConfigError, DataError

IGNORE_INDEX = -100
# Bump when encode() changes what it stores, so that caches written by an older version are not reused.
ENCODING_VERSION = 3
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
    messages: str | None = None


def numpy_of(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An integer Arrow column as a numpy array, read in place. (pyarrow's `to_numpy` and `pa.array` import
    pandas, half a second of a start that otherwise never needs it.)"""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.null_count or not pa.types.is_integer(array.type):
        return array.to_numpy(zero_copy_only=False)  # not a column that encode() writes
    sign = "u" if pa.types.is_unsigned_integer(array.type) else ""
    dtype = np.dtype(f"{sign}int{array.type.bit_width}")
    if len(array) == 0:
        return np.empty(0, dtype=dtype)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


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
        self.dropped = dropped or {}  # conversations left out, per reason (see finetune.data.chat.DROPPED)
        self._rows = rows
        self._batches: list[pa.RecordBatch] = []
        self._starts: np.ndarray | None = None  # where each record batch starts, for `columns`
        self.lengths: np.ndarray = numpy_of(pc.list_value_length(table["input_ids"])).astype(np.int32)
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

    def num_tokens(self, indices: list[int]) -> int:
        """Tokens in these samples."""
        return int(self.lengths[indices].sum())

    def num_targets(self, indices: list[int], causal: bool) -> int:
        """What the loss is averaged over: samples for classification, next-token targets for a causal LM."""
        if not causal:
            return len(indices)
        if self._targets is not None:
            return int(self._targets[indices].sum())
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


def _label_key(v: Any) -> str:
    return str(int(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _tokenize(batch: dict[str, list], indices: list[int], *, tokenizer: Any, task: str, cols: dict[str, str | None],
              max_length: int, label_index: dict[str, int] | None, eos: list[int], mode: str,
              context: int, chat: dict[str, Any] | None = None) -> dict[str, list]:
    """One batch of rows → its encoded rows (runs inside `datasets.map`, possibly in a worker process); a long
    plain text may give several rows (`finetune.data.segments`)."""
    if cols["messages"]:  # conversations keep truncation: a turn cut from its conversation means nothing alone
        out = encode_conversations(batch[cols["messages"]], tokenizer=tokenizer, train_on=chat["train_on"],
                                   max_length=max_length)
        return {**out, "prompt_length": [0] * len(indices), "document": indices, "segment": [0] * len(indices)}
    def texts(column: str) -> list[str]:
        return [str(v) for v in batch[column]]

    # Whole documents first (no truncation; `verbose=False`: a text longer than the model's limit is expected).
    whole = {"add_special_tokens": True, "verbose": False}
    if task == "classification":
        first, pairs = texts(cols["text"]), texts(cols["text_pair"]) if cols["text_pair"] else None
        enc = dict(tokenizer(first, pairs, **whole))
        full = [len(x) for x in enc["input_ids"]]
        long = [i for i, n in enumerate(full) if n > max_length]
        if long:  # only the long rows are tokenised again, cut as the tokenizer's truncation rule says
            cut = tokenizer([first[i] for i in long], [pairs[i] for i in long] if pairs else None,
                            truncation=True, max_length=max_length)
            for key in enc:
                for j, i in enumerate(long):
                    enc[key][i] = cut[key][j]
        out = {"input_ids": enc["input_ids"], "label": [label_index[_label_key(v)] for v in batch[cols["label"]]],
               "document": indices, "segment": [0] * len(full),
               "dropped_tokens": [max(n - max_length, 0) for n in full]}
        if "token_type_ids" in enc:
            out["token_type_ids"] = enc["token_type_ids"]
        return out
    if cols["prompt"]:
        prompts = tokenizer(texts(cols["prompt"]), **whole)["input_ids"]
        completions = tokenizer(texts(cols["completion"]), **{**whole, "add_special_tokens": False})["input_ids"]
        docs = [p + comp + eos for p, comp in zip(prompts, completions, strict=True)]
        return {"input_ids": [d[:max_length] for d in docs], "prompt_length": [len(p) for p in prompts],
                "document": indices, "segment": [0] * len(docs),
                "dropped_tokens": [max(len(d) - max_length, 0) for d in docs]}
    docs = [x + eos for x in tokenizer(texts(cols["text"]), **whole)["input_ids"]]
    return split_documents(docs, indices, max_length, context, truncate=mode == "truncate")


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


def _features(c: Config, cols: Columns, tokenizer: Any, documents: bool = False) -> Any:
    from datasets import Features, List, Value

    spec = {"input_ids": List(Value("int32"))}
    if documents:  # segment recurrence: whole documents (`_tokenize_documents`)
        return Features({**spec, "prompt_length": Value("int32")} if cols.prompt else spec)
    if c.task == "classification":
        spec["label"] = Value("int64")
        if "token_type_ids" in tokenizer.model_input_names:
            spec["token_type_ids"] = List(Value("int8"))
    else:  # tokens at the start of a row masked out of the loss: a prompt, or context repeated from the block before
        spec["prompt_length"] = Value("int32")
        if cols.messages:
            spec.update(loss_mask=List(Value("int8")), num_targets=Value("int32"), dropped=Value("int8"))
    spec.update(document=Value("int64"), segment=Value("int32"), dropped_tokens=Value("int32"))
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
    documents = c.segment_recurrence and c.task == "causal_lm"  # whole documents, split by the loop itself
    if documents and cols.messages:  # a conversation column guessed from the data
        raise ConfigError([RECURRENCE_NOT_FOR_CONVERSATIONS])
    mode = "whole" if documents else resolve_mode(c, plain_text=not (cols.prompt or cols.messages))
    settings = {"task": c.task, "cols": asdict(cols), "max_length": c.max_length, "eos": eos,
                "label_index": {name: i for i, name in enumerate(label_names)} if label_names else None,
                "mode": mode, "context": context_tokens(c, mode)}
    if documents:
        settings = {"task": c.task, "cols": asdict(cols), "eos": eos, "max_length": c.max_document_length or 0,
                    "label_index": settings["label_index"]}
    if cols.messages:
        check_conversations(_file_column(table, cols.messages), cols.messages, source)
        # The template is part of the key: the tokenizer's fingerprint covers its vocabulary, not its template.
        settings |= {"eos": [], "chat": {"train_on": c.train_on, "template": require_template(tokenizer, c.model)}}
    # The cache key: the rows (datasets' fingerprint of the table: its files and every select/split applied) and
    # everything that changes their encoding. Computed here rather than by hashing the map function, whose
    # tokenizer argument hashes differently once it has been called.
    key = hashlib.sha256(json.dumps([ENCODING_VERSION, table._fingerprint, settings, tokenizer_fingerprint(tokenizer)]
                                    + (["documents"] if documents else []),
                                    sort_keys=True).encode()).hexdigest()[:32]
    workers = num_processes_for(len(table)) if table.cache_files else 1
    tokenize = _tokenize_documents if documents else _tokenize
    rows = table.map(tokenize, batched=True, with_indices=not documents,
                     fn_kwargs={"tokenizer": tokenizer, **settings},
                     remove_columns=table.column_names, features=_features(c, cols, tokenizer, documents),
                     num_proc=workers if workers > 1 else None, new_fingerprint=key)  # num_proc=1 still uses a pool
    if cols.messages:
        return _kept_conversations(rows, source, cols.messages, mode, c.max_length)
    counts = None if documents else count_segments(rows, mode, c.max_length,
                                                   splittable=c.task == "causal_lm" and not cols.prompt)
    data = Encoded.from_dataset(rows, segmentation=counts)
    if c.task == "causal_lm" and cols.prompt and len(data) and data.num_targets(list(range(len(data))), True) == 0:
        cut = f"max_document_length={c.max_document_length}" if documents else f"max_length={c.max_length}"
        raise DataError(f"Every completion of {source!r} is cut off by {cut}: raise it.")
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


def collate(data: Any, indices: list[int], pad_id: int, causal: bool) -> dict[str, torch.Tensor]:
    """A right-padded micro-batch of these samples (padding only to the longest of them), from Arrow rows."""
    rows = data.columns(indices)
    if "segment_lengths" in rows.column_names:  # packed rows (finetune/data/packing.py)
        return packed_batch(rows, pad_id)
    ids = rows.column("input_ids").combine_chunks()
    lengths = numpy_of(pc.list_value_length(ids))
    width = int(lengths.max())
    present = np.arange(width) < lengths[:, None]  # row-major, like the flattened values
    input_ids = np.full((len(indices), width), pad_id, dtype=np.int64)
    input_ids[present] = numpy_of(ids.flatten())
    batch = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(present.astype(np.int64))}
    if "token_type_ids" in rows.column_names:
        types = np.zeros_like(input_ids)
        types[present] = numpy_of(rows.column("token_type_ids").combine_chunks().flatten())
        batch["token_type_ids"] = torch.from_numpy(types)
    if causal:
        labels = np.where(present, input_ids, IGNORE_INDEX)
        if "prompt_length" in rows.column_names:
            prompt = numpy_of(rows.column("prompt_length"))
            labels[np.arange(width) < prompt[:, None]] = IGNORE_INDEX
        if "loss_mask" in rows.column_names:
            learned = np.zeros_like(present)
            learned[present] = numpy_of(rows.column("loss_mask").combine_chunks().flatten()).astype(bool)
            labels[~learned] = IGNORE_INDEX
        batch["labels"] = torch.from_numpy(labels)
    else:
        batch["labels"] = torch.from_numpy(numpy_of(rows.column("label")).astype(np.int64))
    return batch


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
