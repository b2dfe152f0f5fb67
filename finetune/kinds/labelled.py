"""What the kinds with one label per sample share (text in, a class or a number out; an image in, a class out):
their collation, target count, head, loss and dry-run labels, written once (`LabelPerSample`), and the text kinds'
columns (`text_columns`)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import torch
import torch.nn.functional as F

from finetune.config.schema import Config
from finetune.kinds.base import TEXT_NAMES, Columns, TaskKind, named_head, padded_batch, pick_column
from finetune.rows.arrow import numpy_of


def text_columns(c: Config, columns: list[str], label_guesses: tuple[str, ...], what: str) -> Columns:
    """The text (and pair) and label columns, set or guessed; a lone other column is the text. `what`: the label's
    name in a message ("Label", "Target")."""
    label = pick_column(columns, c.label_column, label_guesses, what, "label_column")
    others = tuple(n for n in columns if n != label)
    text = pick_column(columns, c.text_column, TEXT_NAMES + (others if len(others) == 1 else ()), "Text",
                       "text_column")
    pair = pick_column(columns, c.text_pair_column, (), "Text pair", "text_pair_column") \
        if c.text_pair_column else None
    return Columns(text=text, text_pair=pair, label=label)


class LabelPerSample(TaskKind):
    """A kind whose sample is one input with one label (`label`, encoded as `label_dtype`): one target per
    sample, a head of its classes, cross-entropy summed over the samples (`head_loss`, which a kind of another loss
    replaces), logits too small to count."""

    label_dtype: torch.dtype = torch.int64  # a class id; a regression target is a float32

    def end_of_document(self, tokenizer: Any) -> list[int]:
        """Nothing: a sample is read as the tokenizer (or the image processor) makes it."""
        return []

    def check_encoded(self, data: Any, cols: Columns, c: Config, source: str, documents: bool) -> None:
        """Nothing to check: every sample has its label."""
        return None

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """A right-padded micro-batch with one label per sample."""
        return padded_batch(rows, pad_id, self._labels)

    def _labels(self, rows: pa.Table, input_ids: Any, present: Any) -> torch.Tensor:
        """One label per sample."""
        return self.labels_of(rows)

    def labels_of(self, rows: pa.Table) -> torch.Tensor:
        """The rows' labels as the loss reads them."""
        # A copy: the Arrow column's buffer is read-only, which torch would warn of.
        return torch.from_numpy(numpy_of(rows.column("label")).copy()).to(self.label_dtype)

    def num_targets(self, data: Any, indices: list[int]) -> int:
        """One target per sample."""
        return len(indices)

    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """The head sized for the classes, named by them."""
        return named_head(label_names)

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's float32 outputs and their loss summed over the samples."""
        logits = model(**inputs).logits.float()
        return self.head_loss(logits, labels), logits

    def head_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy summed over the samples."""
        return F.cross_entropy(logits, labels, reduction="sum")

    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Label 0 for every sample."""
        return torch.zeros(input_ids.shape[0], dtype=self.label_dtype, device=input_ids.device)

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """Negligible: one row of scores per sample (counted with the activations)."""
        return 0
