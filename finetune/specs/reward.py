"""`task: reward`, reward modelling (a score per text, trained on preference pairs): what the registry knows of the kind
without importing its implementation (`finetune.kinds.reward`)."""

from __future__ import annotations

from finetune.specs import Entry, Option
from finetune.specs.preference import PREFERENCE_SETTINGS

ENTRY = Entry(
    name="reward", order=50, module="finetune.kinds.reward",
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
    try_view="score", data_preview="pair",
    guide="preference.md#reward-models-task-reward",
)
