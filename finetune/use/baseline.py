"""What a classifier's evaluation is worth: the majority-class baseline of its evaluation rows.

A fine-tuned classifier's base model has a new, random head, so Try it's comparison with the base model is this
instead: the run's final evaluation beside the accuracy of always answering the most common class of the same rows.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa

from finetune.config.schema import from_dict, read_yaml
from finetune.data.load import load_data
from finetune.models.pretrained import load_tokenizer


def majority_baseline(run_dir: Path) -> dict[str, Any] | None:
    """{label, accuracy, rows} of always answering the most common class of the run's evaluation rows (its data read
    as training read it, from the data cache); None for a run with no evaluation rows or not one label a row."""
    c = from_dict(read_yaml(Path(run_dir) / "config.yaml"))
    _, eval_data, names = load_data(c, load_tokenizer(c))
    if eval_data is None or not names or "label" not in eval_data.table.column_names:
        return None
    column = eval_data.table["label"]
    if not pa.types.is_integer(column.type) or len(column) == 0:
        return None
    counts = Counter(column.to_pylist())
    label, count = counts.most_common(1)[0]
    return {"label": names[label], "accuracy": count / len(column), "rows": len(column)}
