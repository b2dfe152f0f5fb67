"""The task kinds, by name: where each one's module is and what the configuration and the GUI need to know about it
without importing it (its columns and options, declared with their types, defaults, bounds and help; their rules;
its Hugging Face names).

Importing this module imports nothing heavy (`finetune --help` stays fast: tests/test_fast_start.py): a kind's
module, which brings torch, is imported by `kind()` when a run, an evaluation or a prediction needs it. Adding a kind
is one entry here and one module that defines `KIND` (see docs/task-kind-protocol.md); an option only the kind
reads is declared in its entry (`Option`), and the schema, `finetune init`, docs/configuration.md, the CLI's help
and the GUI's form are assembled from the declarations.
"""

from __future__ import annotations

import functools
import importlib
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


# The preference loss's settings: the preference kind's, which a reward model (one loss, no reference) refuses.
PREFERENCE_SETTINGS = ("preference_loss", "beta", "simpo_gamma", "orpo_lambda", "reference_model",
                       "precompute_reference")
PREFERENCE_OPTIONS = (
    Option("preference_loss", str, "dpo", "Preference: the loss: dpo (against a reference), ipo (DPO's squared, "
           "per-token form), simpo (length-normalised, no reference) or orpo (likelihood + odds ratio, no "
           "reference).", choices=("dpo", "ipo", "simpo", "orpo"), group="advanced"),
    Option("beta", float, None, "Preference: β, the strength of the preference term (DPO/IPO's KL weight, SimPO's "
           "reward scale; default 0.1). GRPO: the weight of the KL penalty to the reference (default 0: no "
           "reference).", min=0.0, max=100.0, group="advanced"),
    Option("simpo_gamma", float, 0.5, "Preference, simpo: the target reward margin γ.", min=0.0, max=100.0,
           group="advanced"),
    Option("orpo_lambda", float, 1.0, "Preference, orpo: λ, the weight of the odds-ratio term beside the "
           "likelihood.", min=0.0, max=100.0, group="advanced"),
    Option("reference_model", str, None, "Preference, dpo/ipo: Hub id or local folder of the reference model "
           "(default: the model being tuned, as it starts; with LoRA, its base with the adapter switched off).",
           group="advanced", source="model"),
    Option("precompute_reference", str, "auto", "Preference, dpo/ipo: compute the reference's log-probabilities "
           "once before training and keep them in the data cache, so that no reference is in memory while training "
           "(auto: unless LoRA's adapter-off base is the reference, or the data is streamed; false: a frozen copy "
           "beside the model).", choices=("auto", "true", "false"), group="advanced"),
)


# GRPO's options (TRL's names): its rewards, its generation and its loss.
GRPO_SETTINGS = ("rewards", "reward_weights", "num_generations", "max_completion_length", "temperature", "top_p",
                 "loss_type", "epsilon", "epsilon_high", "beta", "scale_rewards", "num_iterations")
