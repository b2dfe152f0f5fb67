"""`task: grpo`, online reinforcement learning with reward functions (GRPO, DAPO, Dr. GRPO): what the registry knows of
the kind without importing its implementation (`finetune.kinds.grpo`)."""

from __future__ import annotations

from finetune.specs import Entry, Option

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

ENTRY = Entry(
    name="grpo", order=120, module="finetune.kinds.grpo",
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
    try_view="text", chat_when="template",
    guide="grpo.md",
)
