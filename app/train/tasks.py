"""The Tasks table of a multi-task config: each task's data, columns, weight and resulting share of a window.

A pure function of the form's values (the `tasks` YAML and the mixing options), so it is tested without a browser;
the shares are those the run will use (`finetune.data.mixing.mixing_probabilities`), counted from the tasks' files.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from app.mapping import problems_text, tasks_from_widget
from finetune.config.schema import Config, ConfigError, from_dict
from finetune.data.mixing import mixing_probabilities
from finetune.errors import InputError

COLUMNS = ["task", "dataset", "columns", "weight", "rows", "share of a window"]
COLUMN_KEYS = ("text_column", "text_pair_column", "label_column", "prompt_column", "completion_column")


def _rows(spec: Any) -> int | None:
    """Training rows of a task's data (local files and cached hub datasets), or None when it cannot be read."""
    from finetune.data.load import load_table

    try:
        n = len(load_table(spec.dataset, spec.dataset_config, spec.train_split))
    except InputError:
        return None
    return min(n, spec.max_train_samples) if spec.max_train_samples else n


def tasks_config(text: str, mixing: str, temperature: Any, cap: Any) -> Config | None:
    """The config the Tasks widgets describe (None without tasks); a `ConfigError` when they cannot run."""
    specs = tasks_from_widget(text)
    if not specs:
        return None
    return from_dict({"tasks": specs, "mixing": mixing, "mixing_temperature": temperature, "mixing_cap": cap or None})


def tasks_frame(text: str, mixing: str, temperature: Any, cap: Any) -> tuple[pd.DataFrame, str]:
    """The table (one row per task) and a note: the config's own sentence when the tasks cannot run as given."""
    try:
        config = tasks_config(text, mixing, temperature, cap)
    except ConfigError as e:
        return pd.DataFrame(columns=COLUMNS), f"⚠️ {problems_text(e)}"
    if config is None:
        return pd.DataFrame(columns=COLUMNS), ""
    counts = [_rows(t) for t in config.tasks]
    note = ""
    if None in counts and mixing not in ("manual", "round_robin"):
        missing = [t.name for t, n in zip(config.tasks, counts, strict=True) if n is None]
        shares = [None] * len(counts)
        note = f"⚠️ Cannot read the data of {', '.join(missing)}: the shares follow from the row counts."
    else:
        shares = list(mixing_probabilities(config, [n or 0 for n in counts]))
    rows = []
    for t, n, share in zip(config.tasks, counts, shares, strict=True):
        columns = ", ".join(f"{k.removesuffix('_column')}={getattr(t, k)}" for k in COLUMN_KEYS if getattr(t, k))
        rows.append([t.name, t.dataset, columns or "guessed", t.weight, n if n is not None else "?",
                     f"{share:.1%}" if share is not None else "?"])
    return pd.DataFrame(rows, columns=COLUMNS), note
