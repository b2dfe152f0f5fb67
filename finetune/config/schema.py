"""The one typed, frozen configuration schema: YAML files, `key=value` overrides, validation.

Every public option is a field of `Config`. Its metadata (help text, choices, bounds) is what the CLI's `init`
template, the option table of docs/configuration.md and the GUI's widgets are generated from, so defaults live here
and only here, or, for an option only one task kind reads, in that kind's registry entry (`Entry.declares`), from
which `Config` gets the field (`_with_kind_options`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from finetune import registry as kinds
from finetune.config import exclusions
from finetune.config.tasks import MIXINGS, TaskSpec, check_tasks, parse_tasks
from finetune.errors import ConfigError, summary

DEFAULT_MODEL = "bundled:all-MiniLM-L6-v2"
DEFAULT_EFFECTIVE_BATCH = 32
TASKS = kinds.names()  # the task kinds (finetune.registry)
_SUMMARIES = [kinds.entry(n).summary for n in TASKS]
TASK_HELP = f"What the model learns: {', '.join(_SUMMARIES[:-1])} or {_SUMMARIES[-1]}."  # every kind, by its summary
# The experiment trackers accelerate can log to (its `LoggerType`, less `all`: a run names what it reports to).
TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab")
LONG_DOCUMENTS = ("auto", "truncate", "chunk", "sliding_window")
TASKS_EXAMPLE = """tasks:              # instead of `dataset`; every task has its own columns and labels
  - name: sentiment
    dataset: reviews.csv
    label_column: label
  - name: topic
    dataset: news.csv
    weight: 0.5        # its loss counts half"""


