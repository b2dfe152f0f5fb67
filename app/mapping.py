"""Widgets ↔ config, as pure functions: one widget per field of `finetune.config.schema.Config`, in schema order.

Everything here is generated from `FIELDS` (label, help, choices, bounds, default, group), so a field added to the
schema gets a widget, a place on the page and a round trip through Export/Import config without touching the GUI.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

import yaml

from app.door.limits import mapping_size_problem, parse_config_yaml, short_problems
from finetune import registry as kinds
from finetune.config.schema import (
    FIELDS,
    Config,
    ConfigError,
    YamlRefused,
    field_type,
    format_bound,
    from_dict,
    is_list_field,
    load_yaml,
    read_yaml,
)
from finetune.config.tasks import parse_tasks

FIELD_NAMES: tuple[str, ...] = tuple(FIELDS)
# Labels that people and browser tests look for; every other field is labelled from its name.
LABELS = {
    "model": "Model",
    "task": "Task",
    "dataset": "Dataset",
    "text_column": "Text column",
    "text_pair_column": "Text pair column",
    "label_column": "Label column",
    "messages_column": "Messages column",
    "memory_budget_gb": "Memory budget (GB)",
    "effective_batch_size": "Effective batch size",
    "micro_batch_size": "Micro-batch size",
    "grad_accum_steps": "Gradient accumulation steps",
    "learning_rate": "Learning rate",
    "epochs": "Epochs",
    "max_grad_norm": "Gradient clipping (max norm)",
    "lr_scheduler": "LR schedule",
    "eval_fraction": "Eval fraction",
    "max_length": "Max length (tokens)",
}
ACRONYMS = {"lora": "LoRA", "lr": "LR", "gb": "GB", "r": "rank"}
COLUMN_FIELDS = ("text_column", "text_pair_column", "label_column", "prompt_column", "completion_column",
                 "messages_column")
# Then any other kind's columns (its registry entry's), so that a new kind's column widgets sit with the others.
COLUMN_FIELDS += tuple(dict.fromkeys(k for e in kinds.ENTRIES.values() for k in e.columns if k not in COLUMN_FIELDS))
# Lists of numbers, which may repeat (a multiselect would merge two equal weights): a comma-separated text box.
NUMBER_LISTS = ("reward_weights",)
# Where a field sits on the page; fields not named here go by their schema group (main, data or advanced).
SECTIONS = {
    "model": ("model", "task"),
    "dataset": ("dataset", "dataset_config", "train_split"),
    "columns": COLUMN_FIELDS,
    "batch": ("memory_budget_gb", "effective_batch_size", "micro_batch_size", "grad_accum_steps"),
    "run": ("output_dir", "overwrite", "resume"),
    "memory": ("gradient_checkpointing", "lora"),
    "tasks": ("tasks", "mixing", "mixing_temperature", "mixing_cap"),
}
GROUP_SECTIONS = {"main": "training", "data": "data_more", "advanced": "advanced"}
# Presets offered in the Model dropdown (free text is allowed too), each kind's from its registry entry: the
# bundled MiniLM first, then hub ids.
MODEL_PRESETS: dict[str, str] = {model: e.name for e in kinds.ENTRIES.values() for model in e.presets}


@dataclass(frozen=True)
class WidgetSpec:
    """How one config field is shown: widget kind, label, help and bounds, all from the schema."""

    name: str
    # checkbox, choice, multi (several of the choices), names (a list of names: suggestions, any typed in), numbers
    # (a list of numbers, comma-separated), model, column, int, float, text, tasks
    kind: str
    label: str
    info: str
    default: Any  # the schema default, as the widget holds it
    choices: tuple[str, ...] | None
    minimum: float | None
    maximum: float | None
    optional: bool
    section: str

    @property
    def step(self) -> float:
        """Spin-button step: small for fractions and rates, 1 for counts."""
        if self.kind == "int":
            return 1
        if self.maximum is not None and self.maximum <= 1:
            return 1e-5 if self.name == "learning_rate" else 0.01
        return 0.1


def _label(name: str) -> str:
    if name in LABELS:
        return LABELS[name]
    words = [ACRONYMS.get(w, w) for w in name.split("_")]
    return " ".join([words[0][:1].upper() + words[0][1:], *words[1:]])


def _kind(name: str) -> str:
    base, _ = field_type(name)
    meta = FIELDS[name].metadata
    if name == "model":
        return "model"
    if name in COLUMN_FIELDS:
        return "column"
    if name == "tasks":
        return "tasks"
    if is_list_field(name):
        if meta["choices"]:
            return "multi"
        return "numbers" if name in NUMBER_LISTS else "names"
    if base is bool:
        return "checkbox"
    if meta["choices"]:
        return "choice"
    if base is int:
        return "int"
    if base is float:
        return "float"
    return "text"


def _section(name: str) -> str:
    for section, names in SECTIONS.items():
        if name in names:
            return section
    return GROUP_SECTIONS.get(FIELDS[name].metadata.get("group", "main"), "advanced")


# Bounds that the config's cross-checks narrow beyond the field's own (`epochs` 0 is refused unless Max steps is
# set): the help states the rule a value meets, not the bare schema minimum.
BOUND_WORDS = {"epochs": "> 0 unless Max steps is set"}


def _info(name: str) -> str:
    meta = FIELDS[name].metadata
    bounds = []
    if name in BOUND_WORDS or meta["min"] is not None:
        bounds.append(BOUND_WORDS.get(name) or f"≥ {format_bound(meta['min'])}")
    if meta["max"] is not None:
        bounds.append(f"≤ {format_bound(meta['max'])}")
    suffix = f" ({', '.join(bounds)})" if bounds and _kind(name) in ("int", "float") else ""
    return plain_words(f"{meta['help']}{suffix}")


def _default(schema_field: Any) -> Any:
    return None if schema_field.default is MISSING else schema_field.default


def spec(name: str) -> WidgetSpec:
    """The widget for config field `name`."""
    meta = FIELDS[name].metadata
    kind = _kind(name)
    return WidgetSpec(name, kind, _label(name), _info(name), to_widget(name, _default(FIELDS[name])),
                      tuple(meta["choices"]) if meta["choices"] else None, meta["min"], meta["max"],
                      field_type(name)[1], _section(name))


def to_widget(name: str, value: Any) -> Any:
    """A config value as field `name`'s widget holds it.

    Optional numbers are text boxes (a Gradio number box cannot be empty: it shows and sends 0), so they hold ""
    for None and the number as text otherwise."""
    kind = _kind(name)
    if kind in ("multi", "names"):  # a multiselect holds a list
        return list(value or ())
    if kind == "numbers":
        return ", ".join(value or ())
    if kind in ("checkbox", "choice") or (kind in ("int", "float") and not field_type(name)[1]):
        return value
    if kind == "tasks":  # the task list as the YAML a config file holds (app/train/tasks.py shows it as a table)
        return "" if not value else yaml.safe_dump([t.to_dict() for t in value], sort_keys=False,
                                                   allow_unicode=True)
    return "" if value is None else str(value)


def from_widget(name: str, value: Any) -> Any:
    """A widget's value as a config value, unvalidated: `from_dict` checks it and words the errors."""
    kind = _kind(name)
    if kind == "tasks":
        return tasks_from_widget(value)
    if kind in ("multi", "names") and isinstance(value, (list, tuple)):
        return tuple(value)
    if kind == "numbers" and isinstance(value, str):  # "1, 0.5": the config checks each is a number
        return tuple(item.strip() for item in value.split(",") if item.strip())
    if isinstance(value, str):
        value = value.strip()
        if value == "":
            return None
        if kind in ("int", "float"):
            try:  # text that is not a number goes on as it is, for the config to word the error
                number = float(value)
                value = int(number) if kind == "int" and number.is_integer() else number
            except ValueError:
                pass
    if kind == "int" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def tasks_from_widget(value: Any) -> Any:
    """The Tasks widget's YAML as TaskSpecs when it reads as valid entries, else as it is (for the config to word
    the error); a `ConfigError` when its aliases expand too far."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = load_yaml(value)
        except YamlRefused as e:  # too big, too deep, a number too long: its own sentence
            raise ConfigError([str(e)]) from None
        except yaml.YAMLError:
            return value
    specs, problems = parse_tasks(value)
    return value if problems else specs


def values_to_dict(values: list[Any] | tuple[Any, ...]) -> dict[str, Any]:
    """Widget values (in `FIELD_NAMES` order) → the options that differ from the schema defaults.

    Only changed options are kept, like a YAML a person writes: the config's cross-checks treat a given option
    differently from a default one (e.g. `eval_fraction` beside `eval_dataset`)."""
    if len(values) != len(FIELD_NAMES):
        raise ValueError(f"expected {len(FIELD_NAMES)} widget values, got {len(values)}")
    out = {}
    for name, raw in zip(FIELD_NAMES, values, strict=True):
        value = from_widget(name, raw)
        if value != _default(FIELDS[name]):
            out[name] = value
    return out


def values_to_config(values: list[Any] | tuple[Any, ...]) -> Config:
    """Widget values → a validated `Config` (a `ConfigError` lists every problem)."""
    return from_dict(values_to_dict(values))


def config_to_values(config: Config) -> list[Any]:
    """A config → widget values in `FIELD_NAMES` order."""
    return [to_widget(name, getattr(config, name)) for name in FIELD_NAMES]


def changed_options(config: Config) -> dict[str, Any]:
    """The options of `config` that differ from the schema defaults, in schema order."""
    return {k: v for k, v in config.to_dict().items() if getattr(config, k) != _default(FIELDS[k])}


def config_yaml(config: Config, header: str | None = None) -> str:
    """The YAML a CLI user would write for `config`: only the options that differ from the defaults."""
    text = yaml.safe_dump(changed_options(config), sort_keys=False, allow_unicode=True)
    lines = [f"# {line}" for line in (header or "").splitlines()]
    return "\n".join([*lines, text if text.strip() != "{}" else ""]).lstrip("\n")


def parse_config(config: str | Mapping[str, Any]) -> Config:
    """A config from YAML text or from a mapping of its options (what a script passes to the app's API)."""
    if isinstance(config, str):
        return parse_config_yaml(config)
    if isinstance(config, Mapping):
        if too_big := mapping_size_problem(config):
            raise ConfigError([too_big])
        return from_dict(dict(config))
    raise ConfigError(["The config must be YAML text or a mapping of option: value."])


def load_config_file(path: str | Path) -> Config:
    """A config from a YAML file (`finetune train` reads the same)."""
    return from_dict(read_yaml(path))


def problems_text(error: ConfigError) -> str:
    """A ConfigError in the config's own sentences: the one problem, or a Markdown list of them (the first few, each
    cut short: a config of thousands of bad keys gets a short answer)."""
    problems = short_problems(error.problems)
    if len(problems) == 1:
        return problems[0]
    return "Fix these first:\n" + "\n".join(f"- {problem}" for problem in problems)


def problems_markdown(error: ConfigError) -> str:
    """A ConfigError as the page shows it, in the form's words, with a warning sign."""
    return f"⚠️ {in_form_words(problems_text(error))}"


def _form_word(name: str, value: str | None, advice: bool) -> str:
    label = _label(name)
    if not value:
        return f"**{label}**"
    if _kind(name) == "checkbox" and value.lower() in ("true", "false"):
        ticked = value.lower() == "true"
        if advice:  # "set overwrite=true" → "tick Overwrite"
            return f"{'tick' if ticked else 'untick'} **{label}**"
        return f"**{label}** {'ticked' if ticked else 'unticked'}"
    if name == "task" and value in kinds.names():  # the Task dropdown shows the kind's label, not its id
        value = task_label(value)
    return f"**{label}** {value}"


# A config key as a message writes it: `key`, `key=value`, key=value, or (keys with an underscore, which are no
# English words) the bare key; longest first, so `lora_r` is not read inside `lora_rank`.
_KEYS = "|".join(sorted(map(re.escape, FIELD_NAMES), key=len, reverse=True))
_UNDERSCORED = "|".join(sorted((re.escape(n) for n in FIELD_NAMES if "_" in n), key=len, reverse=True))
_KEY_RE = re.compile(rf"`(?P<name>{_KEYS})(?:=(?P<value>[^`\s]*))?`"
                     rf"|(?<![\w/.-])(?P<bare>{_UNDERSCORED}|(?:{_KEYS})(?==))(?:=(?P<bvalue>[^\s,;:)]+))?(?![\w/])")


# Two keys written as one (`micro_batch_size/grad_accum_steps`), which the key pattern skips as a path.
_KEY_PAIR_RE = re.compile(rf"(?<![\w/.-])({_KEYS})/({_KEYS})(?![\w/])")
# The data's column types as Arrow names them ("found large_string"), in words; a list says what it holds.
_ARROW_WORDS = {"large_string": "text", "string": "text", "large_utf8": "text", "utf8": "text", "double": "numbers",
                "float": "numbers", "halffloat": "numbers", "bool": "true/false values", "null": "empty cells"}
_ARROW_RE = re.compile(r"\b(found|holds|of type|is of type) (large_list|list)?<?(?:item: )?"
                       r"(large_string|string|large_utf8|utf8|u?int(?:8|16|32|64)|double|float|halffloat|bool|null)"
                       r">?(?![\w<])")


def _arrow_words(m: re.Match) -> str:
    kind = m.group(3)
    words = "whole numbers" if kind.lstrip("u").startswith("int") else _ARROW_WORDS[kind]
    return f"{m.group(1)} {'lists of ' + words if m.group(2) else words}"


def in_form_words(text: str) -> str:
    """A message from the config, planner or run folder in the words of the form: a field's label for its config
    key (`memory_budget_gb` → Memory budget (GB)), "tick Overwrite" for `overwrite=true`, "text" for a column of
    Arrow's `large_string`."""
    def word(m: re.Match) -> str:
        before = m.string[:m.start()]
        advice = re.search(r"(?:\b(?:set|or|and|to|use)|,)\s*$", before, re.IGNORECASE) is not None
        return _form_word(m.group("name") or m.group("bare"),
                          m.group("value") if m.group("name") else m.group("bvalue"), advice)

    text = _ARROW_RE.sub(_arrow_words, _KEY_PAIR_RE.sub(r"`\1` and `\2`", text))
    text = re.sub(r"\bset (?=(?:un)?tick \*\*)", "", _KEY_RE.sub(word, text), flags=re.IGNORECASE)
    return re.sub(r"(^|[.!?]\s+)((?:un)?tick \*\*)", lambda m: m.group(1) + m.group(2).capitalize(), text)


def plain_words(text: str) -> str:
    """`in_form_words` for plain text (a field's help): labels for config keys, without Markdown."""
    return in_form_words(text).replace("**", "").replace("`", "")


def task_label(name: str) -> str:
    """A task kind as the form names it: its registry summary ("Text classification"), not its id."""
    summary = kinds.entry(name).summary
    return summary[:1].upper() + summary[1:]


def task_choices() -> list[tuple[str, str]]:
    """The Task dropdown's (label, value) pairs, one per registered kind: a new kind appears without a change here."""
    return [(task_label(name), name) for name in kinds.names()]


def loads_offline(model: str) -> bool:
    """Whether `model` loads without the Hub: the bundled model, a local folder, or a hub id already cached."""
    if model.startswith("bundled:") or Path(model).expanduser().is_dir():
        return True
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    except (ImportError, ValueError):  # not a valid repo id either
        return False


HUB_MARK = " (downloads from the Hub)"
NETWORK_MARK = " (needs the network)"  # offline: a preset that is not in the cache


def model_choices(offline: bool | None = None, runs_dir: Path | None = None, shared: bool = False,
                  cache_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """The Model dropdown: the presets grouped by kind (in the registry's order), a preset that needs a download
    marked so (offline, `offline` or HF_HUB_OFFLINE: marked as needing the network); then the other models in the
    Hugging Face cache (`cache_dir`, default the hub's) and, unless the server is `shared` (no local folders there),
    the merged exports under `runs_dir`, each with its kind."""
    import os

    from app.disk_models import cached_models, merged_exports

    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    out = []
    for kind in kinds.names():
        for model in kinds.entry(kind).presets:
            out.append((model if loads_offline(model) else f"{model}{NETWORK_MARK if offline else HUB_MARK}", model))
    for repo, kind in cached_models(cache_dir):
        if repo not in MODEL_PRESETS:
            out.append((f"{repo} (in the cache{f': {task_label(kind)}' if kind else ''})", repo))
    if runs_dir is not None and not shared:
        for folder, kind in merged_exports(runs_dir):
            name = f"{folder.parent.parent.name}'s merged export"
            out.append((f"{folder} ({name}{f': {task_label(kind)}' if kind else ''})", str(folder)))
    return out


# Fields that only some kinds read, beyond their columns (see `kind_fields`), and fields only a hub dataset has.
FEATURE_FIELDS = {"packing": ("packing",), "segment_recurrence": ("segment_recurrence", "memory_length",
                                                                  "max_document_length"),
                  "split_documents": ("stride",), "tasks": SECTIONS["tasks"]}
CHAT_FIELDS = ("chat_template", "train_on")  # how conversations (`messages_column`) are rendered and learned
HUB_FIELDS = ("dataset_config", "train_split")
# One control per action: a run is resumed with the Run panel's Resume and pushed from the Export tab, so the
# config's own switches for them stay off the form (an imported config still sets them).
FORM_HIDDEN = ("resume", "push_to_hub", "hub_private")


def kind_fields(task: str) -> set[str]:
    """The fields the form shows for kind `task` among those only some kinds read: its columns, its own options and
    settings (its registry entry), the features it takes and, with conversations, their template options."""
    from finetune.config.exclusions import takes

    e = kinds.entry(task)
    fields = {*e.columns, *e.options, *e.settings}
    fields |= {f for feature, names in FEATURE_FIELDS.items() if takes(task, feature) for f in names}
    return fields | (set(CHAT_FIELDS) if "messages_column" in e.columns else set())


KIND_FIELDS: tuple[str, ...] = tuple(n for n in FIELD_NAMES if any(n in kind_fields(k) for k in kinds.names())
                                     and not all(n in kind_fields(k) for k in kinds.names()))


def shown_fields(task: str, source: str | None = None) -> dict[str, bool]:
    """Which of the fields that depend on the task kind and the data source the form shows: only what applies
    (a classifier gets no chat template, a local file no hub config or split)."""
    from finetune.data.load import is_local

    mine = kind_fields(task) if task in kinds.names() else set(KIND_FIELDS)
    shown = {name: name in mine for name in KIND_FIELDS}
    local = bool(source and source.strip()) and is_local(source.strip())
    shown.update({name: not local for name in HUB_FIELDS})
    shown.update({name: False for name in FORM_HIDDEN})
    return shown


def field_problems(error: ConfigError) -> dict[str, str]:
    """Each problem of `error` under the first field it names (in the form's words), for the form to show next to
    that field; problems that name no field are left to the action's own message."""
    out: dict[str, str] = {}
    for problem in error.problems:
        m = _KEY_RE.search(problem)
        if m is None:
            continue
        name = m.group("name") or m.group("bare")
        if name in FIELDS:
            words = plain_words(problem)
            out[name] = f"{out[name]} {words}" if name in out else words
    return out


def infer_task(model: str) -> str | None:
    """The task kind of a preset, a local model folder or a hub model in the local cache; None when it cannot be told
    offline."""
    from app.disk_models import config_kind

    if model in MODEL_PRESETS:
        return MODEL_PRESETS[model]
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except (ImportError, ValueError):  # not a hub id either
            return None
        if not isinstance(cached, str):
            return None
        folder = Path(cached).parent
    return config_kind(folder)


def preset_config(path: str | Path, base: str | Path | None = None) -> Config:
    """The config a preset YAML (such as assets/demo.yaml) describes, without its run-directory options.

    Relative data paths that do not exist from the working directory are taken relative to `base` (the folder the
    preset's paths are written from)."""
    values = {k: v for k, v in read_yaml(path).items() if k not in ("output_dir", "overwrite", "resume")}
    for key in ("dataset", "eval_dataset"):
        value = values.get(key)
        if base is not None and isinstance(value, str) and not Path(value).exists() and (Path(base) / value).exists():
            values[key] = str(Path(base) / value)
    return from_dict(values)


# Built last: a field's help is put in the form's words (labels for config keys), which needs the key pattern above.
SPECS: dict[str, WidgetSpec] = {name: spec(name) for name in FIELD_NAMES}
