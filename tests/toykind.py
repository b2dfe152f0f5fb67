"""A toy task kind for tests/test_toy_kind.py, defined outside the package: is a text's word count even or odd?

It reads only a text column (its label comes from the text itself), so it differs from classification in its
columns, its label names, its encoding and its checks; its loss, metrics and prediction are a classifier's.
"""

from __future__ import annotations

from typing import Any

from finetune.config.schema import Config
from finetune.kinds.base import TEXT_NAMES, Columns, Encoding, pick_column, texts_of
from finetune.kinds.classification import Classification
from finetune.registry import entry

NAMES = ["even", "odd"]


class WordParity(Classification):
    """The `TaskKind` of word-count parity."""

    entry = entry("word_parity")  # its registry entry: tests/test_toy_kind.py adds it before anything is imported

    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The text column only."""
        return Columns(text=pick_column(columns, c.text_column, TEXT_NAMES, "Text", "text_column"))

    def label_names(self, table: Any, cols: Columns, source: str) -> list[str]:
        """Always even and odd."""
        return NAMES

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """Every text has a word count."""

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """The text, truncated, and its parity as the class id."""
        texts = texts_of(batch, e.cols["text"])
        enc = e.tokenizer(texts, truncation=True, max_length=e.max_length)
        out = {"input_ids": enc["input_ids"], "label": [len(t.split()) % 2 for t in texts], "document": indices,
               "segment": [0] * len(texts), "dropped_tokens": [0] * len(texts)}
        if "token_type_ids" in enc:
            out["token_type_ids"] = enc["token_type_ids"]
        return out


KIND = WordParity()