def _opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None, min: float | None = None,
         max: float | None = None, group: str = "main", source: str | None = None) -> Any:
    """A field with the metadata the CLI template, README table and GUI are built from; `source` marks a value
    that names something to read or write (see `SOURCE_KINDS`), which a shared server checks (`sources`)."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "group": group, "source": source}
    return field(default=default, metadata=meta)


KIND_OPTIONS_AFTER = "rejected_column"  # the kinds' own options follow the columns every kind may read


def _with_kind_options(cls: type) -> type:
    """`cls` with the options the task kinds declare (`finetune.registry.Option`, in registry order) as fields
    after `KIND_OPTIONS_AFTER`, before `dataclass` makes it: a kind's option is a field like any other, declared
    with its kind."""
    declared = [o for e in kinds.ENTRIES.values() for o in e.declares]
    names = [o.name for o in declared]
    own = cls.__dict__.get("__annotations__", {})
    clash = sorted({n for n in names if names.count(n) > 1 or n in own})
    if clash:
        raise TypeError(f"Options declared twice (by two kinds, or by a kind and the schema): {', '.join(clash)}.")
    annotations: dict[str, Any] = {}
    for name, hint in own.items():
        annotations[name] = hint
        if name == KIND_OPTIONS_AFTER:
            for o in declared:
                annotations[o.name] = o.annotation
                setattr(cls, o.name, _opt(o.default, o.help, choices=o.choices, min=o.min, max=o.max, group=o.group,
                                          source=o.source))
    cls.__annotations__ = annotations
    return cls


@dataclass(frozen=True)
@_with_kind_options
class Config:
    """A fine-tuning run, exactly as `config.yaml` spells it."""

    # --- what to train on
    model: str = _opt(DEFAULT_MODEL, "Hub id or local folder of a Transformers model; the default is the bundled "
                      "MiniLM-L6 (works offline).", source="model")
    task: str = _opt(kinds.DEFAULT, TASK_HELP, choices=TASKS)
    dataset: str | None = _opt(None, "Hub dataset id or a local .csv/.tsv/.json/.jsonl/.parquet file.", source="data")
    dataset_config: str | None = _opt(None, "Hub dataset configuration name (for example 'sst2' of 'glue').",
                                      group="data")
    train_split: str = _opt("train", "Split of `dataset` to train on.", group="data")
    eval_dataset: str | None = _opt(None, "Separate evaluation file or hub id (same columns as the training data).",
                                    group="data", source="data")
    eval_split: str | None = _opt(None, "Split to evaluate on (of `eval_dataset`, else of `dataset`).", group="data")
    eval_fraction: float = _opt(0.1, "Share of the training data held out for evaluation when neither "
                                "`eval_dataset` nor `eval_split` is given (0 = no evaluation).", min=0.0, max=0.5,
                                group="data")
    max_train_samples: int | None = _opt(None, "Use only the first N training rows (after loading, before the "
                                         "hold-out).", min=1, group="data")
    text_column: str | None = _opt(None, "Column with the input text (default: 'text' or 'sentence', else the only "
                                   "text column).", group="data")
    text_pair_column: str | None = _opt(None, "Second text column for sentence-pair classification.", group="data")
    label_column: str | None = _opt(None, "Column with the class (integer or string), or the number to predict for "
                                    "task=regression; default 'label'.",
                                    group="data")
    prompt_column: str | None = _opt(None, "Causal LM: prompt column, masked out of the loss.", group="data")
    completion_column: str | None = _opt(None, "Causal LM: completion column, the tokens that are learned.",
                                         group="data")
    chosen_column: str | None = _opt(None, "Preference, reward: the preferred completion's column (default 'chosen').",
                                     group="data")
    rejected_column: str | None = _opt(None, "Preference, reward: the dispreferred completion's column (default "
                                       "'rejected').", group="data")
    max_length: int = _opt(256, "Tokens per sample: a longer input is truncated or split as `long_documents` says.",
                           min=8, max=131072, group="data")
    streaming: bool = _opt(False, "Read the training data as a stream, for data bigger than memory or disk: "
                           "windows follow the stream's order (a seeded 10,000-row shuffle buffer, no length "
                           "grouping); needs `max_steps`, and `eval_fraction=0` or a separate evaluation set.",
                           group="data")
    # --- long documents
    long_documents: str = _opt("auto", "What becomes of a text longer than `max_length`: truncate (the rest is "
                               "dropped), chunk (consecutive blocks, every token learned once) or sliding_window "
                               "(blocks that repeat `stride` tokens of the one before as context, not learned "
                               "twice); auto = chunk for plain-text causal LM, truncate for classification and "
                               "prompt/completion.", choices=LONG_DOCUMENTS, group="data")
    stride: int | None = _opt(None, "long_documents=sliding_window: tokens of context each block repeats from the one "
                              "before (default max_length // 4; below max_length).", min=1, max=131072, group="data")
    # --- chat data
    messages_column: str | None = _opt(None, "Causal LM and vision-language: column of conversations, each a "
                                       "list of {role, content} (or ShareGPT {from, value}) turns rendered with the "
                                       "chat template (default: 'messages' or 'conversations').", group="data")
    chat_template: str | None = _opt(None, "Jinja file with a chat template that replaces the tokenizer's own (saved "
                                     "with the model, so that chatting with it uses the same one).", group="data",
                                     source="file")
    train_on: str = _opt("assistant", "Conversations: which tokens are learned: every assistant turn, everything, "
                         "or only the last assistant turn (each with its end-of-turn token).",
                         choices=("assistant", "all", "last_assistant"), group="data")
    # --- experiment trackers and the Hub
    report_to: tuple[str, ...] = _opt((), "Experiment trackers that get the run's hyper-parameters, step and eval "
                                      "records (a list, or comma-separated; default none).", choices=TRACKERS)
    push_to_hub: str | None = _opt(None, "Hub repository (user/name) to push the final model and its model card to "
                                   "when the run ends; the token comes from HF_TOKEN.", group="advanced")
    hub_private: bool = _opt(True, "Create the `push_to_hub` repository as private.", group="advanced")
    # --- packing
    packing: bool = _opt(False, "Causal LM: pack samples into rows of `max_length` (best-fit decreasing), each "
                         "sample attending only to itself (position ids restart per sample); the loss is that of "
                         "the unpacked samples, and the batch sizes count packed rows.", group="data")
    # --- segment recurrence (truncated BPTT, issue #8)
    segment_recurrence: bool = _opt(False, "Causal LM: train on whole documents segment by segment (`max_length` "
                                    "tokens each), each segment attending to the detached keys/values of up to "
                                    "`memory_length` earlier tokens; backward stops at segment boundaries "
                                    "(truncated BPTT).", group="advanced")
    memory_length: int | None = _opt(None, "Segment recurrence: tokens of detached context carried from earlier "
                                     "segments (default: max_length).", min=1, max=1_048_576, group="advanced")
    max_document_length: int | None = _opt(None, "Segment recurrence: cut documents to this many tokens (default: "
                                           "whole documents).", min=8, max=100_000_000, group="advanced")
    # --- multi-task training (issue #10)
    tasks: tuple[TaskSpec, ...] | None = _opt(None, "Several datasets trained at once, one entry per task (`name`, "
                                              "`dataset`, its columns and splits, `weight`, `probability`, "
                                              "`prompt_prefix`): one shared model, one graph in memory at a "
                                              "time. See docs/multitask.md.", group="data")
    mixing: str = _opt("proportional", "How windows draw from the tasks: proportional (every sample once per "
                       "epoch), temperature (p ∝ n^(1/T)), round_robin (equal shares) or manual (each task's "
                       "`probability`).", choices=MIXINGS, group="data")
    mixing_temperature: float = _opt(2.0, "Temperature T of mixing=temperature (1 = proportional; larger evens "
                                     "the tasks out).", min=1.0, max=1000.0, group="data")
    mixing_cap: int | None = _opt(None, "Count a task as at most this many samples when mixing proportional or "
                                  "by temperature (T5's cap: a huge task does not drown the others).", min=1,
                                  group="data")
    # --- where the run goes
    output_dir: str | None = _opt(None, "Run directory (default: runs/<date-time>).", source="output")
    overwrite: bool = _opt(False, "Replace an existing run in `output_dir`.")
    resume: bool = _opt(False, "Continue the run in `output_dir` from its latest checkpoint.")
    # --- batch arithmetic: any two of these three determine the third
    effective_batch_size: int | None = _opt(None, "Samples per optimizer step over all processes (default "
                                            f"{DEFAULT_EFFECTIVE_BATCH}).", min=1, max=1_048_576)
    micro_batch_size: int | None = _opt(None, "Samples per forward/backward pass on one process.", min=1, max=65_536)
    grad_accum_steps: int | None = _opt(None, "Micro-batches summed into one optimizer step.", min=1, max=1_048_576)
    memory_budget_gb: float | None = _opt(None, "Device memory budget in GiB that the plan must fit (default: no "
                                          "limit; the plan still predicts the peak).", min=0.0)
    gradient_checkpointing: str = _opt("auto", "Recompute activations in the backward pass to save memory (auto: "
                                       "only when the budget needs it).", choices=("auto", "true", "false"))
    lora: str = _opt("auto", "Train low-rank adapters instead of all weights (auto: only when the budget needs it).",
                     choices=("auto", "true", "false"))
    quantization: str = _opt("auto", "Store the frozen base of a LoRA run quantized by bitsandbytes: 8bit "
                             "(LLM.int8) or 4bit (NF4 with double quantization, QLoRA); implies LoRA; causal LM "
                             "only (auto: only when the budget needs it).", choices=("auto", "none", "8bit", "4bit"))
    chunked_loss: str = _opt("auto", "Compute the causal LM's loss a chunk of positions at a time, recomputing each "
                             "chunk's logits in the backward, so that the full tokens × vocabulary logits never exist "
                             "(the same loss and gradient; auto: when the plan says it saves memory).",
                             choices=("auto", "true", "false"), group="advanced")
    activation_offload: str = _opt("auto", "With gradient checkpointing, keep the checkpointed layers' inputs in "
                                   "(pinned) CPU memory and copy them back for the recomputation: the same result, "
                                   "one layer's inputs on the GPU instead of every layer's; CUDA only (auto: the "
                                   "last step of the plan, only when the budget needs it; never on a CPU).",
                                   choices=("auto", "true", "false"), group="advanced")
    tiled_mlp: str = _opt("auto", "Run each decoder layer's gated MLP (Llama, Qwen, Mistral, Gemma) a tile of "
                          "positions at a time, recomputing each tile in the backward, so that only one tile's "
                          "tokens × intermediate_size tensors exist: the same loss and gradients (auto: the last step "
                          "of the plan, only when the budget needs it).", choices=("auto", "true", "false"),
                          group="advanced")
    tiled_mlp_tile: int | None = _opt(None, "Positions per tile of the tiled MLP (default: the model's hidden size, "
                                      "so that a tile's intermediate is the size of one projection's weight).",
                                      min=1, max=1_048_576, group="advanced")
    lora_r: int = _opt(16, "LoRA rank.", min=1, max=4096, group="advanced")
    lora_alpha: float = _opt(32.0, "LoRA scaling numerator (the update is scaled by alpha / r).", min=0.0,
                             group="advanced")
    lora_dropout: float = _opt(0.0, "Dropout on the LoRA path.", min=0.0, max=0.9, group="advanced")
    lora_target_modules: str = _opt("all-linear", "Comma-separated module names to adapt, or all-linear.",
                                    group="advanced")
    merge_lora: bool = _opt(False, "Also save the base model with the adapter merged in (model/), besides the "
                            "adapter.", group="advanced")
    plan_probe: str = _opt("auto", "Measure a few real training steps to correct the memory estimate (auto: on "
                           "a GPU).", choices=("auto", "true", "false"), group="advanced")
    # --- optimisation
    epochs: float = _opt(3.0, "Passes over the training data.", min=0.0, max=10_000.0)
    max_steps: int | None = _opt(None, "Stop after this many optimizer steps (overrides `epochs`).", min=1,
                                 max=100_000_000)
    learning_rate: float = _opt(1e-4, "Peak learning rate.", min=0.0, max=1.0)
    weight_decay: float = _opt(0.01, "Decoupled weight decay (not applied to biases and norms).", min=0.0, max=1.0,
                               group="advanced")
    warmup_ratio: float = _opt(0.1, "Share of optimizer steps spent warming the learning rate up.", min=0.0,
                               max=1.0, group="advanced")
    lr_scheduler: str = _opt("linear", "Learning-rate schedule after warm-up.",
                             choices=("linear", "cosine", "constant"), group="advanced")
    optimizer: str = _opt("adamw", "Optimizer: AdamW (fused), 8-bit AdamW (bitsandbytes, on a GPU or a CPU) or plain "
                          "SGD.",
                          choices=("adamw", "adamw_8bit", "sgd"), group="advanced")
    max_grad_norm: float = _opt(1.0, "Clip the window's gradient to this norm (0 = off).", min=0.0)
    precision: str = _opt("auto", "Number format: auto = bf16/fp16 mixed precision on a GPU that has it, fp32 on "
                          "CPU.", choices=("auto", "fp32", "fp16", "bf16"))
    seed: int = _opt(42, "Random seed for initialisation, shuffling and dropout.", group="advanced")
    shuffle: bool = _opt(True, "Shuffle the training data every epoch.", group="advanced")
    group_by_length: bool = _opt(True, "Batch samples of similar length together (less padding, faster).",
                                 group="advanced")
    # --- reporting
    eval_every: int = _opt(0, "Evaluate every N optimizer steps (0 = only at the end).", min=0, max=100_000_000,
                           group="advanced")
    save_every: int = _opt(0, "Save a checkpoint every N optimizer steps (0 = only at the end).", min=0,
                           max=100_000_000, group="advanced")
    logging_every: int = _opt(1, "Write a step event every N optimizer steps.", min=1, max=100_000_000,
                              group="advanced")
    trust_remote_code: bool = _opt(False, "Allow the model repository to run its own Python code.",
                                   group="advanced")
    kernels: str = _opt("auto", "Hugging Face Hub kernels (faster layers that transformers downloads from the Hub "
                        "and runs): hub uses them and fails when they cannot be fetched; off never does; auto uses "
                        "them when the `kernels` package is installed and they are cached or the Hub is reachable, "
                        "and otherwise trains without them, saying so.", choices=("auto", "hub", "off"),
                        group="advanced")

    def to_dict(self) -> dict[str, Any]:
        """The config as plain YAML-able values, in schema order (a list field as a list)."""
        values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        if self.tasks is not None:  # a list of compact mappings, as a person writes them (YAML has no tuples)
            values["tasks"] = [t.to_dict() for t in self.tasks]
        return values

    def to_yaml(self) -> str:
        """The config as the YAML `finetune train` reads back."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes: Any) -> Config:
        """A new, validated config with `changes` applied."""
        return from_dict({**self.to_dict(), **changes})


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in fields(Config)}


