"""The task-kind protocol: what a kind of task (classification, causal LM, …) owns, so that the data, the loop, the
planner, evaluation and prediction call one object instead of branching on the kind.

A kind owns its columns and their rules, its label names, the encoding of a batch of rows, its Arrow features,
its collation (a micro-batch from its rows), its target count (what a window's loss sum is divided by: exact
accumulation rests on it), its loss sum, its metrics (sums reduced over processes, then finalised), the labels of
the planner's synthetic batch and its logits' size, prediction output, and its Hugging Face names (in its registry
entry, as strings).
How to add one: docs/task-kind-protocol.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from finetune.data.arrow import numpy_of
from finetune.errors import DataError
from finetune.kinds import registry

if TYPE_CHECKING:
    from finetune.config.schema import Config
    from finetune.kinds.registry import Entry

IGNORE_INDEX = -100  # a label position that is not a target (transformers' and torch's convention)
TEXT_NAMES = ("text", "sentence", "sentence1", "content", "review", "document", "question")


# A column's role is its option's name less `_column` (`text_column` → `text`), for every column a kind reads.
ROLES = tuple(dict.fromkeys(key.removesuffix("_column") for e in registry.ENTRIES.values() for key in e.columns))


# `model.generate`'s keywords for decoding when the caller asks for nothing else (`predict`'s `sampling`).
GREEDY: dict[str, Any] = {"do_sample": False}


def _with_roles(cls: type) -> type:
    """`cls` with a field per role in `ROLES` (None by default), before `dataclass` makes it: a kind's own columns,
    declared in its registry entry, need no change here."""
    cls.__annotations__ = {role: "str | None" for role in ROLES}
    for role in ROLES:
        setattr(cls, role, None)
    return cls


@dataclass(frozen=True)
@_with_roles
class Columns:
    """Which data columns feed the model, by role (`text`, `label`, `tokens`, …): each kind sets its own; the
    others stay None."""


@dataclass(frozen=True)
class Encoding:
    """What a kind's `encode_rows` gets besides the rows: the settings that are also the encoding cache's key."""

    tokenizer: Any
    cols: dict[str, str | None]
    max_length: int
    label_index: dict[str, int] | None  # label name → class id, for kinds with named classes
    eos: list[int]  # appended to a document (causal LM), else empty
    mode: str  # long_documents as resolved: truncate, chunk, sliding_window
    context: int  # tokens a block repeats from the one before (sliding_window)
    chat: dict[str, Any] | None = None  # conversations: train_on and the template
    options: dict[str, Any] | None = None  # the kind's own encoding options (its registry entry's `options`)


class Reduce(Protocol):
    """How a metric accumulator combines its state over processes."""

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor summed over all processes."""

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """A 1-D tensor of any length per process, concatenated over all processes (in process order)."""


class Metrics(Protocol):
    """A kind's evaluation metrics, accumulated batch by batch on each process and finalised once over all."""

    def add(self, batch: dict[str, torch.Tensor], logits: torch.Tensor | None, loss: torch.Tensor) -> None:
        """Count one evaluation batch: its labels, the model's logits (None when the loss was computed without
        them, as segment recurrence does) and the batch's loss sum."""

    def result(self, reduce: Reduce) -> dict[str, float]:
        """The metrics over every process's batches (every process calls it: the reductions are collective)."""


class TaskKind(Protocol):
    """One kind of task. Implementations are stateless module-level objects (`KIND` in the kind's module)."""

    entry: Entry  # its registry entry: name, columns, Hugging Face names

    # --- data
    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The columns to use, from the config or guessed from common names; a `DataError` naming what is missing."""

    def label_names(self, table: Any, cols: Columns, source: str) -> list[str] | None:
        """The class names in id order (a `DataError` for unusable labels), or None for a kind without classes."""

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """A `DataError` naming the first row this kind cannot train on (beyond empty texts, checked for all)."""

    def end_of_document(self, tokenizer: Any) -> list[int]:
        """Token ids appended to each encoded document (a causal LM's end of sequence), or none."""

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """One batch of rows → its encoded rows (inside `datasets.map`, maybe in a worker process): `input_ids`,
        the kind's label columns, and `document`/`segment`/`dropped_tokens` (finetune.data.segments)."""

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The Arrow features of the kind's own encoded columns (`datasets` feature types), in column order."""

    def check_encoded(self, data: Any, cols: Columns, c: Config, source: str, documents: bool) -> None:
        """A `DataError` when the encoded rows leave nothing to train on (`documents`: whole, for recurrence)."""

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """A micro-batch from its encoded rows: the model's inputs and its `labels` (most kinds: `padded_batch`; a
        kind whose sample is several sequences stacks them, so that they never part)."""

    def num_targets(self, data: Any, indices: list[int]) -> int:
        """What the loss sum of these samples is divided by (over a window: exact accumulation rests on it)."""

    # --- model
    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """Keyword arguments for the model config (`num_labels`, `id2label`, `problem_type`, …)."""

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward and the sum (not the mean) of the batch's losses, with the logits (None if never made)."""

    def metrics(self, label_names: list[str] | None, device: torch.device) -> Metrics:
        """A fresh metric accumulator for one evaluation."""

    # --- the planner's dry run
    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The labels of a worst-case micro-batch of these (random) input ids."""

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """Bytes the loss's float32 logits (and their gradient) take in one micro-batch, as the planner counts them."""

    # --- use after training
    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str, max_new_tokens: int
                ) -> list[dict[str, Any]]:
        """`finetune predict`'s output, one record per text (a kind that generates also takes `sampling`:
        `model.generate`'s keywords for greedy or sampled decoding, `finetune.use.generation.Generation.sampling`)."""


