"""`task: regression`, text regression: what the registry knows of the kind without importing its implementation
(`finetune.kinds.regression`)."""

from __future__ import annotations

from finetune.specs import Entry

ENTRY = Entry(
    name="regression", order=30, module="finetune.kinds.regression", summary="text regression",
    columns=("text_column", "text_pair_column", "label_column"),
    uses="`text_column` and `label_column` (a number)",
    auto_model="AutoModelForSequenceClassification", peft_task_type="SEQ_CLS",
    peft_auto_model="AutoPeftModelForSequenceClassification", pipeline_tag="text-classification",
    architectures=("ForSequenceClassification",), example="I loved this film.", multitask="heads",
    problem_type="regression", metrics=("mse", "rmse", "mae", "pearson", "spearman"),
    refusals={"packing": "a regression head takes one sample per row",
              "segment_recurrence": "a regression head reads each text whole; turn it off",
              "split_documents": "a target belongs to the whole text, so its parts cannot each carry it"},
    try_view="value", eval_plot="scatter",
    guide="task-kinds.md",
)
