"""Token classification (`task: token_classification`, NER and tagging): a list of words and a tag per word in each
row, one loss per labelled token.

Each word's tag goes on its first sub-token (the others are not targets, or carry the tag too with
`label_all_tokens`, a `B-` tag then continuing as `I-`). The number of labelled tokens of each row is stored with it
(`num_targets`), so a window's loss sum is divided by its labelled-token count: exact accumulation, like a causal
LM's tokens. Metrics: loss, token accuracy and, when the tags follow IOB2 or BIOES, entity-level micro
precision/recall/F1 as `seqeval` counts them (its default, conlleval-style chunking), from per-process sums.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F

from finetune.config.schema import Config
from finetune.errors import DataError
from finetune.kinds.base import (
    IGNORE_INDEX,
    Columns,
    Encoding,
    Metrics,
    SumMetrics,
    TaskKind,
    named_head,
    padded_batch,
    pick_column,
    stored_targets,
)
from finetune.registry import entry
from finetune.rows.arrow import numpy_of

TOKENS_NAMES = ("tokens", "words")
TAGS_NAMES = ("ner_tags", "tags", "pos_tags", "labels")
PREFIXES = ("B", "I", "O", "E", "S")


# --- tag schemes and entities (seqeval's default chunking, as conlleval does it)

def _split(tag: str) -> tuple[str, str]:
    """A tag's prefix and entity type, as seqeval reads them ("B-PER" → ("B", "PER"); "O" → ("O", "_"))."""
    return tag[0], tag[1:].split("-", maxsplit=1)[-1] or "_"


def _ends(prev: str, tag: str, prev_type: str, type_: str) -> bool:
    return (prev in ("E", "S") or (prev in ("B", "I") and tag in ("B", "S", "O"))
            or (prev not in ("O", ".") and prev_type != type_))


def _starts(prev: str, tag: str, prev_type: str, type_: str) -> bool:
    return (tag in ("B", "S") or (prev in ("E", "S", "O") and tag in ("E", "I"))
            or (tag not in ("O", ".") and prev_type != type_))


def entities(tags: list[str]) -> set[tuple[str, int, int]]:
    """The entities of one sequence of tags: (type, first, last position), as `seqeval.metrics.sequence_labeling.
    get_entities` finds them."""
    found, prev, prev_type, begin = set(), "O", "", 0
    for i, tag in enumerate([*tags, "O"]):
        prefix, type_ = _split(tag)
        if _ends(prev, prefix, prev_type, type_):
            found.add((prev_type, begin, i - 1))
        if _starts(prev, prefix, prev_type, type_):
            begin = i
        prev, prev_type = prefix, type_
    return found


def scheme_of(names: list[str]) -> str | None:
    """The tag scheme of these tag names: BIOES (some E-/S- tag), IOB2 (only O, B-, I-), or None for plain tags
    (part-of-speech, say: no tag has a scheme prefix); a `ValueError` naming the first tag that fits neither."""
    prefixed = [n for n in names if len(n) > 2 and n[1] == "-" and n[0] in "BIES"]
    if not prefixed:
        return None
    odd = [n for n in names if n != "O" and n not in prefixed]
    if odd:
        raise ValueError(odd[0])
    return "BIOES" if any(n[0] in "ES" for n in prefixed) else "IOB2"


def entity_counts(gold: list[list[str]], predicted: list[list[str]]) -> tuple[int, int, int]:
    """True-positive, predicted and gold entity counts over these sequences (sums: they add over processes)."""
    tp = n_pred = n_gold = 0
    for g, p in zip(gold, predicted, strict=True):
        eg, ep = entities(g), entities(p)
        tp, n_pred, n_gold = tp + len(eg & ep), n_pred + len(ep), n_gold + len(eg)
    return tp, n_pred, n_gold


def entity_scores(tp: float, n_pred: float, n_gold: float) -> dict[str, float]:
    """Micro precision, recall and F1 from the counts (0 where undefined, as seqeval's zero_division default)."""
    precision = tp / n_pred if n_pred else 0.0
    recall = tp / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def _tags_feature(table: Any, column: str) -> Any:
    feature = table.features.get(column)
    return getattr(feature, "feature", None)  # the items of a List/Sequence feature