# What a `source` field names: a hub model id or a model folder; a hub dataset id or a data file; a file (a chat
# template); the run's own folder.
SOURCE_KINDS = ("model", "data", "file", "output")


def sources(value: Any, where: str = "") -> list[tuple[str, str, str]]:
    """Every value of a config (or of a `TaskSpec`, or a tuple of them) that names something to read or write, as
    (where, kind, value): found by walking the schema's `source` metadata, nested entries (each task of `tasks`)
    included, so that a field added later is checked as soon as it says what it names."""
    if isinstance(value, tuple):
        return [found for item in value for found in sources(item, f"{where}[{getattr(item, 'name', '')}]")]
    if not dataclasses.is_dataclass(value):
        return []
    found = []
    for f in fields(value):
        item = getattr(value, f.name)
        name = f"{where}.{f.name}" if where else f.name
        if f.metadata.get("source") and isinstance(item, str):
            found.append((name, f.metadata["source"], item))
        elif isinstance(item, tuple) or dataclasses.is_dataclass(item):
            found += sources(item, name)
    return found


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(Config)  # resolving them took 2 ms per call, hundreds of calls per start


def field_type(name: str) -> tuple[type, bool]:
    """The base type of field `name` and whether it may be None."""
    hint = _hints()[name]
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        base = next(a for a in args if a is not type(None))
        return base, True
    return hint, False


