"""Models: loading a Transformers model (LoRA, heads of a multi-task run)."""
