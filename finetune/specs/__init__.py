"""What each task kind declares, one torch-free module per kind (`finetune/specs/<kind>.py`, its `ENTRY`): its
columns and options with their types, defaults, bounds and help, their rules, its Hugging Face names and how the app
shows it. `finetune.registry` collects them; the configuration, the CLI's help and the GUI read them without importing
a kind's implementation (`finetune/kinds/`, which brings torch).

Adding a kind is a module here and one in `finetune/kinds/` (docs/task-kind-protocol.md#adding-a-kind): nothing else in
the package names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Option:
    """A config option a kind brings (a column only it reads, a setting of its loss): `finetune.config.schema.Config`
    gets a field of it, so `finetune init`, docs/configuration.md, the CLI's help and the GUI's widget come from here.
    What the kind does with it is said by its entry's name lists: `columns` (it reads the column), `own_columns`
    (the other kinds refuse it when set), `options` (its encoding reads it), `settings` (the form shows it for this
    kind alone; the other kinds hold its default)."""

    name: str  # the key, as config.yaml and `key=value` spell it
    # str, bool, int or float; with a default of None the option may also be unset; tuple: a list of strings
    # (a YAML list, or comma-separated), default ()
    type: type
    default: Any
    help: str  # one or two sentences, starting with the kind's name ("Token classification: …")
    choices: tuple[str, ...] | None = None
    min: float | None = None
    max: float | None = None
    group: str = "data"  # where the form puts it: "main", "data" or "advanced"
    source: str | None = None  # what it names, if anything (finetune.config.schema.SOURCE_KINDS)

    @property
    def annotation(self) -> str:
        """The field's type as the schema writes it ("float | None"; `tuple`: a list of strings)."""
        if self.type is tuple:
            return "tuple[str, ...]"
        return self.type.__name__ + (" | None" if self.default is None else "")