def is_list_field(name: str) -> bool:
    """Whether field `name` holds a list of names (`report_to`) rather than one value."""
    base = field_type(name)[0]
    return typing.get_origin(base) is tuple and typing.get_args(base)[0] is str  # not `tasks`, a list of mappings


def _coerce_list(name: str, value: Any) -> tuple[Any, str | None]:
    """A YAML list, a comma-separated string or nothing → a tuple of distinct names, in the order given (a list of
    numbers keeps its repeats)."""
    if value is None or value is False:
        return (), None
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, (list, tuple)):  # numbers (GRPO's reward_weights) as written
        items = [str(i) if isinstance(i, (int, float)) and not isinstance(i, bool) else i for i in items]
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        return None, f"`{name}` must be a list of names or a comma-separated string, not {summary(value)}."
    names = [i.strip() for i in items if i.strip() and i.strip().lower() not in ("none", "null")]
    if names and all(_is_number(i) for i in names):  # numbers (weights) keep their repeats: [1, 1] is two
        return tuple(names), None
    return tuple(dict.fromkeys(names)), None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _coerce(name: str, value: Any) -> tuple[Any, str | None]:
    """`value` converted to field `name`'s type, or an error sentence."""
    if is_list_field(name):
        return _coerce_list(name, value)
    base, optional = field_type(name)
    choices = FIELDS[name].metadata["choices"] or ()
    if isinstance(value, str) and value.strip().lower() == "none" and "none" in choices:
        return "none", None  # a choice spelled "none" (quantization) is that choice, not a missing value
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        if optional:
            return None, None
        return None, f"`{name}` needs a value ({base.__name__})."
    if base is bool:
        if isinstance(value, bool):
            return value, None
        text = str(value).strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True, None
        if text in ("false", "no", "off", "0"):
            return False, None
        return None, f"`{name}` must be true or false, not {summary(value)}."
    if isinstance(value, (dict, list, tuple)):  # before str(): an aliased list's text can take gigabytes
        return None, f"`{name}` must be a single value, not {summary(value)}."
    if base is int:
        if isinstance(value, bool):
            return None, f"`{name}` must be a whole number, not {summary(value)}."
        if isinstance(value, float) and value.is_integer():
            return int(value), None
        try:
            return int(str(value).strip()), None
        except ValueError:
            return None, f"`{name}` must be a whole number, not {summary(value)}."
    if base is float:
        if isinstance(value, bool):
            return None, f"`{name}` must be a number, not {summary(value)}."
        try:
            number = float(value)
        except (TypeError, ValueError):
            return None, f"`{name}` must be a number, not {summary(value)}."
        if not math.isfinite(number):
            return None, f"`{name}` must be a finite number, not {summary(value)}."
        return number, None
    if isinstance(value, bool):  # YAML reads `lora: true` as a boolean; the choice is spelled "true"
        return str(value).lower(), None
    if "\x00" in str(value):  # no file, column or hub id has one, and the OS refuses it in a path with a traceback
        return None, f"`{name}` may not contain a null character."
    return str(value), None


