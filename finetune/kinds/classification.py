"""Text classification (`task: classification`): a text (or a pair) and a class label per row, one loss per sample.

Metrics: accuracy and macro-F1 from a confusion matrix summed over processes.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch

from finetune.config.schema import Config
from finetune.errors import DataError
from finetune.kinds.base import (
    Columns,
    Encoding,
    Metrics,
    SumMetrics,
    texts_of,
)
from finetune.kinds.labelled import LabelPerSample, text_columns
from finetune.registry import entry

LABEL_NAMES = ("label", "labels", "class", "target")
PAIR_NAMES = ("text_pair", "sentence2")


def label_key(v: Any) -> str:
    """A label value as the class name it stands for (1, 1.0 and "1" are one class)."""
    return str(int(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _file_column(table: Any, column: str) -> pa.ChunkedArray:
    # The rows as stored, before any select or split: a split table is read through an index, and gathering a
    # column through it would copy it into memory. Row numbers in messages are then the file's own.
    return table.data.column(column)


def classification_metrics(confusion: torch.Tensor) -> dict[str, float]:
    """Accuracy and macro-F1 from a confusion matrix (rows: true class, columns: predicted)."""
    tp = confusion.diag()
    accuracy = (tp.sum() / confusion.sum().clamp(min=1)).item()
    precision = tp / confusion.sum(0).clamp(min=1)
    recall = tp / confusion.sum(1).clamp(min=1)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall), torch.zeros_like(tp))
    present = (confusion.sum(1) + confusion.sum(0)) > 0  # classes absent from truth and predictions don't count
    return {"accuracy": accuracy, "macro_f1": f1[present].mean().item() if present.any() else 0.0}


def encode_texts(batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
    """Each text (or pair) of a batch whole, cut to `max_length` by the tokenizer's truncation rule: one sample per
    row, for the kinds with one target per text (classification, regression), which add their label."""
    tokenizer, cols, max_length = e.tokenizer, e.cols, e.max_length
    # Whole texts first (no truncation; `verbose=False`: a text longer than the model's limit is expected).
    first, pairs = texts_of(batch, cols["text"]), texts_of(batch, cols["text_pair"]) if cols["text_pair"] else None
    enc = dict(tokenizer(first, pairs, add_special_tokens=True, verbose=False))
    full = [len(x) for x in enc["input_ids"]]
    long = [i for i, n in enumerate(full) if n > max_length]
    if long:  # only the long rows are tokenised again, cut as the tokenizer's truncation rule says
        cut = tokenizer([first[i] for i in long], [pairs[i] for i in long] if pairs else None,
                        truncation=True, max_length=max_length)
        for key in enc:
            for j, i in enumerate(long):
                enc[key][i] = cut[key][j]
    out = {"input_ids": enc["input_ids"], "document": indices, "segment": [0] * len(full),
           "dropped_tokens": [max(n - max_length, 0) for n in full]}
    if "token_type_ids" in enc:
        out["token_type_ids"] = enc["token_type_ids"]
    return out


def text_features(tokenizer: Any) -> dict[str, Any]:
    """The token types of tokenizers that make them (the Arrow feature beside a text kind's label)."""
    from datasets import List, Value

    return {"token_type_ids": List(Value("int8"))} if "token_type_ids" in tokenizer.model_input_names else {}


class Classification(LabelPerSample):
    """The `TaskKind` of text classification."""

    entry = entry("classification")

    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The text (and pair) and label columns, set or guessed; a lone other column is the text."""
        return text_columns(c, columns, LABEL_NAMES, "Label")

    def label_names(self, table: Any, cols: Columns, source: str) -> list[str]:
        """The class names, in id order: a `ClassLabel`'s names, else the sorted distinct values."""
        column = cols.label
        feature = table.features.get(column)
        if getattr(feature, "names", None):
            return list(feature.names)
        # Counted in Arrow: only the distinct values ever become Python objects.
        col = table.with_format("arrow")[column]
        if col.null_count:
            first = pc.index(pc.is_null(col), True).as_py()
            raise DataError(f"Label column {column!r} of {source!r} has empty values (first at row {first + 1}): "
                            "fill or remove those rows.")
        values = pc.unique(col).to_pylist()
        if all(isinstance(v, bool) for v in values):
            return ["False", "True"]
        if all(isinstance(v, int) for v in values):
            distinct = [str(v) for v in sorted(set(values))]
        elif any(isinstance(v, float) and not float(v).is_integer() for v in values):
            raise DataError(f"Label column {column!r} of {source!r} holds fractional numbers; classification needs "
                            "classes (integers or strings).")
        else:
            distinct = sorted({str(int(v)) if isinstance(v, float) else str(v) for v in values})
        if len(distinct) < 2:
            raise DataError(f"Label column {column!r} of {source!r} has only one class ({distinct[0]!r}): "
                            "classification needs at least two.")
        return distinct

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """A `DataError` naming the first label that is not among the training labels."""
        col = _file_column(table, cols.label)
        known = set(label_names or [])
        unknown = [v for v in pc.unique(col).to_pylist() if label_key(v) not in known]
        if unknown:
            row = pc.index(col, unknown[0]).as_py()
            raise DataError(f"Label {unknown[0]!r} at row {row + 1} of {source!r} is not among the training labels "
                            f"({', '.join(label_names or [])}).")

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """Each text (or pair) whole, cut to `max_length` by the tokenizer's truncation rule, and its class id."""
        return {**encode_texts(batch, indices, e),
                "label": [e.label_index[label_key(v)] for v in batch[e.cols["label"]]]}

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The class id, and the token types of tokenizers that make them."""
        from datasets import Value

        return {"label": Value("int64"), **text_features(tokenizer)}

    def metrics(self, label_names: list[str] | None, device: torch.device) -> Metrics:
        """Loss, accuracy and macro-F1: the loss sum, the sample count and the confusion matrix, summed."""
        n = len(label_names or [])

        def update(sums: torch.Tensor, batch: dict[str, torch.Tensor], logits: torch.Tensor | None,
                   loss: torch.Tensor) -> None:
            labels = batch["labels"]
            sums[0] += loss.double()
            sums[1] += len(labels)
            flat = labels * n + logits.argmax(-1)
            sums[2:] += torch.bincount(flat, minlength=n * n).double()

        def finish(sums: torch.Tensor) -> dict[str, float]:
            loss = (sums[0] / sums[1].clamp(min=1)).item()
            return {"loss": loss, **classification_metrics(sums[2:].view(n, n))}

        return SumMetrics(2 + n * n, device, update, finish)

    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str = "", max_new_tokens: int = 0
                ) -> list[dict[str, Any]]:
        """The most likely class of each text, with every class's probability."""
        enc = tokenizer(texts, padding=True, truncation=True, max_length=512, return_tensors="pt")
        probs = model(**enc).logits.float().softmax(-1)
        names = model.config.id2label
        return [{"text": t, "label": names[int(p.argmax())],
                 "probabilities": {names[i]: round(float(v), 4) for i, v in enumerate(p)}}
                for t, p in zip(texts, probs, strict=True)]


KIND = Classification()
