"""Planning: from a memory budget to micro-batch, accumulation, checkpointing and LoRA, by a dry run."""