def format_bound(bound: float) -> str:
    """A bound as people write it: 1,048,576 rather than 1.04858e+06."""
    return f"{int(bound):,}" if float(bound).is_integer() else f"{bound:g}"


def _check_field(name: str, value: Any) -> str | None:
    meta = FIELDS[name].metadata
    if value is None:
        return None
    if isinstance(value, tuple):
        unknown = [v for v in value if v not in meta["choices"]] if meta["choices"] else []
        if unknown:
            return f"`{name}` takes {', '.join(meta['choices'])}, not {', '.join(map(summary, unknown[:5]))}."
        return None
    if meta["choices"] and value not in meta["choices"]:
        return f"`{name}` must be one of {', '.join(meta['choices'])}, not {summary(value)}."
    if meta["min"] is not None and value < meta["min"]:
        return f"`{name}` must be at least {format_bound(meta['min'])}, not {summary(value)}."
    if meta["max"] is not None and value > meta["max"]:
        return f"`{name}` must be at most {format_bound(meta['max'])}, not {summary(value)}."
    return None


def unknown_key_message(key: str) -> str:
    """One sentence for an unknown key, with the closest known name when there is one."""
    close = difflib.get_close_matches(key[:100], FIELDS, n=1, cutoff=0.6)
    hint = f" Did you mean `{close[0]}`?" if close else " Run `finetune init` to see every option."
    shown = key if len(key) <= 60 else key[:59] + "…"
    return f"Unknown option `{shown}`.{hint}"


