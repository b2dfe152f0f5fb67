"""The task kinds, by name: where each one's module is and what the configuration and the GUI need to know about it
without importing it (its columns, their rules and help, its Hugging Face names).

Importing this module imports nothing heavy (`finetune --help` stays fast: tests/test_fast_start.py): a kind's
module, which brings torch, is imported by `kind()` when a run, an evaluation or a prediction needs it. Adding a kind
is one entry here and one module that defines `KIND` (see docs/task-kind-protocol.md).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Entry:
    """What is known about a kind before its module is imported."""

    name: str  # the value of `task`
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
    # split_documents, chunked_loss) and, for those it does not, why not (the end of the refusal's sentence).
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
    # The single output's name in a saved config's `id2label`, for a kind that shares its architecture and problem
    # type with another (a reward model's "reward", beside a classifier's class names).
    output_name: str | None = None
    # Its metrics worth following per optimizer step: the step events carry them, from the window's own batches.
    step_metrics: tuple[str, ...] = ()
    # How the app shows the kind, each by a name the app keeps a table of (app/tryit/renderers.py, …), so that a kind
    # chooses its views here and the app compares no kind's name:
    # Try it's view of a prediction: "probabilities" (of each label), "entities" (the words with their entities
    # highlighted), "value" (a number), "score" (a reward), "text" (a generated continuation) or "vector" (an
    # embedding).
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
    # Models the app's Model dropdown offers for this kind (hub ids, or the bundled model), grouped under it.
    presets: tuple[str, ...] = ()
    # Its loss couples the window's samples (in-batch negatives): the loop embeds the whole window without a graph,
    # takes the loss over every process's outputs, and back-propagates each micro-batch's slice of its gradient
    # (finetune.engine.gradcache). Such a kind has `embed` and `window_loss_sum` besides the protocol.
    whole_window: bool = False


ENTRIES: dict[str, Entry] = {e.name: e for e in (
    Entry(name="classification", module="finetune.kinds.classification", summary="text classification",
          columns=("text_column", "text_pair_column", "label_column"),
          own_columns=(("label_column", "text_pair_column"),),
          uses="`text_column` and `label_column`",
          auto_model="AutoModelForSequenceClassification", peft_task_type="SEQ_CLS",
          peft_auto_model="AutoPeftModelForSequenceClassification", pipeline_tag="text-classification",
          architectures=("ForSequenceClassification",), example="I loved this film.", has_labels=True,
          multitask="heads", metrics=("accuracy", "macro_f1"),
          refusals={"packing": "a classifier takes one sample per row",
                    "segment_recurrence": "a classifier reads each text whole; turn it off",
                    "split_documents": "a classification label belongs to the whole text, so its parts cannot each "
                                       "carry it"},
          presets=("bundled:all-MiniLM-L6-v2", "distilbert/distilbert-base-uncased", "google-bert/bert-base-uncased",
                   "FacebookAI/roberta-base", "answerdotai/ModernBERT-base")),
    Entry(name="causal_lm", module="finetune.kinds.causal_lm", summary="causal language modelling",
          columns=("text_column", "prompt_column", "completion_column", "messages_column"),
          own_columns=(("prompt_column", "completion_column"), ("messages_column",)),
          uses="`text_column`, or `prompt_column` with `completion_column`",
          column_reasons={"messages_column": "conversations train a language model"},
          auto_model="AutoModelForCausalLM", peft_task_type="CAUSAL_LM", peft_auto_model="AutoPeftModelForCausalLM",
          pipeline_tag="text-generation", architectures=("ForCausalLM", "LMHeadModel"), example="Once upon a time",
          multitask="shared", features=("packing", "segment_recurrence", "split_documents", "chunked_loss"),
          metrics=("perplexity",), try_view="text", chat_when="messages", data_preview="conversation",
          # The Instruct model has a chat template: for conversation data.
          presets=("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B",
                   "openai-community/gpt2")),
    Entry(name="regression", module="finetune.kinds.regression", summary="text regression",
          columns=("text_column", "text_pair_column", "label_column"),
          uses="`text_column` and `label_column` (a number)",
          auto_model="AutoModelForSequenceClassification", peft_task_type="SEQ_CLS",
          peft_auto_model="AutoPeftModelForSequenceClassification", pipeline_tag="text-classification",
          architectures=("ForSequenceClassification",), example="I loved this film.", multitask="heads",
          problem_type="regression", metrics=("mse", "rmse", "mae", "pearson", "spearman"),
          refusals={"packing": "a regression head takes one sample per row",
                    "segment_recurrence": "a regression head reads each text whole; turn it off",
                    "split_documents": "a target belongs to the whole text, so its parts cannot each carry it"},
          try_view="value", eval_plot="scatter"),
    Entry(name="preference", module="finetune.kinds.preference", summary="preference tuning (DPO, IPO, SimPO, ORPO)",
          columns=("prompt_column", "chosen_column", "rejected_column"),
          own_columns=(("chosen_column", "rejected_column"),),
          uses="`prompt_column`, `chosen_column` and `rejected_column`",
          auto_model="AutoModelForCausalLM", peft_task_type="CAUSAL_LM", peft_auto_model="AutoPeftModelForCausalLM",
          pipeline_tag="text-generation", example="Once upon a time",
          # A tuned model is a causal LM: a saved one is told as causal_lm, which comes first.
          architectures=("ForCausalLM", "LMHeadModel"),
          metrics=("rewards/accuracies", "rewards/margins"),
          settings=("preference_loss", "beta", "simpo_gamma", "orpo_lambda", "reference_model"),
          step_metrics=("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                        "logps/rejected"),
          refusals={"packing": "a preference pair's two sequences are scored side by side, not packed",
                    "segment_recurrence": "a preference pair is scored whole; turn it off",
                    "split_documents": "a preference pair is scored whole, so it cannot be split"},
          # A tuned causal LM: chatted with when its model has a chat template (as `finetune.use.predict.chat` needs).
          try_view="text", chat_when="template", data_preview="pair"),
    Entry(name="reward", module="finetune.kinds.reward",
          summary="reward modelling (a score per text, trained on preference pairs)",
          columns=("prompt_column", "chosen_column", "rejected_column"),
          own_columns=(("chosen_column", "rejected_column"), ("center_rewards_coefficient",)),
          uses="`prompt_column`, `chosen_column` and `rejected_column`",
          column_reasons={"center_rewards_coefficient": "it centres a reward model's scores"},
          auto_model="AutoModelForSequenceClassification", peft_task_type="SEQ_CLS",
          peft_auto_model="AutoPeftModelForSequenceClassification", pipeline_tag="text-classification",
          architectures=("ForSequenceClassification",), example="The answer is 4.", output_name="reward",
          options=("center_rewards_coefficient",), metrics=("rewards/accuracies", "rewards/margins"),
          step_metrics=("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"),
          refusals={"packing": "a reward pair's two sequences are scored side by side, not packed",
                    "segment_recurrence": "a reward model scores each sequence whole; turn it off",
                    "split_documents": "a reward pair is scored whole, so it cannot be split"},
          try_view="score", data_preview="pair"),
    Entry(name="token_classification", module="finetune.kinds.token_classification",
          summary="token classification (NER and tagging)", columns=("tokens_column", "tags_column"),
          own_columns=(("tokens_column", "tags_column"), ("label_all_tokens",)),
          uses="`tokens_column` and `tags_column`",
          column_reasons={"label_all_tokens": "it puts a word's tag on all its sub-tokens"},
          auto_model="AutoModelForTokenClassification", peft_task_type="TOKEN_CLS",
          peft_auto_model="AutoPeftModelForTokenClassification", pipeline_tag="token-classification",
          architectures=("ForTokenClassification",), example="My name is Clara and I live in Berkeley.",
          has_labels=True, options=("label_all_tokens",),
          refusals={"packing": "token classification takes one sentence per row",
                    "segment_recurrence": "token classification tags each row whole; turn it off",
                    "split_documents": "a row's words and tags are cut at `max_length` together, not split; use "
                                       "long_documents=truncate (or auto)"},
          try_view="entities"),
    Entry(name="embedding", module="finetune.kinds.embedding",
          summary="sentence embeddings (anchor–positive pairs or scored sentence pairs)",
          columns=("anchor_column", "positive_column", "negative_column", "score_column"),
          own_columns=(("anchor_column", "positive_column", "negative_column", "score_column"),),
          uses="`anchor_column` and `positive_column` (or with `score_column`)",
          auto_model="AutoModel", peft_task_type="FEATURE_EXTRACTION", peft_auto_model="AutoPeftModel",
          pipeline_tag="sentence-similarity",
          # A base model (BertModel, …): after causal_lm, whose GPT-2 "LMHeadModel" also ends so.
          architectures=("Model",), example="A man is eating food.",
          metrics=("cosine_accuracy@1", "cosine_ndcg@10", "spearman_cosine"),
          settings=("embedding_loss", "embedding_scale", "pooling", "normalize"), whole_window=True,
          refusals={"packing": "an embedding model reads each sentence whole, in-batch negatives beside it",
                    "segment_recurrence": "an embedding model reads each sentence whole; turn it off",
                    "split_documents": "a pair's sentences are cut at `max_length`, not split; use "
                                       "long_documents=truncate (or auto)"},
          try_view="vector"),
)}
OPTION_KEYS = tuple(dict.fromkeys(key for e in ENTRIES.values() for key in e.options))  # every kind's own options
DEFAULT = "classification"


def names() -> tuple[str, ...]:
    """The kinds' names, as `task` accepts them."""
    return tuple(ENTRIES)


def entry(name: str) -> Entry:
    """The registry entry of kind `name` (a KeyError for a name `task` would refuse)."""
    return ENTRIES[name]


@functools.cache
def kind(name: str) -> Any:
    """The kind object of `name` (a `finetune.kinds.base.TaskKind`), its module imported on first use. (The registry
    imports no kind module, nor the protocol's: the configuration imports the registry, and the kinds the
    configuration.)"""
    return importlib.import_module(ENTRIES[name].module).KIND


def configured(c: Any) -> Any:
    """The kind object of run config `c`: the kind's own `configured(c)` where it has settings (a loss, its
    weights), else the plain kind."""
    k = kind(c.task)
    return k.configured(c) if hasattr(k, "configured") else k


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
    # Kinds that need a problem type (or an output name) first: they share their architecture with one that does not.
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
    sharing = [e for e in ENTRIES.values() if e.peft_task_type == task_type and _named(e, saved)]
    return next((e.name for e in sharing if e.problem_type == problem_type),
                next((e.name for e in sharing if e.problem_type is None), default))