def _file_column(table: Any, column: str) -> pa.ChunkedArray:
    return table.data.column(column)  # the rows as stored: row numbers in messages are the file's own


def tag_key(v: Any, index: dict[str, int]) -> int | None:
    """A tag's class id: a string tag by name, an integer by its name if it is one (integer tags without names),
    else as the id itself (a `ClassLabel`'s ids)."""
    if isinstance(v, str):
        return index.get(v)
    if isinstance(v, bool) or v is None:
        return None
    key = str(int(v))
    return index[key] if key in index else (int(v) if 0 <= int(v) < len(index) else None)


class TokenClassification(TaskKind):
    """The `TaskKind` of token classification."""

    entry = entry("token_classification")

    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The word-list and tag-list columns, set or guessed from `tokens`/`words` and `ner_tags`/`tags`."""
        return Columns(tokens=pick_column(columns, c.tokens_column, TOKENS_NAMES, "Tokens", "tokens_column"),
                       tags=pick_column(columns, c.tags_column, TAGS_NAMES, "Tags", "tags_column"))

    def label_names(self, table: Any, cols: Columns, source: str) -> list[str]:
        """The tag names in id order: a `ClassLabel`'s names, else the sorted distinct tags; a `DataError` for
        tags that are not lists, or that mix a scheme's prefixes with other tags."""
        feature = _tags_feature(table, cols.tags)
        if getattr(feature, "names", None):
            names = list(feature.names)
        else:
            col = table.with_format("arrow")[cols.tags]
            if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
                raise DataError(f"Tags column {cols.tags!r} of {source!r} holds {col.type}, not a list of tags per "
                                "row: give each row a list with one tag per word.")
            try:
                values = [v for v in pc.unique(pc.list_flatten(col)).to_pylist() if v is not None]
            except pa.ArrowNotImplementedError:  # integers beside strings: `datasets` reads them as JSON values
                values = [0, ""]  # which no kernel compares: the mix, refused below
            if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                names = [str(v) for v in sorted(values)]
            elif all(isinstance(v, str) for v in values):
                names = sorted(values)
            else:
                raise DataError(f"Tags column {cols.tags!r} of {source!r} mixes kinds of values: tags are all "
                                "strings, or all integers.")
        if len(names) < 2:
            raise DataError(f"Tags column {cols.tags!r} of {source!r} has only {len(names)} tag(s): token "
                            "classification needs at least two.")
        try:
            scheme_of(names)
        except ValueError as bad:
            row = self._first_row_with(table, cols.tags, str(bad), names)
            raise DataError(f"Tag {bad.args[0]!r} at row {row} of {source!r} fits no tag scheme: the other tags use "
                            "IOB2/BIOES prefixes (B-, I-, E-, S-, and O), so use them for every tag, or none.") \
                from None
        return names

    @staticmethod
    def _first_row_with(table: Any, column: str, tag: str, names: list[str]) -> int:
        values = {tag, names.index(tag)} if tag in names else {tag}
        for i, tags in enumerate(_file_column(table, column).to_pylist()):
            if any(t in values for t in tags or []):
                return i + 1
        return 1

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """A `DataError` naming the first row whose words are missing, whose tags are not one per word, or whose
        tag is not among the training tags."""
        words = _file_column(table, cols.tokens)
        tags = _file_column(table, cols.tags)
        for what, col in (("Tokens", words), ("Tags", tags)):
            if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
                raise DataError(f"{what} column {cols.tokens if what == 'Tokens' else cols.tags!r} of {source!r} "
                                f"holds {col.type}, not a list per row.")
        n_words = numpy_of(pc.fill_null(pc.list_value_length(words), -1))
        n_tags = numpy_of(pc.fill_null(pc.list_value_length(tags), -1))
        bad = np.flatnonzero((n_words <= 0) | (n_words != n_tags))
        if len(bad):
            i = int(bad[0])
            if n_words[i] <= 0:
                raise DataError(f"Row {i + 1} of {source!r} has no words in {cols.tokens!r}: fill or remove it.")
            raise DataError(f"Row {i + 1} of {source!r} has {n_words[i]} word(s) in {cols.tokens!r} but "
                            f"{n_tags[i]} tag(s) in {cols.tags!r}: give one tag per word.")
        index = {n: i for i, n in enumerate(label_names or [])}
        flat = pc.list_flatten(tags)
        for v in pc.unique(flat).to_pylist():
            if tag_key(v, index) is None:
                row = int(np.searchsorted(np.cumsum(n_tags), pc.index(flat, v).as_py(), side="right"))
                raise DataError(f"Tag {v!r} at row {row + 1} of {source!r} is not among the training tags "
                                f"({', '.join(label_names or [])}).")

    def end_of_document(self, tokenizer: Any) -> list[int]:
        """Nothing: the words are encoded as the tokenizer encodes them."""
        return []

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """The words through the tokenizer (`is_split_into_words`), cut to `max_length` by its truncation rule; each
        word's tag on its first sub-token and `IGNORE_INDEX` elsewhere (or on every sub-token, `label_all_tokens`)."""
        tokenizer, cols, max_length, index = e.tokenizer, e.cols, e.max_length, e.label_index or {}
        all_tokens = bool((e.options or {}).get("label_all_tokens"))
        continues = _continuations(index) if all_tokens else {}
        words = [[str(w) for w in row] for row in batch[cols["tokens"]]]
        enc = tokenizer(words, is_split_into_words=True, add_special_tokens=True, verbose=False)
        full = [len(x) for x in enc["input_ids"]]
        long = [i for i, n in enumerate(full) if n > max_length]
        cut = tokenizer([words[i] for i in long], is_split_into_words=True, truncation=True,
                        max_length=max_length) if long else None
        out: dict[str, list] = {"input_ids": [], "tag_ids": [], "num_targets": []}
        types = "token_type_ids" in enc
        if types:
            out["token_type_ids"] = []
        where = {i: j for j, i in enumerate(long)}
        for i, tags in enumerate(batch[cols["tags"]]):
            source, at = (cut, where[i]) if i in where else (enc, i)
            ids = [tag_key(t, index) for t in tags]
            labels, previous = [], None
            for word in source.word_ids(at):
                if word is None:
                    labels.append(IGNORE_INDEX)
                elif word != previous:
                    labels.append(ids[word])
                else:
                    labels.append(continues.get(ids[word], ids[word]) if all_tokens else IGNORE_INDEX)
                previous = word
            out["input_ids"].append(source["input_ids"][at])
            out["tag_ids"].append(labels)
            out["num_targets"].append(sum(x != IGNORE_INDEX for x in labels))
            if types:
                out["token_type_ids"].append(source["token_type_ids"][at])
        out.update(document=indices, segment=[0] * len(full), dropped_tokens=[max(n - max_length, 0) for n in full])
        return out

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The per-token tag ids, the labelled-token count of each row, and token types where the tokenizer makes
        them."""
        from datasets import List, Value

        spec = {"tag_ids": List(Value("int32")), "num_targets": Value("int32")}
        if "token_type_ids" in tokenizer.model_input_names:
            spec["token_type_ids"] = List(Value("int8"))
        return spec

    def check_encoded(self, data: Any, cols: Columns, c: Config, source: str, documents: bool) -> None:
        """A `DataError` when `max_length` leaves no labelled token."""
        if len(data) and self.num_targets(data, list(range(len(data)))) == 0:
            raise DataError(f"No word of {source!r} keeps a token within max_length={c.max_length}: raise it.")

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """A right-padded micro-batch with its tag ids, padded with `IGNORE_INDEX`."""
        return padded_batch(rows, pad_id, self._labels)

    def _labels(self, rows: pa.Table, input_ids: np.ndarray, present: np.ndarray) -> torch.Tensor:
        """The tag ids, padded with `IGNORE_INDEX`."""
        labels = np.full(input_ids.shape, IGNORE_INDEX, dtype=np.int64)
        labels[present] = numpy_of(rows.column("tag_ids").combine_chunks().flatten())
        return torch.from_numpy(labels)

    def num_targets(self, data: Any, indices: list[int]) -> int:
        """The labelled tokens of these rows, as counted when they were encoded."""
        stored = stored_targets(data, indices)
        return int(stored) if stored is not None else 0

    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """The head sized for the tags, named by them."""
        return named_head(label_names)

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy summed over the labelled tokens."""
        logits = model(**inputs).logits.float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="sum"), logits

    def metrics(self, label_names: list[str] | None, device: torch.device) -> Metrics:
        """Loss, token accuracy and entity precision/recall/F1: the loss sum, labelled and correct tokens, and
        true-positive, predicted and gold entities, summed."""
        names = list(label_names or [])
        try:
            scheme = scheme_of(names)
        except ValueError:
            scheme = None

        def update(sums: torch.Tensor, batch: dict[str, torch.Tensor], logits: torch.Tensor | None,
                   loss: torch.Tensor) -> None:
            labels = batch["labels"]
            mask = labels != IGNORE_INDEX
            predicted = logits.argmax(-1)
            sums[0] += loss.double()
            sums[1] += mask.sum()
            sums[2] += (mask & (predicted == labels)).sum()
            if scheme:
                gold, pred = [], []
                for row_labels, row_pred, row_mask in zip(labels.tolist(), predicted.tolist(), mask.tolist(),
                                                          strict=True):
                    gold.append([names[t] for t, m in zip(row_labels, row_mask, strict=True) if m])
                    pred.append([names[t] for t, m in zip(row_pred, row_mask, strict=True) if m])
                sums[3:] += torch.tensor(entity_counts(gold, pred), dtype=torch.float64, device=sums.device)

        def finish(sums: torch.Tensor) -> dict[str, float]:
            s = sums.tolist()
            out = {"loss": s[0] / max(s[1], 1), "accuracy": s[2] / max(s[1], 1)}
            return {**out, **entity_scores(*s[3:])} if scheme else out

        return SumMetrics(6, device, update, finish)

    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Tag 0 on every token."""
        return torch.zeros_like(input_ids)

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """The float32 tag scores of every token and their gradient."""
        return 2 * micro * tokens * max(num_labels, 1) * 4

    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str = "", max_new_tokens: int = 0
                ) -> list[dict[str, Any]]:
        """Each text split into words at whitespace, each word's tag (from its first sub-token) and the entities."""
        out = []
        names = model.config.id2label
        for text in texts:
            words = text.split()
            if not words:
                out.append({"text": text, "words": [], "tags": [], "entities": []})
                continue
            enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=512, return_tensors="pt")
            predicted = model(**{k: v for k, v in enc.items()}).logits[0].argmax(-1).tolist()
            tags = ["O"] * len(words)
            seen = set()
            for position, word in enumerate(enc.word_ids(0)):
                if word is not None and word not in seen:
                    seen.add(word)
                    tags[word] = names[predicted[position]]
            found = sorted(entities(tags), key=lambda x: x[1]) if _has_scheme(tags, names) else []
            out.append({"text": text, "words": words, "tags": tags,
                        "entities": [{"type": t, "text": " ".join(words[a:b + 1]), "start": a, "end": b + 1}
                                     for t, a, b in found]})
        return out


def _has_scheme(tags: list[str], names: dict[int, str]) -> bool:
    try:
        return scheme_of(list(names.values())) is not None
    except ValueError:
        return False


def _continuations(index: dict[str, int]) -> dict[int, int]:
    """For `label_all_tokens`: the id a word's later sub-tokens take for a tag that begins an entity (B-X → I-X
    where the data has that tag); other tags are repeated."""
    out = {}
    for name, i in index.items():
        if len(name) > 2 and name[1] == "-" and name[0] == "B" and f"I-{name[2:]}" in index:
            out[i] = index[f"I-{name[2:]}"]
    return out


KIND = TokenClassification()