def padded_batch(rows: pa.Table, pad_id: int,
                 labels: Callable[[pa.Table, np.ndarray, np.ndarray], torch.Tensor]) -> dict[str, torch.Tensor]:
    """One sequence per row, right-padded to the longest (`input_ids`, `attention_mask`, `token_type_ids` where
    the tokenizer made them), and `labels(rows, input_ids, present)`, `present` marking the real tokens."""
    ids = rows.column("input_ids").combine_chunks()
    lengths = numpy_of(pc.list_value_length(ids))
    width = int(lengths.max())
    present = np.arange(width) < lengths[:, None]  # row-major, like the flattened values
    input_ids = np.full((len(lengths), width), pad_id, dtype=np.int64)
    input_ids[present] = numpy_of(ids.flatten())
    batch = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(present.astype(np.int64))}
    if "token_type_ids" in rows.column_names:
        types = np.zeros_like(input_ids)
        types[present] = numpy_of(rows.column("token_type_ids").combine_chunks().flatten())
        batch["token_type_ids"] = torch.from_numpy(types)
    batch["labels"] = labels(rows, input_ids, present)
    return batch


def pick_column(columns: list[str], wanted: str | None, guesses: tuple[str, ...], what: str, key: str) -> str:
    """The column `wanted` (checked), or the first of `guesses` present; a `DataError` naming what is missing."""
    if wanted is not None:
        if wanted not in columns:
            raise DataError(f"{what} column {wanted!r} is not in the data; its columns are: {', '.join(columns)}. "
                            f"Set `{key}` to one of them.")
        return wanted
    for name in guesses:
        if name in columns:
            return name
    raise DataError(f"No {what.lower()} column found (looked for {', '.join(guesses)}); the data's columns are: "
                    f"{', '.join(columns)}. Set `{key}`.")


def refuse_empty_cells(table: Any, columns: tuple[str | None, ...], source: str) -> None:
    """A `DataError` naming the first empty (or missing) cell of `columns` (None: skipped), by the file's own row."""
    for column in columns:
        if column is None:
            continue
        values = table.data.column(column)  # the rows as stored: row numbers are the file's own
        text = values if pa.types.is_string(values.type) or pa.types.is_large_string(values.type) else \
            pc.cast(values, pa.string())
        empty = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(text), ""), True)
        if pc.any(empty).as_py():
            row = pc.index(empty, True).as_py()
            raise DataError(f"Column {column!r} of {source!r} is empty at row {row + 1}: fill or remove that row.")


def texts_of(batch: dict[str, list], column: str) -> list[str]:
    """A text column of a batch of rows, as strings."""
    return [str(v) for v in batch[column]]


class SumMetrics:
    """An accumulator whose state is float64 sums (`size` of them), reduced once and finalised by `finish`."""

    def __init__(self, size: int, device: torch.device,
                 update: Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor], None],
                 finish: Callable[[torch.Tensor], dict[str, float]]) -> None:
        self.sums = torch.zeros(size, dtype=torch.float64, device=device)
        self._update, self._finish = update, finish

    def add(self, batch: dict[str, torch.Tensor], logits: torch.Tensor | None, loss: torch.Tensor) -> None:
        """Count one evaluation batch."""
        self._update(self.sums, batch, logits, loss)

    def result(self, reduce: Reduce) -> dict[str, float]:
        """The metrics of the summed state."""
        return self._finish(reduce.sum(self.sums))


def named_head(label_names: list[str] | None) -> dict[str, Any]:
    """Model-config kwargs of a head with one output per named class (or tag), named by them."""
    names = list(label_names or [])
    return {"num_labels": len(names), "id2label": dict(enumerate(names)),
            "label2id": {n: i for i, n in enumerate(names)}}


def stored_targets(data: Any, indices: list[int]) -> int | None:
    """The targets counted when the rows were written (a `num_targets` column: conversations, packed rows, or a
    kind that counts its own), or None."""
    targets = getattr(data, "stored_targets", None)
    return None if targets is None else int(targets[indices].sum())
