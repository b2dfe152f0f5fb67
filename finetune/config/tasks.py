"""The `tasks:` list of a multi-task config: one typed, frozen `TaskSpec` per entry, and its validation.

A task entry names its own data the way a single-task config does (`dataset`, `dataset_config`, splits, columns,
evaluation data) plus how much it counts (`weight`), its share of the windows under `mixing: manual`
(`probability`) and, for a causal LM, a `prompt_prefix`. Every problem is one sentence that names the task.
"""

from __future__ import annotations

import collections
import difflib
import math
from dataclasses import dataclass, field, fields
from typing import Any

from finetune import registry
from finetune.errors import summary

MIXINGS = ("proportional", "temperature", "round_robin", "manual")


@dataclass(frozen=True)
class TaskSpec:
    """One task of a multi-task run: its data, columns, loss weight and (manual mixing) sampling probability."""

    name: str
    dataset: str = field(metadata={"source": "data"})  # a shared server checks it (`finetune.config.schema.sources`)
    task: str | None = None  # classification or causal_lm; every entry must agree with the run's `task`
    dataset_config: str | None = None
    train_split: str = "train"
    eval_dataset: str | None = field(default=None, metadata={"source": "data"})
    eval_split: str | None = None
    max_train_samples: int | None = None
    text_column: str | None = None
    text_pair_column: str | None = None
    label_column: str | None = None
    prompt_column: str | None = None
    completion_column: str | None = None
    prompt_prefix: str | None = None
    weight: float = 1.0
    probability: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The entry as a person writes it: name and dataset, then only what differs from the defaults."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name in ("name", "dataset") or getattr(self, f.name) != f.default}


TASK_KEYS = {f.name: f for f in fields(TaskSpec)}
TASK_COLUMN_KEYS = tuple(k for k in TASK_KEYS if k.endswith("_column"))
# The kinds a multi-task run trains (finetune.registry): one head per task, or one model shared by all.
MULTITASK_KINDS = tuple(n for n in registry.names() if registry.entry(n).multitask)
_STRINGS = {n for n, f in TASK_KEYS.items() if f.type in ("str", "str | None")}


def _value(where: str, key: str, raw: Any) -> tuple[Any, str | None]:
    """One entry value converted to its type, or an error sentence."""
    if raw is None:
        return None, None if key not in ("name", "dataset", "train_split", "weight") else \
            f"{where} needs a value for `{key}`."
    if key in _STRINGS:
        if isinstance(raw, (dict, list)):
            return None, f"{where}: `{key}` must be a single value, not {type(raw).__name__}."
        if "\x00" in str(raw):
            return None, f"{where}: `{key}` may not contain a null character."
        return str(raw), None
    if key == "max_train_samples":
        if isinstance(raw, bool) or not (isinstance(raw, int) or (isinstance(raw, float) and raw.is_integer())) \
                or raw < 1:
            return None, f"{where}: `max_train_samples` must be a whole number of at least 1, not {summary(raw)}."
        return int(raw), None
    if isinstance(raw, bool):
        return None, f"{where}: `{key}` must be a number, not {summary(raw)}."
    try:
        number = float(raw)
    except (TypeError, ValueError):
        return None, f"{where}: `{key}` must be a number, not {summary(raw)}."
    if not math.isfinite(number) or number < 0 or (key == "probability" and number > 1):
        bound = "between 0 and 1" if key == "probability" else "a finite number of at least 0"
        return None, f"{where}: `{key}` must be {bound}, not {summary(raw)}."
    return number, None


