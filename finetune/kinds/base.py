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
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from finetune import registry
from finetune.errors import DataError
from finetune.rows.arrow import numpy_of

if TYPE_CHECKING:
    from finetune.config.schema import Config
    from finetune.registry import Entry

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


class DataCodec(Protocol):
    """A kind's data: its columns and their rules, its encoding of rows, their Arrow features, its collation."""

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
        the kind's label columns, and `document`/`segment`/`dropped_tokens` (finetune.rows.segments)."""

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The Arrow features of the kind's own encoded columns (`datasets` feature types), in column order."""

    def check_encoded(self, data: Any, cols: Columns, c: Config, source: str, documents: bool) -> None:
        """A `DataError` when the encoded rows leave nothing to train on (`documents`: whole, for recurrence)."""

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """A micro-batch from its encoded rows: the model's inputs and its `labels` (most kinds: `padded_batch`; a
        kind whose sample is several sequences stacks them, so that they never part)."""

    def num_targets(self, data: Any, indices: list[int]) -> int:
        """What the loss sum of these samples is divided by (over a window: exact accumulation rests on it)."""

    # --- with defaults: what a kind whose inputs are text leaves as it is
    def load_preprocessor(self, path: str, trust_remote_code: bool = False) -> Any:
        """The model's own preprocessor, for a kind whose inputs are not text (images: the image processor), or
        None (default): the model's tokenizer."""
        return None

    def undecoded(self, table: Any, cols: Columns) -> Any:
        """The rows as encoding reads them; a kind that decodes its media at batch time keeps them as stored.
        Default: the table itself."""
        return table

    def encoding_options(self, table: Any, cols: Columns, source: str) -> dict[str, Any] | None:
        """What the kind reads of the data itself (where image paths start), part of the encoding's cache key; None
        (default): nothing."""
        return None

    def training_columns(self, c: Config, rows: int) -> dict[str, np.ndarray] | None:
        """Columns that mark the training rows (images to augment), which the evaluation rows lack; None (default):
        none."""
        return None