GRPO_OPTIONS = (
    Option("answer_column", str, None, "GRPO: the column exact_match compares with (default 'answer', 'solution' or "
           "'ground_truth' when present); every column besides the prompt reaches the reward functions."),
    Option("rewards", tuple, (), "GRPO: the reward functions, summed with `reward_weights`: exact_match, "
           "regex:PATTERN (1 when found), format:PATTERN (1 when the whole completion matches), length:N (closer to "
           "N tokens is better), reward_model:PATH (a task=reward run or a one-output classifier), or, on the CLI "
           "and a local app only, file.py:function (TRL's signature).", group="main",
           # Marked as naming files; a list, which the schema's walk of sources passes over: a shared server's
           # `app.door.access.Access.check_config` parses each reward (a Python file refused, a reward model checked
           # as a model).
           source="file"),
    Option("reward_weights", tuple, (), "GRPO: one weight per reward (default: all 1).", group="advanced"),
    Option("num_generations", int, 8, "GRPO: completions generated per prompt (G, a group); `micro_batch_size` and "
           "`effective_batch_size` count completions: a window of whole groups, micro-batches of whole groups or "
           "of a divisor of G.", min=2, max=1024, group="main"),
    Option("max_completion_length", int, 256, "GRPO: the most tokens a completion may have (prompts are cut to "
           "`max_length`).", min=1, max=131072, group="advanced"),
    Option("temperature", float, 1.0, "GRPO: the sampling temperature of generation (the log-probabilities are "
           "of the logits over it, as TRL's).", min=1e-3, max=100.0, group="advanced"),
    Option("top_p", float, 1.0, "GRPO: nucleus sampling's probability mass.", min=1e-3, max=1.0, group="advanced"),
    Option("loss_type", str, "dapo", "GRPO: how the per-token losses are averaged: grpo (per completion, then over "
           "completions), bnpo and dapo (over the window's tokens), dr_grpo (over completions × "
           "max_completion_length).", choices=("grpo", "bnpo", "dr_grpo", "dapo"), group="advanced"),
    Option("epsilon", float, 0.2, "GRPO: the clipping range of the probability ratio (its lower side).", min=0.0,
           max=10.0, group="advanced"),
    Option("epsilon_high", float, None, "GRPO: the upper clipping range (default `epsilon`; DAPO uses 0.28).",
           min=0.0, max=10.0, group="advanced"),
    Option("scale_rewards", str, "group", "GRPO: advantages divided by the standard deviation of the group's "
           "rewards, of the window's, or not at all (Dr. GRPO).", choices=("group", "batch", "none"),
           group="advanced"),
    Option("num_iterations", int, 1, "GRPO: optimizer steps per generated window (μ): the same completions "
           "trained again, their probability ratio to the generating policy clipped; each is a step of max_steps, "
           "and checkpoints fall where a window ends (save_every a multiple of it).", min=1, max=64,
           group="advanced"),
)


# Distillation's options: the teacher and the divergence (TRL's DistillationTrainer's `beta` and `temperature`).
DISTILL_SETTINGS = ("distill_loss", "distill_beta", "distill_temperature", "distill_alpha", "distill_teacher",
                    "distill_top_k")
