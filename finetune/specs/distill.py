"""`task: distill`, distillation of a causal LM from a teacher's token distributions: what the registry knows of the
kind without importing its implementation (`finetune.kinds.distill`)."""

from __future__ import annotations

from finetune.specs import Entry, Option

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

ENTRY = Entry(
    name="distill", order=60, module="finetune.kinds.distill",
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
    try_view="text", chat_when="messages", data_preview="conversation",
    guide="task-kinds.md#distillation",
)