class Objective(Protocol):
    """A kind's model and loss: its head, its loss sum, its metrics, and how its batches count."""

    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """Keyword arguments for the model config (`num_labels`, `id2label`, `problem_type`, …)."""

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward and the sum (not the mean) of the batch's losses, with the logits (None if never made)."""

    def metrics(self, label_names: list[str] | None, device: torch.device) -> Metrics:
        """A fresh metric accumulator for one evaluation."""

    # --- with defaults
    counted_per_sample: int = 1  # what the batch sizes count per data row (GRPO: the G completions of a prompt)
    steps_per_window: int = 1  # optimizer steps a window trains in a row (GRPO's num_iterations)

    def configured(self, c: Config) -> Any:
        """The kind as run config `c` sets it (its loss's settings, its weights); default: itself."""
        return self

    @property
    def step_metrics(self) -> tuple[str, ...]:
        """Its metrics followed per optimizer step; default: its registry entry's."""
        return self.entry.step_metrics  # type: ignore[attr-defined]  # TaskKind's `entry`

    def prepare_batch(self, model: Any, batch: dict[str, torch.Tensor], *, step: int) -> dict[str, torch.Tensor]:
        """A collated micro-batch made ready to score (GRPO generates its groups here); default: the batch."""
        return batch

    def generate_batch(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """What the model generates for an evaluation batch, for metrics scored on it (seq2seq's texts); None
        (default): the metrics read the logits."""
        return None

    def trained_model(self, model: Any) -> Any:
        """The part of the loaded model that trains (an embedding model's encoder, its pooler frozen); default: the
        whole model."""
        return model

    def frozen_modules(self, model: Any, c: Config) -> list[str]:
        """Names of the model's modules that stay frozen with run config `c` and that LoRA leaves alone (a
        vision-language model's vision tower); default: none."""
        return []


def _needs(hook: str, why: str) -> NotImplementedError:
    """The error of a hook a kind must implement when its entry asks for it."""
    return NotImplementedError(f"A kind with {why} implements `{hook}`.")


class WindowLoss(Protocol):
    """A loss over the whole window (`Entry.whole_window`: in-batch negatives, GRPO's groups), taken by
    finetune.engine.gradcache; and a window trained again (`steps_per_window` > 1). A kind without them keeps the
    defaults, which are never called."""

    def embed(self, model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One float32 output per sequence of a collated micro-batch (its inputs, without labels)."""
        raise _needs("embed", "`whole_window`")

    def as_samples(self, reps: torch.Tensor, batch: int) -> torch.Tensor:
        """A micro-batch's outputs (rows) as its `batch` samples."""
        raise _needs("as_samples", "`whole_window`")

    def as_rows(self, samples: torch.Tensor) -> torch.Tensor:
        """`as_samples` undone."""
        raise _needs("as_rows", "`whole_window`")

    def window_loss_sum(self, samples: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss sum of a whole window's samples with their labels."""
        raise _needs("window_loss_sum", "`whole_window`")

    def micro_pieces(self, inputs: dict[str, torch.Tensor], rows: int) -> list[dict[str, torch.Tensor]]:
        """A prepared batch's inputs as the micro-batches that run forward and backward, `rows` rows each (GRPO's
        completions, a part of a group too); default: the batch whole (its rows are not samples)."""
        return [inputs]

    def keep_groups(self, batch: dict[str, torch.Tensor], logps: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """A prepared micro-batch as the samples a window trained again is made of."""
        raise _needs("keep_groups", "`steps_per_window` > 1")

    def join_groups(self, groups: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
        """Samples kept by `keep_groups` as a prepared micro-batch."""
        raise _needs("join_groups", "`steps_per_window` > 1")


class Precomputed(Protocol):
    """Columns computed once before training and kept in the data cache (a preference reference's
    log-probabilities). A kind with none keeps `precomputes` empty; the other hooks are then never called."""

    precomputes: tuple[str, ...] = ()  # the columns; default none

    def precompute_source(self) -> str:
        """The model whose outputs are precomputed (what the stored values are keyed by)."""
        raise _needs("precompute_source", "`precomputes`")

    def precompute_model(self, model: Any) -> AbstractContextManager[Any]:
        """The model of the pass, as a context (loaded for it and freed after)."""
        raise _needs("precompute_model", "`precomputes`")

    def precompute_batch(self, reference: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The precomputed columns of one collated micro-batch: a value per sample (B,), or per token (B, T, width)."""
        raise _needs("precompute_batch", "`precomputes`")

    def precompute_settings(self) -> dict[str, Any]:
        """What the values depend on besides the model, the data and the precision (part of their key: distillation's
        temperature and top-k); default: nothing."""
        return {}


@dataclass(frozen=True)
class ChunkedLoss:
    """A kind's loss computed a chunk of positions at a time, so that the full [tokens × vocabulary] logits never
    exist: the planner's chunked-loss rung (`chunked_loss`), which the kind contributes (`chunked_variant`)."""

    kind: Any  # the kind (a `TaskKind`) whose `loss_sum` and `logits_bytes` are chunked: what the rung dry-runs
    unsupported: Callable[[Any], str | None]  # why a model (its skeleton) cannot compute it so; None: it can
    chunk_positions: Callable[[int], int]  # positions per chunk, for a vocabulary of this size (the plan's note)


class PlanTerms(Protocol):
    """What a kind adds to the planner: its synthetic batch, its logits, the terms beside the model, its own rung."""

    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The labels of a worst-case micro-batch of these (random) input ids."""

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """Bytes the loss's float32 logits (and their gradient) take in one micro-batch, as the planner counts them."""

    # --- with defaults: a kind whose sample is one sequence of tokens, with nothing beside its model
    sequences_per_sample: int = 1  # sequences the planner's micro-batch holds per sample (a preference pair: 2)
    generated_tokens: int = 0  # tokens a sample grows by while training (GRPO's completions)

    def synthetic_batch(self, model: Any, micro: int, device: Any = None) -> dict[str, torch.Tensor] | None:
        """A worst-case micro-batch for a kind whose inputs are not tokens (images of the model's size); None
        (default): random tokens with `synthetic_labels`."""
        return None

    def synthetic_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inputs the kind joins to its batches besides the tokens (a precomputed reference's log-probabilities);
        default: none."""
        return {}

    def plan_reference(self, *, weights: int, cuda: bool, micro: int, tokens: int, vocab: int,
                       model_config: Any = None, layers: int = 0, precision: str = "fp32", data_tokens: int = 0
                       ) -> tuple[dict[str, int], dict[str, Any], str | None] | None:
        """What a reference model costs the plan (its peak terms, the record plan.json keeps, the plan's note;
        `data_tokens`: the training data's tokens when the plan knows them, else 0); None (default): no reference."""
        return None

    def plan_choices(self, c: Config) -> tuple[Config, ...]:
        """The configs the planner may plan this run as, preferred first (distillation's `distill_teacher=auto`: the
        teacher on the device, or cached); it keeps the first whose plan needs no later rung than another's and
        records the options it chose (`Plan.options`). Default: the run's own config."""
        return (c,)

    def plan_inputs(self, model_config: Any, micro: int, tokens: int, precision: str) -> dict[str, int]:
        """Terms of a micro-batch's inputs that the dry run's random tokens leave out (a vision tower's activations on
        its images); default: none."""
        return {}

    def plan_window(self, window: int, hidden: int) -> dict[str, int]:
        """Terms a loss over the whole window of `window` samples keeps resident; default: none."""
        return {}

    def plan_note(self, c: Config) -> str | None:
        """What the plan says of this kind with this model (batch norm's statistics); None (default): nothing."""
        return None

    def chunked_variant(self) -> ChunkedLoss | None:
        """Its loss a chunk of positions at a time, a rung of the planner's ladder where its registry entry lists the
        `chunked_loss` feature (causal LM's); None (default): no such rung."""
        return None


class AfterTraining(Protocol):
    """What a kind does with its trained model: prediction, its saved folder, the model card, sample outputs."""

    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str, max_new_tokens: int
                ) -> list[dict[str, Any]]:
        """`finetune predict`'s output, one record per text (a kind that generates also takes `sampling`:
        `model.generate`'s keywords for greedy or sampled decoding, `finetune.use.generation.Generation.sampling`)."""

    # --- with defaults
    def save_layout(self, folder: Path, model: Any, max_length: int) -> None:
        """Add the kind's own files to a saved model folder (sentence-transformers'); default: nothing."""
        return None  # a body besides the docstring: a default, not a member every kind must implement

    def sample_completions(self, model: Any, data: Any, pad_id: int, device: torch.device
                           ) -> list[dict[str, Any]] | None:
        """The `samples` event's rows (a kind that generates: GRPO); None (default): no such event."""
        return None

    def usage_code(self, repo_id: str, example: str) -> str | None:
        """The model card's snippet, for a kind whose model a pipeline would misread; None (default): the
        pipeline's."""
        return None

    def card_rows(self, c: Config) -> list[tuple[str, Any]]:
        """The model card's rows of the kind's own method and settings (a loss and its weights); default: none."""
        return []


class TaskKind(DataCodec, Objective, WindowLoss, Precomputed, PlanTerms, AfterTraining, Protocol):
    """One kind of task: every hook the engine calls, by role. Implementations are stateless module-level objects
    (`KIND` in the kind's module) of a class that subclasses this one, so that they inherit the defaults; the
    members without one (their body is a docstring) every kind implements."""

    entry: Entry  # its registry entry: name, columns, Hugging Face names


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