DISTILL_OPTIONS = (
    Option("teacher_model", str, None, "Distill: Hub id or local folder of the teacher, a causal LM whose tokenizer "
           "is the student's; frozen, beside the student on its device or its top-k log-probabilities cached "
           "(`distill_teacher`).", group="main", source="model"),
    Option("distill_loss", str, "forward_kl", "Distill: the divergence per token between the teacher's and the "
           "student's next-token distributions: forward_kl (KL(teacher‖student), mass-covering), reverse_kl "
           "(KL(student‖teacher), mode-seeking) or jsd (the generalized Jensen–Shannon divergence weighted by "
           "`distill_beta`).", choices=("forward_kl", "reverse_kl", "jsd"), group="main"),
    Option("distill_beta", float, 0.5, "Distill, jsd: β of the generalized JSD (TRL's `beta`: 0 is forward KL, 1 "
           "reverse KL).", min=0.0, max=1.0, group="advanced"),
    Option("distill_temperature", float, 1.0, "Distill: both distributions are softened by this temperature "
           "before the divergence (TRL's `temperature`; not rescaled by T²).", min=1e-3, max=100.0,
           group="advanced"),
    Option("distill_alpha", float, 0.0, "Distill: the weight of the plain next-token loss on the data's own "
           "tokens; the divergence gets 1 − alpha (0: the teacher's distribution alone, as TRL's).", min=0.0,
           max=1.0, group="advanced"),
    Option("distill_teacher", str, "auto", "Distill: where the teacher's distributions come from: device (the "
           "teacher frozen beside the student, a forward per micro-batch, the whole vocabulary), cache (its top "
           "`distill_top_k` log-probabilities per token computed once before training into the data cache, no "
           "teacher in memory while training) or auto (device when the teacher fits beside the student without a "
           "costlier plan, else cache; the plan says which).", choices=("auto", "device", "cache"),
           group="advanced"),
    Option("distill_top_k", int, 64, "Distill, cached teacher: the teacher's most likely tokens kept per position "
           "(values and ids); the rest of its mass is one tail bucket (TRL's `loss_add_tail`). 0: the whole "
           "vocabulary.", min=0, max=1_000_000, group="advanced"),
)


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
          columns=("text_column", "prompt_column", "completion_column", "messages_column", "tools_column"),
          own_columns=(("prompt_column", "completion_column"), ("messages_column",), ("tools_column",)),
          uses="`text_column`, or `prompt_column` with `completion_column`",
          column_reasons={"messages_column": "conversations train a language model",
                          "tools_column": "it gives a causal LM's conversations the tools their assistant calls"},
          declares=(Option("tools_column", str, None, "Causal LM: column of the tools each conversation may call "
                           "(a list of JSON schemas of functions, or JSON text; default 'tools' beside conversations), "
                           "rendered by the chat template's own tools support; assistant turns with `tool_calls` are "
                           "learned, `tool` results are not."),),
          auto_model="AutoModelForCausalLM", peft_task_type="CAUSAL_LM", peft_auto_model="AutoPeftModelForCausalLM",
          pipeline_tag="text-generation", architectures=("ForCausalLM", "LMHeadModel"), example="Once upon a time",
          multitask="shared",
          features=("packing", "segment_recurrence", "split_documents", "chunked_loss", "quantization"),
          metrics=("perplexity",), generates=True, exports=("merged", "gguf"), try_view="text", chat_when="messages",
          data_preview="conversation",
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
          settings=PREFERENCE_SETTINGS, declares=PREFERENCE_OPTIONS, generates=True, exports=("merged", "gguf"),
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
          declares=(Option("center_rewards_coefficient", float, None, "Reward: weight of the centring term "
                           "c·(r_chosen + r_rejected)² added to each pair's loss, which keeps the scores near 0 "
                           "(TRL's; unset: none).", min=0.0, max=100.0, group="advanced"),),
          declines={"preference": PREFERENCE_SETTINGS},
          decline_reason="trains with the Bradley–Terry loss and no reference model",
          step_metrics=("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"),
          refusals={"packing": "a reward pair's two sequences are scored side by side, not packed",
                    "segment_recurrence": "a reward model scores each sequence whole; turn it off",
                    "split_documents": "a reward pair is scored whole, so it cannot be split"},
          try_view="score", data_preview="pair"),
    Entry(name="distill", module="finetune.kinds.distill",
          summary="distillation of a causal LM from a teacher's token distributions",
          columns=("text_column", "prompt_column", "completion_column", "messages_column", "tools_column"),
          own_columns=(("teacher_model",), ("tools_column",)),
          uses="`teacher_model` with `text_column`, `prompt_column` and `completion_column`, or `messages_column`",
          column_reasons={"teacher_model": "it is the model a task=distill student learns from"},
          auto_model="AutoModelForCausalLM", peft_task_type="CAUSAL_LM", peft_auto_model="AutoPeftModelForCausalLM",
          pipeline_tag="text-generation", example="Once upon a time",
          # A distilled student is a causal LM: a saved one is told as causal_lm, which comes first.
          architectures=("ForCausalLM", "LMHeadModel"),
          metrics=("perplexity",), options=("teacher_model",), settings=DISTILL_SETTINGS, declares=DISTILL_OPTIONS,
          generates=True,
          exports=("merged", "gguf"), features=("split_documents",),
          refusals={"packing": "a packed row would need the teacher's logits over several documents at once; pack "
                               "with task=causal_lm",
                    "segment_recurrence": "the teacher reads each row whole; turn it off",
                    "chunked_loss": "the divergence needs the student's and the teacher's whole logits; turn it "
                                    "off"},
          try_view="text", chat_when="messages", data_preview="conversation"),
    Entry(name="token_classification", module="finetune.kinds.token_classification",
          summary="token classification (NER and tagging)", columns=("tokens_column", "tags_column"),
          own_columns=(("tokens_column", "tags_column"), ("label_all_tokens",)),
          uses="`tokens_column` and `tags_column`",
          column_reasons={"label_all_tokens": "it puts a word's tag on all its sub-tokens"},
          auto_model="AutoModelForTokenClassification", peft_task_type="TOKEN_CLS",
          peft_auto_model="AutoPeftModelForTokenClassification", pipeline_tag="token-classification",
          architectures=("ForTokenClassification",), example="My name is Clara and I live in Berkeley.",
          has_labels=True, options=("label_all_tokens",),
          declares=(Option("tokens_column", str, None, "Token classification: column of word lists (default 'tokens' "
                           "or 'words')."),
                    Option("tags_column", str, None, "Token classification: column of per-word tag lists, integers "
                           "(with the hub's ClassLabel names) or strings (default 'ner_tags' or 'tags')."),
                    Option("label_all_tokens", bool, False, "Token classification: put each word's tag on all its "
                           "sub-tokens (a B- tag continuing as I-), not only on the first.")),
          refusals={"packing": "token classification takes one sentence per row",
                    "segment_recurrence": "token classification tags each row whole; turn it off",
                    "split_documents": "a row's words and tags are cut at `max_length` together, not split; use "
                                       "long_documents=truncate (or auto)"},
          try_view="entities"),
    # Before seq2seq, whose architectures end in "ForConditionalGeneration" too: these are the vision-language ones.
    Entry(name="vlm", module="finetune.kinds.vlm",
          summary="vision-language chat (conversations with images)",
          columns=("messages_column", "images_column"), own_columns=(("images_column",),),
          uses="`messages_column` (and `images_column`)",
          column_reasons={"images_column": "it holds a vision-language conversation's images"},
          # peft's CAUSAL_LM task type would read a saved adapter as a causal LM's: without one, its base config's
          # architectures tell the kind (as image classification's).
          auto_model="AutoModelForImageTextToText", peft_auto_model="AutoPeftModel",
          pipeline_tag="image-text-to-text",
          architectures=("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                         "Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
          example="cat.png::What is in this picture?", metrics=("perplexity",),
          settings=("train_vision_tower",),
          declares=(Option("images_column", str, None, "Vision-language: the column of each conversation's images "
                           "(a list of images or image paths relative to the dataset, which must stay beside it; "
                           "default 'images' or 'image' when present), taken in order by the {\"type\": \"image\"} "
                           "parts of its messages. Unset: each image part names its own image."),
                    Option("train_vision_tower", bool, False, "Vision-language: train the vision tower too (with "
                           "LoRA: adapters on it too); by default it stays frozen and only the language model and "
                           "its projector train.", group="advanced")),
          refusals={"packing": "a vision-language conversation is trained with its images, not packed",
                    "segment_recurrence": "a vision-language conversation is read whole; turn it off",
                    "split_documents": "a conversation is kept whole, cut only between images at max_length; use "
                                       "long_documents=truncate (or auto)",
                    "gguf": "a vision-language model's GGUF needs llama.cpp's projector file (mmproj) beside it, "
                            "which this export does not write yet; export format=merged"},
          try_view="image_chat"),
    # Before embedding: Marian's "MarianMTModel" ends in "Model" too, like the bare encoders embedding reads.
    Entry(name="seq2seq", module="finetune.kinds.seq2seq",
          summary="sequence-to-sequence (summarisation, translation: a target text per source text)",
          columns=("source_column", "target_column"),
          own_columns=(("source_column", "target_column"), ("source_prefix",)),
          uses="`source_column` and `target_column`",
          column_reasons={"source_prefix": "it prefixes an encoder–decoder model's source texts"},
          auto_model="AutoModelForSeq2SeqLM", peft_task_type="SEQ_2_SEQ_LM",
          peft_auto_model="AutoPeftModelForSeq2SeqLM", pipeline_tag="text2text-generation",
          architectures=("ForConditionalGeneration", "MTModel"),
          example="The tower is 324 metres tall, about the same height as an 81-storey building.",
          metrics=("bleu", "chrf", "rougeL", "exact_match"), options=("source_prefix", "max_target_length"),
          settings=("max_target_length", "generation_max_length", "num_beams"),
          declares=(Option("source_column", str, None, "Seq2seq: the source text column (default 'source', "
                           "'input', 'document', 'text' or 'article')."),
                    Option("target_column", str, None, "Seq2seq: the target text column (default 'target', "
                           "'output', 'summary' or 'highlights')."),
                    Option("source_prefix", str, None, "Seq2seq: text put before every source (T5's 'summarize: ' "
                           "or 'translate English to German: '; unset: none); saved with the model, which prediction "
                           "reads."),
                    Option("max_target_length", int, 128, "Seq2seq: targets are cut to this many tokens (the "
                           "planner's decoder length).", min=1, max=65536),
                    Option("generation_max_length", int, 128, "Seq2seq: the most tokens an evaluation generates "
                           "per source.", min=1, max=65536, group="advanced"),
                    Option("num_beams", int, 1, "Seq2seq: beams of the evaluation's generation (1: greedy).",
                           min=1, max=64, group="advanced")),
          # Not `generates`: that marks a causal LM (a chat, a GGUF's stop tokens); a seq2seq model generates
          # through its own kind (`predict`, the evaluation's generation).
          refusals={"packing": "an encoder–decoder model reads one source per row",
                    "segment_recurrence": "an encoder–decoder model reads each source whole; turn it off",
                    "split_documents": "a target belongs to its whole source, so the source cannot be split; use "
                                       "long_documents=truncate (or auto)",
                    # llama.cpp's converter (vendor/llama.cpp/conversion/t5.py of llama-cpp-python's source
                    # release, which is where `finetune.use.llamacpp` takes it from) registers
                    # T5/MT5/UMT5ForConditionalGeneration, and no BART or Marian; llama-cpp-python's `Llama` only
                    # decodes (its low-level `llama_encode` is never called), so the export's check of the GGUF
                    # against transformers, and Ollama's runner, cannot run one (llama-cpp-python issue #1681).
                    "gguf": "llama.cpp's converter takes T5 models (not BART or Marian), but llama-cpp-python, "
                            "which runs every GGUF this export writes to check it against transformers, cannot run "
                            "an encoder–decoder model (its Llama class never calls llama.cpp's encoder)"},
          try_view="generated_text",
          presets=("google-t5/t5-small", "google/flan-t5-small", "facebook/bart-base")),
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
          declares=(Option("anchor_column", str, None, "Embedding: the anchor (query) column (default 'anchor', "
                           "'query' or 'sentence1')."),
                    Option("positive_column", str, None, "Embedding: the positive (document) column, or the second "
                           "sentence of a scored pair (default 'positive', 'document' or 'sentence2')."),
                    Option("negative_column", str, None, "Embedding: an optional hard-negative column (default "
                           "'negative' if present)."),
                    Option("score_column", str, None, "Embedding: the similarity of a scored pair, in [0, 1] "
                           "(default 'score' or 'similarity' beside sentence pairs); scored pairs train with "
                           "CoSENT."),
                    Option("embedding_loss", str, "auto", "Embedding: the loss: mnrl (multiple-negatives ranking: "
                           "each anchor's positive against every positive and negative of the window) or cosent "
                           "(scored pairs); auto follows the data's shape.", choices=("auto", "mnrl", "cosent"),
                           group="advanced"),
                    Option("embedding_scale", float, 20.0, "Embedding: the scale of the cosine similarities in the "
                           "loss (an inverse temperature; sentence-transformers' default 20).", min=1e-3,
                           max=1000.0, group="advanced"),
                    Option("pooling", str, "auto", "Embedding: how token states become one vector: mean, cls or "
                           "last token (auto: a sentence-transformers model's own pooling, else mean).",
                           choices=("auto", "mean", "cls", "last"), group="advanced"),
                    Option("normalize", str, "auto", "Embedding: scale the saved model's embeddings to unit length "
                           "(auto: as a sentence-transformers model does, else true; the cosine loss is the same "
                           "either way).", choices=("auto", "true", "false"), group="advanced")),
          refusals={"packing": "an embedding model reads each sentence whole, in-batch negatives beside it",
                    "segment_recurrence": "an embedding model reads each sentence whole; turn it off",
                    "split_documents": "a pair's sentences are cut at `max_length`, not split; use "
                                       "long_documents=truncate (or auto)"},
          try_view="vector"),
    Entry(name="image_classification", module="finetune.kinds.image_classification", summary="image classification",
          columns=("image_column", "label_column"), own_columns=(("image_column",),),
          uses="an image folder (one subfolder per class), or `image_column` and `label_column`",
          # peft has no task type for images: its adapter trains the new head whole (`modules_to_save`).
          auto_model="AutoModelForImageClassification", peft_auto_model="AutoPeftModel",
          pipeline_tag="image-classification", architectures=("ForImageClassification",), example="cat.png",
          has_labels=True, metrics=("accuracy", "macro_f1", "top5_accuracy"), inputs="images",
          settings=("augment",),
          declares=(Option("image_column", str, None, "Image classification: the column of images (an Image "
                           "feature, or image paths relative to the dataset, which must stay beside it; default "
                           "'image', 'img' or 'path'). A dataset of class subdirectories needs none."),
                    Option("augment", str, "none", "Image classification: augment the training images as they are "
                           "batched: none, or basic (a random resized crop and a horizontal flip).",
                           choices=("none", "basic"), group="advanced")),
          try_view="image",
          refusals={"packing": "an image classifier takes one image per row",
                    "segment_recurrence": "an image has no token segments; turn it off",
                    "split_documents": "an image is classified whole"},
          presets=("google/vit-base-patch16-224-in21k", "facebook/convnext-tiny-224", "microsoft/resnet-50",
                   "facebook/dinov2-small")),
    Entry(name="grpo", module="finetune.kinds.grpo",
          summary="online reinforcement learning with reward functions (GRPO, DAPO, Dr. GRPO)",
          columns=("prompt_column", "answer_column"),
          own_columns=(("answer_column",),),
          uses="`prompt_column` (and `answer_column` for exact_match)",
          column_reasons={"answer_column": "it is what a GRPO run's exact_match reward compares with"},
          auto_model="AutoModelForCausalLM", peft_task_type="CAUSAL_LM", peft_auto_model="AutoPeftModelForCausalLM",
          pipeline_tag="text-generation", example="What is 2 + 3?",
          # A tuned model is a causal LM: a saved one is told as causal_lm, which comes first.
          architectures=("ForCausalLM", "LMHeadModel"),
          metrics=("reward",),
          settings=GRPO_SETTINGS, declares=GRPO_OPTIONS, generates=True, exports=("merged", "gguf"),
          # Besides these, `rewards/<name>/mean` per reward and `kl` when `beta` > 0 (the configured kind's own
          # `step_metrics`).
          step_metrics=("reward", "reward_std", "completions/mean_length", "completions/clipped_ratio", "clip_ratio"),
          refusals={"packing": "a GRPO prompt is generated from and scored on its own, not packed",
                    "segment_recurrence": "a GRPO completion is scored whole; turn it off",
                    "split_documents": "a GRPO prompt is generated from whole, so it cannot be split; use "
                                       "long_documents=truncate (or auto)"},
          whole_window=True, config_checks="finetune.kinds.rewards:config_problems",
          curves=(("reward", "reward_std", "Reward of the completions (mean ± std)"),
                  ("completions/mean_length", "", "Completion length (tokens)")),
          try_view="text", chat_when="template"),
)}
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
    if not task_type:  # an adapter peft has no task type for (images): its base config's architecture says
        return kind_of_model_config(saved, default) or default
    sharing = [e for e in ENTRIES.values() if e.peft_task_type == task_type and _named(e, saved)]
    return next((e.name for e in sharing if e.problem_type == problem_type),
                next((e.name for e in sharing if e.problem_type is None), default))
