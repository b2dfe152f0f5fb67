"""`task: preference`, preference tuning (DPO, IPO, SimPO, ORPO): what the registry knows of the kind without importing
its implementation (`finetune.kinds.preference`)."""

from __future__ import annotations

from finetune.specs import Entry, Option

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

ENTRY = Entry(
    name="preference", order=40, module="finetune.kinds.preference",
    summary="preference tuning (DPO, IPO, SimPO, ORPO)",
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
    try_view="text", chat_when="template", data_preview="pair",
    guide="preference.md",
)
