"""`task: token_classification`, token classification (NER and tagging): what the registry knows of the kind without
importing its implementation (`finetune.kinds.token_classification`)."""

from __future__ import annotations

from finetune.specs import Entry, Option

ENTRY = Entry(
    name="token_classification", order=70, module="finetune.kinds.token_classification",
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
    try_view="entities",
    guide="task-kinds.md",
)
