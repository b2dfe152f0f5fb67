"""Fine-tune Hugging Face Transformers models within a memory budget, with exact gradient accumulation."""

__version__ = "0.1.0"
