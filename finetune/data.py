"""Loading, checking and tokenising the data, and ordering it into windows.

The order of samples is decided per *window* (one optimizer step's samples over all processes) and only then split
into micro-batches, so `micro_batch_size`, `grad_accum_steps` and the number of processes change how a window is
computed, never which samples it holds. That is what lets (B, k) train exactly like (k·B, 1), and lets the OOM
back-off halve the micro-batch without changing the result.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.config import Config
from finetune.errors import ConfigError, DataError

FILE_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
TEXT_NAMES = ("text", "sentence", "sentence1", "content", "review", "document", "question")
PAIR_NAMES = ("text_pair", "sentence2")
LABEL_NAMES = ("label", "labels", "class", "target")
IGNORE_INDEX = -100
# Length grouping sorts this many windows at a time: enough to cut padding to almost nothing, few enough that
# lengths still vary from step to step.
GROUP_WINDOWS = 50


def is_local(source: str) -> bool:
    """Whether `source` names a file on disk rather than a hub dataset id."""
    return Path(source).suffix.lower() in FILE_FORMATS or Path(source).exists() or source.startswith((".", "/", "~"))


def load_table(source: str, config_name: str | None = None, split: str = "train") -> Any:
    """A `datasets.Dataset` from a local file or a hub dataset id."""
    import datasets

    datasets.disable_progress_bars()
    # A failed read is reported once, in our words; datasets would also log it at ERROR level.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    if is_local(source):
        path = Path(source).expanduser()
        fmt = FILE_FORMATS.get(path.suffix.lower())
        if not path.is_file():
            raise DataError(f"Dataset file {source!r} does not exist: check the path.")
        if fmt is None:
            raise DataError(f"Dataset file {source!r} has an unknown type: use .csv, .tsv, .json, .jsonl or .parquet.")
        kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
        try:
            table = datasets.load_dataset(fmt, data_files=str(path), split="train", **kwargs)
        except Exception as e:  # datasets raises many types for a malformed file; all mean the same to a user
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise DataError(f"Dataset file {source!r} could not be read as {path.suffix} ({reason}): check its "
                            "format.") from None
    else:
        try:
            table = datasets.load_dataset(source, config_name, split=split)
        except ValueError as e:
            raise DataError(f"Dataset {source!r} could not be loaded: {str(e).splitlines()[0][:300]}") from None
        except (OSError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as e:
            raise DataError(f"Dataset {source!r} is neither a local file nor reachable on the Hugging Face Hub "
                            f"({type(e).__name__}): check the name, or give a .csv/.tsv/.json/.jsonl/.parquet "
                            "file.") from None
    if len(table) == 0:
        raise DataError(f"Dataset {source!r} has no rows.")
    return table


def _pick(columns: list[str], wanted: str | None, guesses: tuple[str, ...], what: str, key: str) -> str:
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


@dataclass(frozen=True)
class Columns:
    """Which data columns feed the model."""

    text: str | None = None
    text_pair: str | None = None
    label: str | None = None
    prompt: str | None = None
    completion: str | None = None


def resolve_columns(c: Config, columns: list[str]) -> Columns:
    """The columns to use, from the config or guessed from common names; a `DataError` naming what is missing."""
    if c.task == "classification":
        label = _pick(columns, c.label_column, LABEL_NAMES, "Label", "label_column")
        others = tuple(n for n in columns if n != label)
        text = _pick(columns, c.text_column, TEXT_NAMES + (others if len(others) == 1 else ()), "Text",
                     "text_column")
        pair = _pick(columns, c.text_pair_column, (), "Text pair", "text_pair_column") if c.text_pair_column else None
        return Columns(text=text, text_pair=pair, label=label)
    if c.prompt_column or (c.text_column is None and {"prompt", "completion"} <= set(columns)):
        prompt = _pick(columns, c.prompt_column, ("prompt",), "Prompt", "prompt_column")
        completion = _pick(columns, c.completion_column, ("completion",), "Completion", "completion_column")
        return Columns(prompt=prompt, completion=completion)
    return Columns(text=_pick(columns, c.text_column, TEXT_NAMES, "Text", "text_column"))


def _strings(table: Any, column: str, source: str) -> list[str]:
    values = table[column]
    empty = [i for i, v in enumerate(values) if v is None or (isinstance(v, str) and not v.strip())]
    if empty:
        raise DataError(f"Column {column!r} of {source!r} has {len(empty)} empty value(s) (first at row "
                        f"{empty[0] + 1}): fill or remove those rows.")
    return [str(v) for v in values]


def label_names_of(table: Any, column: str, source: str) -> list[str]:
    """The class names, in id order: a `ClassLabel`'s names, else the sorted distinct values."""
    feature = table.features.get(column)
    if getattr(feature, "names", None):
        return list(feature.names)
    values = table[column]
    if any(v is None for v in values):
        first = next(i for i, v in enumerate(values) if v is None)
        raise DataError(f"Label column {column!r} of {source!r} has empty values (first at row {first + 1}): fill "
                        "or remove those rows.")
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