def from_dict(values: dict[str, Any]) -> Config:
    """Build a `Config`, reporting every unknown key, bad type and out-of-range value at once."""
    problems: list[str] = []
    clean: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in FIELDS:
            problems.append(unknown_key_message(str(key)))
            continue
        if key == "tasks":  # the one structured option: a list of task mappings, checked entry by entry
            clean["tasks"], errors = parse_tasks(raw)
            problems += errors
            continue
        value, error = _coerce(key, raw)
        error = error or _check_field(key, value)
        if error:
            problems.append(error)
        else:
            clean[key] = value
    config = Config(**clean)
    problems += _cross_checks(config) + (check_tasks(config) if config.tasks else [])
    if problems:
        raise ConfigError(problems)
    return config


MAX_PATH_CHARS = 4096  # Linux's PATH_MAX

COLUMN_KEYS = tuple(f.name for f in fields(Config) if f.name.endswith("_column"))  # what a task kind reads


def _cross_checks(c: Config) -> list[str]:
    problems = []
    if c.task in TASKS:  # another kind's columns and options (an unknown task is refused on its own)
        problems += kinds.column_problems(c.task, {key: getattr(c, key) for key in COLUMN_KEYS + kinds.OPTION_KEYS})
        problems += _declined(c)
    if c.messages_column and (c.prompt_column or c.text_column):
        problems.append("`messages_column` replaces `text_column` and `prompt_column`/`completion_column`: set "
                        "only one of them.")
    # A kind that reads a prompt alone (preference pairs) takes one without a completion.
    alone = c.task in TASKS and "prompt_column" in kinds.entry(c.task).columns and \
        "completion_column" not in kinds.entry(c.task).columns
    if bool(c.prompt_column) != bool(c.completion_column) and not alone:
        problems.append("`prompt_column` and `completion_column` go together: set both, or neither.")
    if c.streaming and c.max_steps is None:
        problems.append("`streaming=true` needs `max_steps`: a stream's length is unknown, so epochs cannot be "
                        "counted.")
    if c.streaming and c.eval_fraction > 0 and not (c.eval_dataset or c.eval_split):
        problems.append("`streaming=true` cannot hold out `eval_fraction` of a stream: set eval_fraction=0, or give "
                        "`eval_dataset` or `eval_split` (read whole, not streamed).")
    if c.push_to_hub and (problem := repo_id_problem(c.push_to_hub)):
        problems.append(problem)
    for key in ("model", "reference_model"):  # longer than any path the OS takes, and a Hub id has at most 96
        if len(value := getattr(c, key) or "") > MAX_PATH_CHARS:
            problems.append(f"`{key}` has {len(value):,} characters, more than a folder's path (at most "
                            f"{MAX_PATH_CHARS:,}) or a Hub id (at most 96) has: give a model folder or a Hub id.")
    problems += _long_document_checks(c)
    if c.task in TASKS and (checks := kinds.entry(c.task).config_checks):  # a kind's own options together
        module, _, function = checks.partition(":")
        problems += getattr(importlib.import_module(module), function)(c)
    problems += exclusions.problems(c)  # the features that do not combine, and those a kind does not take
    problems += _quantization_checks(c)
    if c.max_steps is None and c.epochs <= 0:
        problems.append("`epochs` must be above 0 (or set `max_steps`).")
    return problems + _recurrence_checks(c)


def _declined(c: Config) -> list[str]:
    """One sentence per option of another kind that kind `c.task` declines (`Entry.declines`) set away from its
    default: a reward model refuses the preference loss's settings."""
    mine = kinds.entry(c.task)
    return [f"`{key}` is for task={owner}; task={c.task} {mine.decline_reason}: drop `{key}`."
            for owner, keys in mine.declines.items() for key in FIELDS if key in keys
            and getattr(c, key) != FIELDS[key].default]


def _quantization_checks(c: Config) -> list[str]:
    if c.quantization not in ("8bit", "4bit"):
        return []
    problems = []
    takers = [n for n in TASKS if "quantization" in kinds.entry(n).features]
    if c.lora == "false":
        problems.append(f"`quantization={c.quantization}` trains LoRA adapters on a frozen quantized base, so it "
                        "cannot train without LoRA: set lora=auto (or true), or quantization=none.")
    if c.task not in takers:
        problems.append(f"`quantization={c.quantization}` is for task={' or '.join(takers)} (a classifier's head "
                        "would be quantized with its base): set quantization=none.")
    for key in ("segment_recurrence", "tasks"):
        if getattr(c, key):
            problems.append(f"`quantization={c.quantization}` is not available with `{key}` yet: set "
                            "quantization=none.")
    return problems


