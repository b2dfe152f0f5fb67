"""Text regression (`task: regression`): a text (or a pair) and a number per row, one squared error per sample.

The model is a sequence classifier with one output and `problem_type="regression"` (what transformers' own loss and
pipeline read as regression). Metrics: MSE, RMSE and MAE from float64 sums over processes; Pearson and Spearman
correlations from every process's predictions and targets, gathered (a rank is not a sum).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F

from finetune.config.schema import Config
from finetune.errors import DataError
from finetune.kinds.base import Columns, Encoding, Reduce
from finetune.kinds.classification import encode_texts, text_features
from finetune.kinds.labelled import LabelPerSample, text_columns
from finetune.registry import entry

TARGET_NAMES = ("label", "labels", "score", "target", "value", "y")


# A number as a data file writes it (`3`, `-0.5`, `1e3`): not Python's other spellings, which float() also takes
# (`1_000`, Arabic-Indic digits) and which no CSV reader, pyarrow or the app's summary of the targets reads as one.
NUMBER = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*", re.ASCII)


def as_number(value: Any) -> float | None:
    """A target value as a finite float, or None when it is not one (a word, an empty cell, NaN, a boolean, or a
    text not written as a data file writes a number)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str) and not NUMBER.fullmatch(value):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def average_ranks(x: np.ndarray) -> np.ndarray:
    """The ranks of `x` from 1, ties given the mean of the ranks they span (as `scipy.stats.rankdata` does)."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - (counts - 1) / 2.0)[inverse]


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson's correlation of two float64 vectors; 0 when either is constant (the correlation is undefined)."""
    dx, dy = x - x.mean(), y - y.mean()
    norm = math.sqrt(float(dx @ dx) * float(dy @ dy))
    return float(dx @ dy) / norm if norm > 0 else 0.0


def regression_metrics(sums: torch.Tensor, predictions: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Loss (the mean squared error), MSE, RMSE, MAE, Pearson and Spearman from the summed
    (count, squared error, absolute error) and every prediction with its target."""
    n = max(float(sums[0]), 1.0)
    mse = float(sums[1]) / n
    return {"loss": mse, "mse": mse, "rmse": math.sqrt(mse), "mae": float(sums[2]) / n,
            "pearson": pearson(predictions, targets) if len(targets) > 1 else 0.0,
            "spearman": pearson(average_ranks(predictions), average_ranks(targets)) if len(targets) > 1 else 0.0}


class RegressionMetrics:
    """Sums of the count and the errors (exact over processes), and this process's predictions and targets (gathered
    over processes for the correlations)."""

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.predictions: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self.device = device

    def add(self, batch: dict[str, torch.Tensor], logits: torch.Tensor | None, loss: torch.Tensor) -> None:
        """Count one evaluation batch (its loss is the squared errors' sum)."""
        labels, predicted = batch["labels"].double(), logits.reshape(-1).double()
        self.sums[0] += len(labels)
        self.sums[1] += loss.double()
        self.sums[2] += (predicted - labels).abs().sum()
        self.predictions.append(predicted)
        self.targets.append(labels)

    def result(self, reduce: Reduce) -> dict[str, float]:
        """The metrics over every process's batches."""
        def gathered(parts: list[torch.Tensor]) -> np.ndarray:
            mine = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=self.device)
            return reduce.gather(mine).cpu().numpy()

        return regression_metrics(reduce.sum(self.sums).cpu(), gathered(self.predictions), gathered(self.targets))


class Regression(LabelPerSample):
    """The `TaskKind` of text regression."""

    entry = entry("regression")
    label_dtype = torch.float32

    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The text (and pair) and target columns, set or guessed; a lone other column is the text."""
        return text_columns(c, columns, TARGET_NAMES, "Target")

    def label_names(self, table: Any, cols: Columns, source: str) -> None:
        """A regression target is a number, not a class."""
        return None

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """A `DataError` naming the first row whose target is not a finite number."""
        column = cols.label
        # The rows as stored (before any select or split): row numbers in the message are the file's own.
        values = table.data.column(column)
        if pa.types.is_integer(values.type) or pa.types.is_floating(values.type):
            floats = pc.cast(values, pa.float64())
            bad = pc.fill_null(pc.invert(pc.is_finite(floats)), True)
            if not pc.any(bad).as_py():
                return
            row = pc.index(bad, True).as_py()
        else:  # strings (a CSV column with a word in it), booleans, lists…: each value is read as Python would
            row = next((i for i, v in enumerate(values.to_pylist()) if as_number(v) is None), None)
            if row is None:
                return
        shown = values[row].as_py()
        what = "is empty" if shown is None or str(shown).strip() == "" else f"is {shown!r}, not a finite number"
        raise DataError(f"Target column {column!r} of {source!r} at row {row + 1} {what}: regression needs a number "
                        "in every row; fix or remove that row.")

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """Each text (or pair) whole, cut to `max_length` by the tokenizer's truncation rule, and its target."""
        return {**encode_texts(batch, indices, e), "label": [as_number(v) for v in batch[e.cols["label"]]]}

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The target as a float32 (the model's own precision), and the token types of tokenizers that make them."""
        from datasets import Value

        return {"label": Value("float32"), **text_features(tokenizer)}

    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """One output, read as a regression by transformers (its loss, its pipeline)."""
        return {"num_labels": 1, "problem_type": "regression", "id2label": {0: "value"}, "label2id": {"value": 0}}

    def head_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Squared errors summed over the samples (the model's float32 prediction against the target)."""
        return F.mse_loss(logits.reshape(-1), labels.float(), reduction="sum")

    def metrics(self, label_names: list[str] | None, device: torch.device) -> RegressionMetrics:
        """Loss, MSE, RMSE, MAE, Pearson and Spearman."""
        return RegressionMetrics(device)

    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str = "", max_new_tokens: int = 0
                ) -> list[dict[str, Any]]:
        """The predicted number for each text."""
        enc = tokenizer(texts, padding=True, truncation=True, max_length=512, return_tensors="pt")
        values = model(**enc).logits.float().reshape(-1).tolist()
        return [{"text": t, "value": round(v, 6)} for t, v in zip(texts, values, strict=True)]


KIND = Regression()
