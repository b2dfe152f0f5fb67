"""`task: seq2seq`, sequence-to-sequence (summarisation, translation: a target text per source text): what the registry
knows of the kind without importing its implementation (`finetune.kinds.seq2seq`)."""

from __future__ import annotations

from finetune.specs import Entry, Option

# Its order before embedding's: Marian's "MarianMTModel" ends in "Model" too, like the bare encoders embedding
# reads.
ENTRY = Entry(
    name="seq2seq", order=90, module="finetune.kinds.seq2seq",
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
    presets=("google-t5/t5-small", "google/flan-t5-small", "facebook/bart-base"),
    guide="task-kinds.md#sequence-to-sequence",
)