def parse_task(index: int, raw: Any) -> tuple[TaskSpec | None, list[str]]:
    """Entry `index` of `tasks:` as a `TaskSpec`, or the sentences that say what is wrong with it."""
    label = raw.get("name") if isinstance(raw, dict) and isinstance(raw.get("name"), str) else None
    where = f"Task {summary(label)}" if label else f"Task {index + 1} of `tasks`"
    if not isinstance(raw, dict):
        return None, [f"{where} must be a mapping with at least `name` and `dataset`, not {type(raw).__name__}."]
    problems, clean = [], {}
    for key, value in raw.items():
        if key not in TASK_KEYS:
            close = difflib.get_close_matches(str(key), TASK_KEYS, n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`?" if close else f"a task takes {', '.join(TASK_KEYS)}."
            problems.append(f"{where} has an unknown key `{key}`: {hint}")
            continue
        value, error = _value(where, key, value)
        if error:
            problems.append(error)
        elif value is not None:
            clean[key] = value
    problems += [f"{where} needs `{key}`." for key in ("name", "dataset") if key not in clean and key not in raw]
    if clean.get("task") not in (None, *MULTITASK_KINDS):
        problems.append(f"{where}: `task` must be {' or '.join(MULTITASK_KINDS)}, not {summary(clean['task'])}.")
    if problems:
        return None, problems
    return TaskSpec(**clean), []


def parse_tasks(raw: Any) -> tuple[tuple[TaskSpec, ...] | None, list[str]]:
    """The `tasks:` value as TaskSpecs (None when absent), or the sentences that say what is wrong."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null")):
        return None, []
    if isinstance(raw, dict):
        return None, ["`tasks` must be a list of mappings (`- name: …` lines), not a single mapping."]
    if not isinstance(raw, (list, tuple)):
        return None, [f"`tasks` must be a list of mappings, each with `name` and `dataset`, not {summary(raw)}."]
    specs, problems = [], []
    for i, entry in enumerate(raw):
        spec, errors = parse_task(i, entry.to_dict() if isinstance(entry, TaskSpec) else entry)
        problems += errors
        if spec is not None:
            specs.append(spec)
    return (tuple(specs) if not problems else None), problems


def _unused_keys(task: str) -> tuple[str, ...]:
    """The task entry's keys that kind `task` does not read: other kinds' columns, and `prompt_prefix` unless its
    tasks share one model."""
    if task not in registry.names():
        return ()
    e = registry.entry(task)
    return tuple(k for k in TASK_COLUMN_KEYS if k not in e.columns) + \
        (() if e.multitask == "shared" else ("prompt_prefix",))


def check_tasks(c: Any) -> list[str]:
    """Cross-checks of a multi-task config (`c` is a `Config` with `tasks` set): one sentence per problem."""
    tasks: tuple[TaskSpec, ...] = c.tasks
    problems = []
    if len(tasks) < 2:
        problems.append("`tasks` needs at least two entries: for one dataset, drop `tasks` and set `dataset`.")
    used = collections.Counter(t.name for t in tasks)  # counted once: `list.count` per name was quadratic
    for name in sorted(n for n, count in used.items() if count > 1):
        problems.append(f"Task name {name!r} is used {used[name]} times: give every task its own name.")
    for t in tasks:
        if not t.name.replace("_", "").replace("-", "").isalnum():
            problems.append(f"Task name {t.name!r} may hold only letters, digits, '-' and '_' (it names a folder "
                            "and metric keys).")
    kinds = {t.task for t in tasks if t.task}
    if len(kinds) > 1:
        ka, kb = [k for k in registry.names() if k in kinds][:2]
        a, b = (next(t for t in tasks if t.task == k) for k in (ka, kb))
        problems.append(f"Tasks {a.name!r} ({ka}) and {b.name!r} ({kb}) are of different kinds: a multi-task run "
                        f"trains {ka} tasks or {kb} tasks, not both.")
    elif kinds and kinds != {c.task}:
        problems.append(f"The tasks are {kinds.pop()} but `task` is {c.task}: set task={tasks[0].task}.")
    wrong = _unused_keys(c.task)
    for t in tasks:
        given = [k for k in wrong if getattr(t, k)]
        if given:
            problems.append(f"Task {t.name!r} sets {', '.join(f'`{k}`' for k in given)}, which {c.task} does not "
                            "use.")
        if bool(t.prompt_column) != bool(t.completion_column):
            problems.append(f"Task {t.name!r}: `prompt_column` and `completion_column` go together: set both, or "
                            "neither.")
    shared = [k for k in ("dataset", "dataset_config", "eval_dataset", "eval_split", "max_train_samples",
                          "text_column", "text_pair_column", "label_column", "prompt_column", "completion_column")
              if getattr(c, k) is not None]
    if shared:
        problems.append(f"With `tasks`, each task names its own data: move {', '.join(f'`{k}`' for k in shared)} "
                        "into the task entries.")
    # streaming, conversations, packing and segment recurrence with `tasks`: finetune.config.exclusions
    if c.mixing == "manual":
        missing = [t.name for t in tasks if t.probability is None]
        total = sum(t.probability or 0.0 for t in tasks)
        if missing:
            problems.append(f"mixing=manual needs a `probability` for every task; {', '.join(map(repr, missing))} "
                            "has none.")
        elif abs(total - 1.0) > 1e-6:
            problems.append(f"The tasks' probabilities add up to {total:g}, not 1: with mixing=manual they are each "
                            "task's share of the samples.")
    elif any(t.probability is not None for t in tasks):
        problems.append(f"`probability` is for mixing=manual; with mixing={c.mixing} the shares follow from the "
                        "data: drop it, or set mixing=manual.")
    if all(t.weight == 0 for t in tasks):
        problems.append("Every task has weight 0, so nothing would be learned: give at least one a weight above 0.")
    return problems


def single_task_values(c: Any, t: TaskSpec) -> dict[str, Any]:
    """The options of a one-dataset config that reads task `t`'s data (the engine loads each task this way)."""
    values = {k: v for k, v in c.to_dict().items() if k not in ("tasks", "mixing", "mixing_temperature",
                                                                "mixing_cap")}
    data_keys = ("dataset", "dataset_config", "train_split", "eval_dataset", "eval_split", "max_train_samples",
                 "text_column", "text_pair_column", "label_column", "prompt_column", "completion_column")
    values.update({k: getattr(t, k) for k in data_keys})
    return values
