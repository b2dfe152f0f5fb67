"""`task: classification`, text classification: what the registry knows of the kind without importing its implementation
(`finetune.kinds.classification`)."""

from __future__ import annotations

from finetune.specs import Entry

ENTRY = Entry(
    name="classification", order=10, module="finetune.kinds.classification", summary="text classification",
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
             "FacebookAI/roberta-base", "answerdotai/ModernBERT-base"),
    guide="task-kinds.md",
)