def _recurrence_checks(c: Config) -> list[str]:
    if c.segment_recurrence:  # what it does not combine with: finetune.config.exclusions
        return []
    return [f"`{key}` only applies with segment_recurrence=true: set that too, or drop `{key}`."
            for key in ("memory_length", "max_document_length") if getattr(c, key) is not None]


def repo_id_problem(repo_id: str) -> str | None:
    """Why `repo_id` cannot name a Hub model repository (huggingface_hub's own rules), or None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return (f"`push_to_hub` must be a Hub repository id such as 'your-name/my-model' (letters, digits, '-', '_', "
                f"'.'; at most 96 characters), not {repo_id!r}.")
    return None
def _long_document_checks(c: Config) -> list[str]:
    problems = []
    if c.stride is not None and c.long_documents != "sliding_window":
        problems.append(f"`stride` applies only to long_documents=sliding_window, not {c.long_documents}: remove "
                        "it, or set long_documents=sliding_window.")
    elif c.stride is not None and c.stride >= c.max_length:
        problems.append(f"`stride` ({c.stride}) must be below `max_length` ({c.max_length}): each block must "
                        "learn at least one token that the block before it did not.")
    return problems


MAX_YAML_NODES = 10_000  # values of a config once its aliases are expanded; a real one has a few hundred
YAML_TOO_BIG = (f"The config's YAML expands to more than {MAX_YAML_NODES:,} values (through `&anchor`/`*alias` "
                "references): write the values out.")
MAX_YAML_DEPTH = 50  # levels of nesting; a config has three (tasks: a list of mappings of values)
YAML_TOO_DEEP = (f"The config's YAML nests lists or mappings more than {MAX_YAML_DEPTH} levels deep; a config is a "
                 "mapping of option: value lines (`tasks` a list of mappings): write it flat.")
YAML_NUMBER_TOO_LONG = ("The config's YAML holds a number too long to read (more than 4,300 digits); no option takes "
                        "one: write the number out shorter.")


class YamlRefused(yaml.YAMLError):
    """YAML the config reader will not build (too big, too deep, a number too long): its message is the sentence."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a document nested deeper than `MAX_YAML_DEPTH` as it is composed (PyYAML
    composes by recursion, and 12,000 levels ended in a RecursionError) and one whose aliases expand past
    `MAX_YAML_NODES` values, before it is constructed: nested aliases grow ninefold per level, and a 450-byte bomb
    would otherwise become a list whose text (in any message or copy) takes gigabytes and minutes."""

    depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise YamlTooDeep(YAML_TOO_DEEP)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_document(self, node: yaml.Node) -> Any:
        if _expanded_size(node, {}) > MAX_YAML_NODES:
            raise YamlTooBig(YAML_TOO_BIG)
        return super().construct_document(node)


class YamlTooBig(YamlRefused):
    """A YAML document larger than `MAX_YAML_NODES` values once expanded."""


class YamlTooDeep(YamlRefused):
    """A YAML document nested deeper than `MAX_YAML_DEPTH` levels (aliases included)."""


def _expanded_size(node: yaml.Node, seen: dict[int, int]) -> int:
    """Values in `node` with every alias expanded, counted once per distinct node (linear in the text's size)."""
    if id(node) in seen:
        return seen[id(node)]
    seen[id(node)] = MAX_YAML_NODES + 1  # a node inside itself (a recursive alias) is too big
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, seen) + _expanded_size(v, seen) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(v, seen) for v in node.value)
    else:
        size = 1
    seen[id(node)] = size = min(size, MAX_YAML_NODES + 1)
    return size