@dataclass
class Encoded:
    """Tokenised samples; `targets` holds a class id per sample, or per-token labels (-100 = not learned)."""

    input_ids: list[list[int]]
    targets: list[Any]
    token_type_ids: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> list[int]:
        """Tokens per sample."""
        return [len(ids) for ids in self.input_ids]

    def num_targets(self, indices: list[int], causal: bool) -> int:
        """What the loss is averaged over: samples for classification, next-token targets for a causal LM."""
        if not causal:
            return len(indices)
        return sum(sum(1 for t in self.targets[i][1:] if t != IGNORE_INDEX) for i in indices)


def encode(table: Any, cols: Columns, c: Config, tokenizer: Any, label_names: list[str] | None,
           source: str) -> Encoded:
    """Tokenise a table for the configured task."""
    if c.task == "classification":
        texts = _strings(table, cols.text, source)
        pairs = _strings(table, cols.text_pair, source) if cols.text_pair else None
        enc = tokenizer(texts, pairs, truncation=True, max_length=c.max_length)
        index = {name: i for i, name in enumerate(label_names)}
        raw = table[cols.label]
        labels = []
        for row, v in enumerate(raw):
            key = str(int(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
            if key not in index:
                raise DataError(f"Label {v!r} at row {row + 1} of {source!r} is not among the training labels "
                                f"({', '.join(label_names)}).")
            labels.append(index[key])
        return Encoded(enc["input_ids"], labels, enc.get("token_type_ids"))
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if cols.prompt:
        prompts = tokenizer(_strings(table, cols.prompt, source), add_special_tokens=True)["input_ids"]
        completions = tokenizer(_strings(table, cols.completion, source), add_special_tokens=False)["input_ids"]
        ids, targets = [], []
        for p, comp in zip(prompts, completions, strict=False):
            full = (p + comp + eos)[: c.max_length]
            ids.append(full)
            targets.append(([IGNORE_INDEX] * len(p) + comp + eos)[: c.max_length])
        if all(all(t == IGNORE_INDEX for t in tg[1:]) for tg in targets):
            raise DataError(f"Every completion of {source!r} is cut off by max_length={c.max_length}: raise it.")
        return Encoded(ids, targets)
    enc = tokenizer(_strings(table, cols.text, source), truncation=True, max_length=max(c.max_length - 1, 2))
    ids = [(x + eos)[: c.max_length] for x in enc["input_ids"]]
    return Encoded(ids, [list(x) for x in ids])


def load_data(c: Config, tokenizer: Any) -> tuple[Encoded, Encoded | None, list[str] | None]:
    """Training and evaluation data, tokenised, and the class names (classification)."""
    if not c.dataset:
        raise ConfigError(["No `dataset` given: set dataset=<file or hub id> (for example "
                           "dataset=assets/sst2_sample.csv)."])
    table = load_table(c.dataset, c.dataset_config, c.train_split)
    cols = resolve_columns(c, list(table.column_names))
    if c.max_train_samples:
        table = table.select(range(min(c.max_train_samples, len(table))))
    if c.eval_dataset or c.eval_split:
        eval_table = load_table(c.eval_dataset or c.dataset, c.dataset_config, c.eval_split or "train")
        missing = [x for x in dataclasses.astuple(cols) if x and x not in eval_table.column_names]
        if missing:
            raise DataError(f"The evaluation data lacks column(s) {', '.join(missing)}; its columns are: "
                            f"{', '.join(eval_table.column_names)}.")
    elif c.eval_fraction > 0 and len(table) >= 10:
        parts = table.train_test_split(test_size=c.eval_fraction, seed=c.seed)
        table, eval_table = parts["train"], parts["test"]
    else:
        eval_table = None
    names = label_names_of(table, cols.label, c.dataset) if c.task == "classification" else None
    train_data = encode(table, cols, c, tokenizer, names, c.dataset)
    eval_data = encode(eval_table, cols, c, tokenizer, names, c.eval_dataset or c.dataset) \
        if eval_table is not None else None
    return train_data, eval_data, names


def collate(data: Encoded, indices: list[int], pad_id: int, causal: bool) -> dict[str, torch.Tensor]:
    """A right-padded micro-batch of these samples (padding only to the longest of them)."""
    width = max(len(data.input_ids[i]) for i in indices)
    n = len(indices)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    batch: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention}
    if data.token_type_ids is not None:
        batch["token_type_ids"] = torch.zeros((n, width), dtype=torch.long)
    if causal:
        batch["labels"] = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    for row, i in enumerate(indices):
        ids = data.input_ids[i]
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        if data.token_type_ids is not None:
            batch["token_type_ids"][row, : len(ids)] = torch.tensor(data.token_type_ids[i])
        if causal:
            batch["labels"][row, : len(ids)] = torch.tensor(data.targets[i])
    if not causal:
        batch["labels"] = torch.tensor([data.targets[i] for i in indices], dtype=torch.long)
    return batch


def epoch_windows(lengths: list[int], window_size: int, *, seed: int, epoch: int, shuffle: bool,
                  group_by_length: bool) -> list[list[int]]:
    """The epoch's samples as windows of `window_size` (the last may be short), deterministic in (seed, epoch).

    With length grouping, chunks of GROUP_WINDOWS windows are sorted by length and cut into windows, the windows
    are shuffled, and the one holding the longest sample goes first (so a too-large plan fails at step 1, not
    hours in); a short tail window stays last.
    """
    order = list(range(len(lengths)))
    rng = random.Random(seed * 1_000_003 + epoch)
    if shuffle:
        rng.shuffle(order)
    if group_by_length:
        chunk = window_size * GROUP_WINDOWS
        order = [i for s in range(0, len(order), chunk)
                 for i in sorted(order[s: s + chunk], key=lambda i: -lengths[i])]
    windows = [order[s: s + window_size] for s in range(0, len(order), window_size)]
    if group_by_length and len(windows) > 1:
        tail = windows.pop() if len(windows[-1]) < window_size else None
        if shuffle:
            rng.shuffle(windows)
        longest = max(range(len(windows)), key=lambda w: max(lengths[i] for i in windows[w]))
        windows.insert(0, windows.pop(longest))
        if tail is not None:
            windows.append(tail)
    return windows


def micro_batches(window: list[int], lengths: list[int], micro_batch_size: int, rank: int,
                  num_processes: int) -> list[list[int]]:
    """This process's share of a window, cut into micro-batches of samples of similar length."""
    mine = sorted(window[rank::num_processes], key=lambda i: -lengths[i])
    return [mine[s: s + micro_batch_size] for s in range(0, len(mine), micro_batch_size)]


def windows_per_epoch(num_samples: int, window_size: int) -> int:
    """Optimizer steps in one epoch (the short tail window counts)."""
    return math.ceil(num_samples / window_size)


def label_counts(table: Any, column: str) -> dict[str, int]:
    """How many rows each label value has (for previews and messages)."""
    return dict(Counter(str(v) for v in table[column]).most_common())
