"""`task: causal_lm`, causal language modelling: what the registry knows of the kind without importing its
implementation (`finetune.kinds.causal_lm`)."""

from __future__ import annotations

from finetune.specs import Entry, Option

ENTRY = Entry(
    name="causal_lm", order=20, module="finetune.kinds.causal_lm", summary="causal language modelling",
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
             "openai-community/gpt2"),
    guide="task-kinds.md",
)