def load_yaml(text: str) -> Any:
    """YAML text as Python values, safely (no tags that run code) and bounded (`MAX_YAML_NODES`, `MAX_YAML_DEPTH`);
    raises `yaml.YAMLError` (a `YamlRefused`, whose message is the sentence, for what it will not build)."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:  # aliases chained deeper than the composer's bound sees (each alias is one node)
        raise YamlTooDeep(YAML_TOO_DEEP) from None
    except ValueError as e:  # int() of more than 4,300 digits (Python's bound on int parsing)
        if "digits" not in str(e):
            raise
        raise YamlRefused(YAML_NUMBER_TOO_LONG) from None


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`["lr=1", "x=y"]` → a dict; values are read as YAML scalars, so `0.5` is a number and `true` a bool."""
    out: dict[str, Any] = {}
    problems = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            problems.append(f"Override {pair!r} is not of the form key=value.")
            continue
        try:
            value = load_yaml(raw) if raw.strip() else None
            # A text option keeps a text that YAML would read as a mapping: T5's `source_prefix=summarize: `.
            if isinstance(value, dict) and key.strip() in FIELDS and not is_list_field(key.strip()) and \
                    field_type(key.strip())[0] is str:
                value = raw
            out[key.strip()] = value
        except YamlRefused as e:
            problems.append(f"Override {summary(key.strip())}: {str(e)[0].lower()}{str(e)[1:]}")
        except yaml.YAMLError:
            out[key.strip()] = raw
    if problems:
        raise ConfigError(problems)
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file, or a `ConfigError` that says why it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"Config file {str(path)!r} does not exist; `finetune init` writes an example."])
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except YamlRefused as e:
        raise ConfigError([f"Config file {str(path)!r}: {str(e)[0].lower()}{str(e)[1:]}"]) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        line = f" (line {where.line + 1})" if where else ""
        raise ConfigError([f"Config file {str(path)!r} is not valid YAML{line}: fix its syntax."]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"Config file {str(path)!r} must be a mapping of option: value lines."])
    return data


def load(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """The config from a YAML file (or none) with `key=value` overrides applied on top."""
    values = read_yaml(path) if path is not None else {}
    values.update(parse_overrides(overrides or []))
    return from_dict(values)


def _choice_words(name: str) -> str:
    return "Any of" if is_list_field(name) else "One of"


def template() -> str:
    """A commented example config listing every option with its default (what `finetune init` writes)."""
    lines = ["# finetune config: `finetune train this.yaml [key=value ...]`. Every option, with its default.", ""]
    for f in fields(Config):
        meta = f.metadata
        lines.append(f"# {meta['help']}" + (f" {_choice_words(f.name)}: {', '.join(meta['choices'])}."
                                            if meta["choices"] else ""))
        default = list(f.default) if isinstance(f.default, tuple) else f.default
        value = yaml.safe_dump({f.name: default}, default_flow_style=False).strip()
        if f.name == "dataset":
            value = "dataset: assets/sst2_sample.csv"
        lines.append(value if f.default is not None or f.name == "dataset" else f"# {value}")
        if f.name == "tasks":  # a list is easier to copy than to describe
            lines[-1:] = [f"# {line}" for line in TASKS_EXAMPLE.splitlines()]
        lines.append("")
    return "\n".join(lines)


def markdown_table() -> str:
    """The option table of docs/configuration.md, generated from the schema so that the two cannot drift apart."""
    rows = ["| option | default | meaning |", "| --- | --- | --- |"]
    for f in fields(Config):
        meta = f.metadata
        default = "—" if f.default in (None, ()) else f"`{yaml.safe_dump(f.default).splitlines()[0]}`"
        choices = (f" {_choice_words(f.name)}: {', '.join(f'`{c}`' for c in meta['choices'])}." if meta["choices"]
                   else "")
        rows.append(f"| `{f.name}` | {default} | {meta['help']}{choices} |")
    return "\n".join(rows)


def kinds_table() -> str:
    """The table of task kinds of docs/configuration.md, generated from their declarations (finetune/specs/)."""
    rows = ["| `task` | declared in | implemented in | what it trains | columns | its own options |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name in kinds.names():
        e = kinds.entry(name)
        spec = f"finetune/specs/{name}.py"
        found = importlib.util.find_spec(e.module)
        module = e.module.replace(".", "/") + ("/" if found and found.submodule_search_locations else ".py")
        guide = f" ([guide]({e.guide}))" if e.guide else ""
        columns = ", ".join(f"`{c}`" for c in e.columns)
        own = ", ".join(f"`{o.name}`" for o in e.declares if o.name not in e.columns) or "—"
        rows.append(f"| `{name}` | [`{spec}`](../{spec}) | [`{module}`](../{module}) | {e.summary}{guide} | "
                    f"{columns} | {own} |")
    return "\n".join(rows)


GENERATED = {"options": markdown_table, "kinds": kinds_table}  # docs/configuration.md's sections, by their marker


def regenerated(page: str) -> str:
    """`page` (docs/configuration.md's text) with each generated section made again from the code."""
    for marker, make in GENERATED.items():
        start, end = f"<!-- {marker} -->\n", f"\n<!-- /{marker} -->"
        head, rest = page.split(start, 1)
        page = head + start + make() + end + rest.split(end, 1)[1]
    return page


if __name__ == "__main__":  # `python -m finetune.config.schema [docs/configuration.md]`: the page's tables, made again
    import sys

    if len(sys.argv) > 1:
        reference = Path(sys.argv[1])
        reference.write_text(regenerated(reference.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(markdown_table())