@dataclass(frozen=True)
class Entry:
    """What is known about a kind before its module is imported."""

    name: str  # the value of `task` (and the name of its module in finetune/specs/)
    # Where it sits among the kinds: the order `task`'s help, the form's list and the reference tables name them in,
    # and which of the kinds a saved model's config could be is tried first (`kind_of_model_config`; ties by name).
    order: int
    module: str  # the module that defines `KIND`, an object of the `TaskKind` protocol
    summary: str  # what the kind trains, in a few words ("text classification")
    columns: tuple[str, ...]  # the `*_column` options it reads, in the order a form shows them
    own_columns: tuple[tuple[str, ...], ...] = ()  # groups of options only this kind reads, refused for the others
    uses: str = ""  # how to name this kind's columns, for the refusal of another kind's columns
    column_reasons: dict[str, str] = field(default_factory=dict)  # a group refused for its own reason ("why")
    # Hugging Face names, as strings (the model card and the GUI read them without importing transformers).
    auto_model: str = ""  # the transformers auto class: AutoModelFor…
    peft_task_type: str = ""  # peft's TaskType for LoRA
    peft_auto_model: str = ""  # peft's AutoPeftModelFor…, to load a saved adapter
    pipeline_tag: str = ""  # the model card's pipeline tag and transformers' pipeline task
    architectures: tuple[str, ...] = ()  # endings of a saved config's `architectures` that mean this kind
    example: str = ""  # an input for the model card's usage snippet
    has_labels: bool = False  # whether the data names classes (label names saved with the model)
    # In a multi-task run: "heads" (one head per task on a shared body), "shared" (one model, a prompt prefix per
    # task), or "" (not a task of a multi-task run).
    multitask: str = ""
    # The optional features it takes (finetune.config.exclusions.KIND_FEATURES: packing, segment_recurrence,
    # split_documents, chunked_loss; and quantization, a quantized base under LoRA, which the schema refuses in its
    # own words) and, for those it does not, why not (the end of the refusal's sentence; "gguf": why `finetune
    # export --format gguf` refuses a kind that generates text without being a causal LM).
    features: tuple[str, ...] = ()
    refusals: dict[str, str] = field(default_factory=dict)
    problem_type: str | None = None  # the saved config's `problem_type` this kind needs (regression's, say)
    metrics: tuple[str, ...] = ()  # its headline evaluation metrics besides `loss` (the model card and GUI show them)
    # Config options only this kind reads, besides its columns: passed to its `encode_rows` (`Encoding.options`),
    # part of the encoding's cache key, and refused for the other kinds (with `column_reasons[option]`, or `uses`).
    options: tuple[str, ...] = ()
    # Options only this kind reads that have a default (its loss's settings): the app's form shows them for this kind
    # alone. Unlike `options` they are not refused for the other kinds (which hold their defaults).
    settings: tuple[str, ...] = ()
    # The config options it brings (`Option`): fields of the schema, named in the lists above for what the kind does
    # with them. A kind's columns that other kinds read too (`prompt_column`) are the schema's own.
    declares: tuple[Option, ...] = ()
    # Options another kind brings that this one refuses when they are set away from their defaults, by that kind,
    # and the end of the sentence that says why ("`beta` is for task=preference; task=reward trains with …").
    declines: dict[str, tuple[str, ...]] = field(default_factory=dict)
    decline_reason: str = ""
    generates: bool = False  # its model generates text: prediction may chat with it, an export sets where it stops
    exports: tuple[str, ...] = ("merged",)  # what `finetune export --format` writes of its runs: merged, gguf
    # The single output's name in a saved config's `id2label`, for a kind that shares its architecture and problem
    # type with another (a reward model's "reward", beside a classifier's class names).
    output_name: str | None = None
    # Its metrics worth following per optimizer step: the step events carry them, from the window's own batches.
    step_metrics: tuple[str, ...] = ()
    # How the app shows the kind, each by a name the app keeps a table of (app/tryit/renderers.py, …), so that a kind
    # chooses its views here and the app compares no kind's name:
    # Try it's view of a prediction: "probabilities" (of each label), "entities" (the words with their entities
    # highlighted), "value" (a number), "score" (a reward), "text" (a generated continuation), "vector" (an
    # embedding), "generated_text" (a seq2seq model's target text), "image" (an uploaded image in, each label's
    # probability out) or "image_chat" (an uploaded image and a question in, the model's reply out).
    try_view: str = "probabilities"
    # When Try it chats with the model instead: "messages" (the run trained on conversations: its config names
    # `messages_column`), "template" (its saved model has a chat template), or "" (never).
    chat_when: str = ""
    # The Dataset block's first example: "conversation" (of `messages_column`, the learned tokens highlighted),
    # "pair" (the prompt with the chosen and with the rejected completion, the scored tokens highlighted), or "".
    data_preview: str = ""
    # A finished run's plot under the app's Results: "scatter" (predicted against true values of its evaluation
    # rows), or "".
    eval_plot: str = ""
    # Its step metrics the app draws as curves of their own beside the loss (from the step and evaluation events),
    # each (metric, the metric of its spread or "", the chart's title): GRPO's reward ± its standard deviation.
    curves: tuple[tuple[str, str, str], ...] = ()
    # Models the app's Model dropdown offers for this kind (hub ids, or the bundled model), grouped under it.
    presets: tuple[str, ...] = ()
    # Its loss couples the window's samples (in-batch negatives): the loop embeds the whole window without a graph,
    # takes the loss over every process's outputs, and back-propagates each micro-batch's slice of its gradient
    # (finetune.engine.gradcache). Such a kind has `embed` and `window_loss_sum` besides the protocol.
    whole_window: bool = False
    # What a sample is to the model: "tokens" (`input_ids`, tokenised when the data is encoded) or "images" (each
    # row keeps its image's path or bytes; the kind's `collate_rows` decodes them into `pixel_values`).
    inputs: str = "tokens"
    # Config checks of its own options together (`module:function`, a module that imports nothing heavy, called with
    # the config; it returns one sentence per problem): GRPO's rewards and its batch of whole groups.
    config_checks: str = ""
    # The user guide's page (and section) on it, relative to docs/ (docs/configuration.md's table of kinds links it).
    guide: str = ""
