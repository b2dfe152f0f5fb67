"""`task: vlm`, vision-language chat (conversations with images): what the registry knows of the kind without importing
its implementation (`finetune.kinds.vlm`)."""

from __future__ import annotations

from finetune.specs import Entry, Option

# Its order before seq2seq's: their architectures end in "ForConditionalGeneration" too; these are the
# vision-language ones.
ENTRY = Entry(
    name="vlm", order=80, module="finetune.kinds.vlm",
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
    try_view="image_chat",
    guide="task-kinds.md#vision-language-sft",
)
