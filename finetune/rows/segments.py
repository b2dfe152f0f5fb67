"""Long documents (`long_documents`): how a text longer than `max_length` becomes samples, and what it cost.

A document is tokenised whole and then cut into blocks of at most `max_length` tokens, inside `datasets.map` (one
input row → several output rows). Consecutive blocks overlap by `context` tokens: the overlap is the start of the
next block, masked out of its loss (its `prompt_length`), so that the next block's first target is predicted from
real context. With `chunk` the overlap is one token, with `sliding_window` it is `stride` tokens; either way every
token of a document after its first is a target in exactly one block, and only the last block ends with EOS.
`truncate` keeps the first block and drops the rest. (Classification and prompt/completion data are always
truncated, in `finetune.data.encoding`: a label or a prompt belongs to the whole text.)

Each output row records its `document` (the input row's index), its `segment` (position within the document) and,
on a document's first block, `dropped_tokens` (tokens that no block holds), so the counts reported at the start of
a run are sums over Arrow columns: as right when the encoding is read from the cache as when it was just made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.compute as pc

from finetune.config.exclusions import split_refusal, takes
from finetune.config.schema import Config, ConfigError

# A warning is given when more than this share of the samples is truncated.
MOSTLY_CUT = 0.5


def resolve_mode(c: Config, plain_text: bool) -> str:
    """The mode `long_documents` means for this data: `auto` is chunk for plain text of a kind that splits documents
    (causal LM), else truncate."""
    splittable = takes(c.task, "split_documents") and plain_text
    if c.long_documents == "auto":
        return "chunk" if splittable else "truncate"
    if c.long_documents != "truncate" and not splittable:  # prompt/completion columns guessed from the data
        raise ConfigError([split_refusal(c)])
    return c.long_documents


def default_stride(max_length: int) -> int:
    """The sliding window's context when `stride` is not set: a quarter of a block."""
    return max(1, max_length // 4)


def context_tokens(c: Config, mode: str) -> int:
    """Tokens each block after the first repeats from the block before, as context (0 for truncate)."""
    if mode == "chunk":
        return 1
    if mode == "sliding_window":
        return c.stride if c.stride is not None else default_stride(c.max_length)
    return 0


def block_starts(n: int, max_length: int, context: int) -> range:
    """Where the blocks of an n-token document start: one block when it fits, else blocks of `max_length` whose
    starts are `max_length - context` apart, the last one ending at the document's end."""
    if n <= max_length:
        return range(1)
    step = max_length - context
    return range(0, (1 + math.ceil((n - max_length) / step)) * step, step)


def split_documents(docs: list[list[int]], indices: list[int], max_length: int, context: int,
                    truncate: bool) -> dict[str, list]:
    """Token-id documents → rows of at most `max_length` tokens with their masked context, document, segment and
    dropped tokens (`truncate`: the first block only)."""
    out: dict[str, list] = {"input_ids": [], "prompt_length": [], "document": [], "segment": [], "dropped_tokens": []}
    for doc, index in zip(docs, indices, strict=True):
        starts = range(1) if truncate else block_starts(len(doc), max_length, context)
        for segment, start in enumerate(starts):
            out["input_ids"].append(doc[start: start + max_length])
            out["prompt_length"].append(context if segment else 0)
            out["document"].append(index)
            out["segment"].append(segment)
            out["dropped_tokens"].append(max(len(doc) - max_length, 0) if truncate else 0)
    return out


@dataclass(frozen=True, kw_only=True)
class Segmentation:
    """What `long_documents` did to one data set: its documents (input rows) became `samples` rows of at most
    `max_length` tokens; `split` documents gave several, `truncated` lost `dropped_tokens` tokens."""

    mode: str
    max_length: int
    documents: int
    samples: int
    split: int
    truncated: int
    dropped_tokens: int
    tokens: int  # in the samples (an overlap counts in each block that holds it)
    warning: str | None = None

    def sentence(self) -> str:
        """One line for the CLI and the GUI."""
        return (f"{self.documents} documents → {self.samples} samples of at most {self.max_length} tokens "
                f"(long_documents={self.mode}): {self.split} split, {self.truncated} truncated, "
                f"{self.dropped_tokens} tokens dropped")


def count_segments(rows: Any, mode: str, max_length: int, splittable: bool) -> Segmentation:
    """The counts of an encoded data set, summed over its Arrow columns; `splittable`: plain-text causal LM, where
    chunk and sliding_window apply."""
    table = rows.with_format("arrow")
    if len(rows) == 0:
        return Segmentation(mode=mode, max_length=max_length, documents=0, samples=0, split=0, truncated=0,
                            dropped_tokens=0, tokens=0)
    segment, dropped = table["segment"], table["dropped_tokens"]
    documents = pc.sum(pc.equal(segment, 0)).as_py() or 0
    truncated = pc.sum(pc.greater(dropped, 0)).as_py() or 0
    counts = Segmentation(mode=mode, max_length=max_length, documents=documents, samples=len(rows),
                          split=pc.sum(pc.equal(segment, 1)).as_py() or 0, truncated=truncated,
                          dropped_tokens=pc.sum(dropped).as_py() or 0,
                          tokens=int(np.asarray(pc.list_value_length(table["input_ids"])).sum()))
    if truncated <= MOSTLY_CUT * documents:
        return counts
    cure = ("or use long_documents=chunk (every token learned once) or sliding_window (with context) instead of "
            "truncate" if splittable else "or shorten the texts (long_documents=chunk and sliding_window "
            "apply only to plain-text causal LM)")
    warning = (f"{truncated} of {documents} samples ({100 * truncated / documents:.0f} %) are longer than "
               f"max_length={max_length} and were truncated, dropping {counts.dropped_tokens} tokens: raise "
               f"max_length, {cure}.")
    return Segmentation(**{**counts.__dict__, "warning": warning})
