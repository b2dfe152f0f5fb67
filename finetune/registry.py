"""The task kinds, by name: each kind's declaration (`Entry`, collected from its module in `finetune/specs/`) and
its implementation (`KIND` of its module in `finetune/kinds/`), found by name.

Importing this module imports nothing heavy (`finetune --help` stays fast: tests/test_fast_start.py): a kind's
implementation, which brings torch, is imported by `kind()` when a run, an evaluation or a prediction needs it.
Adding a kind is a module in `finetune/specs/` and one in `finetune/kinds/` (see docs/task-kind-protocol.md), and
nothing here; an option only the kind reads is declared in its entry (`Option`), and the schema, `finetune init`,
docs/configuration.md, the CLI's help and the GUI's form are assembled from the declarations.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any

from finetune import specs
from finetune.specs import Entry as Entry
from finetune.specs import Option as Option


def _collected() -> dict[str, Entry]:
    """Every kind's `ENTRY` of finetune/specs/, in their declared order."""
    found = [importlib.import_module(f"{specs.__name__}.{module.name}").ENTRY
             for module in pkgutil.iter_modules(specs.__path__)]
    return {e.name: e for e in sorted(found, key=lambda e: (e.order, e.name))}


ENTRIES: dict[str, Entry] = _collected()
# How a prediction's input names an image and asks about it (`finetune predict RUN "photo.png::What is this?"`; Try
# it builds it from the uploaded file): the image's path, this, the question.
IMAGE_QUESTION = "::"
OPTION_KEYS = tuple(dict.fromkeys(key for e in ENTRIES.values() for key in e.options))  # every kind's own options
DEFAULT = "classification"


def names() -> tuple[str, ...]:
    """The kinds' names, as `task` accepts them."""
    return tuple(ENTRIES)


def entry(name: str) -> Entry:
    """The registry entry of kind `name` (a KeyError for a name `task` would refuse)."""
    return ENTRIES[name]


def a_model(name: str) -> str:
    """A kind's model in words, by its summary ("an image classification model"), never its id."""
    what = ENTRIES[name].summary.split(" (")[0] if name in ENTRIES else name
    return f"{'an' if what[:1].lower() in 'aeiou' else 'a'} {what} model"


@functools.cache
def kind(name: str) -> Any:
    """The kind object of `name` (a `finetune.kinds.base.TaskKind`), its module imported on first use. (The registry
    imports no kind module, nor the protocol's: the configuration imports the registry, and the kinds the
    configuration.)"""
    return importlib.import_module(ENTRIES[name].module).KIND


def configured(c: Any) -> Any:
    """The kind object of run config `c`: the kind's own `configured(c)` where it has settings (a loss, its
    weights), else the plain kind."""
    return kind(c.task).configured(c)


def column_problems(task: str, values: dict[str, object]) -> list[str]:
    """One sentence per group of another kind's column options set for kind `task`."""
    problems = []
    mine = ENTRIES[task]
    owners: dict[tuple[str, ...], list[Entry]] = {}  # a group two kinds read (preference's and reward's pairs)
    for other in ENTRIES.values():
        for group in other.own_columns:
            owners.setdefault(group, []).append(other)
    for group, kinds in owners.items():
        if mine in kinds or set(group) & set(mine.columns) or not any(values.get(key) for key in group):
            continue
        keys = "/".join(f"`{key}`" for key in group)
        verb = "are" if len(group) > 1 else "is"
        reason = kinds[0].column_reasons.get(group[0])
        names = " or ".join(k.name for k in kinds)
        problems.append(f"{keys} {verb} for task={names}: {reason}." if reason else
                        f"{keys} {verb} for task={names}; for {task} use {mine.uses}.")
    return problems


def kind_of_model_config(model_config: dict[str, object], default: str | None = DEFAULT) -> str | None:
    """The kind a saved model's config.json names: by its `architectures` (and `problem_type`, for kinds that share
    an architecture); `default` when none says."""
    architectures = [str(a) for a in model_config.get("architectures") or []]
    # Kinds that need a problem type (or an output name) first: they share their architecture with one that does not;
    # then by their declared `order` (vision-language before seq2seq, both before the bare encoders of embedding).
    for e in sorted(ENTRIES.values(), key=lambda e: (e.problem_type is None, e.output_name is None)):
        if e.architectures and any(a.endswith(e.architectures) for a in architectures) and \
                e.problem_type in (None, model_config.get("problem_type")) and _named(e, model_config):
            return e.name
    return default


def _named(e: Entry, model_config: dict[str, object]) -> bool:
    """Whether a saved config's outputs fit kind `e`: its single output named `e.output_name`, when it has one, and
    not a kind that names its output when `e` does not (a classifier of one class called "reward" is not one)."""
    id2label = model_config.get("id2label")
    names = list(id2label.values()) if isinstance(id2label, dict) else []
    if e.output_name is not None:
        return names == [e.output_name]
    return not any(o.output_name is not None and names == [o.output_name] for o in ENTRIES.values())


def kind_of_peft_task_type(task_type: str | None, default: str = DEFAULT, problem_type: str | None = None,
                           model_config: dict[str, object] | None = None) -> str:
    """The kind a saved adapter's peft task type names; kinds that share a task type (classification, regression,
    reward) are told apart by the `problem_type` and output name of the base config saved beside the adapter."""
    saved = model_config or {}
    if not task_type:  # an adapter peft has no task type for (images): its base config's architecture says
        return kind_of_model_config(saved, default) or default
    sharing = [e for e in ENTRIES.values() if e.peft_task_type == task_type and _named(e, saved)]
    return next((e.name for e in sharing if e.problem_type == problem_type),
                next((e.name for e in sharing if e.problem_type is None), default))
