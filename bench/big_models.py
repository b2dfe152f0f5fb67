"""The planner's ladder for Llama-3-shaped 8 B and 3 B models on a CUDA GPU, predicted from a config.json alone
(no weights, no GPU): each rung's peak at micro-batch 2 × 2,048 tokens, as torchtune measures its figures.

    python bench/big_models.py            # prints a Markdown table (docs/benchmarks.md, "Quantized bases")

Predicted only: run bench/fsdp_gpu_check.py-style measurements on a GPU to compare (not done yet)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.config.schema import from_dict  # noqa: E402
from finetune.plan.planner import make_plan  # noqa: E402

GIB = 2**30
SHAPES = {  # Llama 3.1 8B and Llama 3.2 3B
    "8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "tie_word_embeddings": False},
    "3B": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8, "tie_word_embeddings": True},
}
RUNGS = {  # the planner's ladder, each rung fixed
    "full, checkpointing, AdamW": {"lora": "false", "quantization": "none", "optimizer": "adamw"},
    "full, checkpointing, 8-bit AdamW": {"lora": "false", "quantization": "none", "optimizer": "adamw_8bit"},
    "LoRA, bf16 base": {"lora": "true", "quantization": "none", "optimizer": "adamw"},
    "QLoRA 8-bit base": {"lora": "true", "quantization": "8bit", "optimizer": "adamw"},
    "QLoRA 4-bit base": {"lora": "true", "quantization": "4bit", "optimizer": "adamw"},
}


def main() -> None:
    """Print one row per model and rung."""
    from transformers import LlamaConfig

    print("| model | rung | predicted peak (GiB) | of which overhead |")
    print("| --- | --- | --- | --- |")
    for name, shape in SHAPES.items():
        folder = Path(tempfile.mkdtemp()) / name
        LlamaConfig(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, **shape
                    ).save_pretrained(folder)
        for rung, options in RUNGS.items():
            c = from_dict({"model": str(folder), "task": "causal_lm", "dataset": "x.csv", "max_length": 2048,
                           "effective_batch_size": 2, "micro_batch_size": 2, "gradient_checkpointing": "true",
                           "precision": "bf16", **options})
            plan = make_plan(c, [2048, 2048], 0, device=("cuda (planned)", 80 * GIB))
            print(f"| {name} | {rung} | {plan.predicted_peak_bytes / GIB:.1f} | "
                  f"{plan.breakdown['overhead'] / GIB:.1f} |", flush=True)


if __name__ == "__main__":
    main()
