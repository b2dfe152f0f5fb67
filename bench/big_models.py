"""The planner's ladder for Llama-3-shaped 8 B and 3 B models on a CUDA GPU, predicted from a config.json alone
(no weights, no GPU): each rung's peak at micro-batch 2 × 2,048 tokens, as torchtune measures its figures.

    python bench/big_models.py            # prints Markdown tables (docs/benchmarks.md, "Quantized bases")

Each rung with the full loss and with the chunked loss (`chunked_loss`), and the longest context that fits 8, 12 and
24 GiB on a 4-bit base. Predicted only: bench/gpu_check.py measures the same kinds of rows on a GPU."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.config.schema import from_dict  # noqa: E402
from finetune.kinds.causal_lm import CHUNKED, KIND  # noqa: E402
from finetune.plan.planner import SAFETY, estimate  # noqa: E402
from finetune.plan.skeleton import model_skeleton  # noqa: E402

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


def _config(folder: Path, tokens: int, **options: str) -> object:
    return from_dict({"model": str(folder), "task": "causal_lm", "dataset": "x.csv", "max_length": tokens,
                      "effective_batch_size": 2, "micro_batch_size": 2, "gradient_checkpointing": "true",
                      "precision": "bf16", **options})


def ladder(name: str, folder: Path) -> None:
    """One row per rung: the predicted peak with the full loss and with the chunked one (dry runs shared by the
    rungs that differ only in the optimizer or in how the base is stored, as the planner shares them)."""
    skeletons: dict[bool, object] = {}
    windows: dict = {}
    for rung, options in RUNGS.items():
        c = _config(folder, 2048, **options)
        lora = c.lora == "true"
        if lora not in skeletons:
            skeletons[lora] = model_skeleton(c, 0, checkpointing=True, lora=lora, precision="bf16")
        peaks = []
        for kind in (KIND, CHUNKED):
            terms = estimate(skeletons[lora], c, kind=kind, micro=2, tokens=2048, accum=1, precision="bf16",
                             optimizer=c.optimizer, device="cuda", quantization=c.quantization, windows=windows)
            peaks.append((sum(terms.values()), terms["overhead"], terms["logits"]))
        (full, overhead, logits), (chunked, _, chunk_logits) = peaks
        print(f"| {name} | {rung} | {full / GIB:.1f} | {chunked / GIB:.1f} | {overhead / GIB:.1f} | "
              f"{logits / GIB:.2f} → {chunk_logits / GIB:.2f} |", flush=True)


def longest(folder: Path, budgets: tuple[float, ...]) -> None:
    """The longest sample that fits each budget at micro-batch 1 on a 4-bit base with 8-bit AdamW, checkpointing
    and the chunked loss, as `finetune plan --longest` answers it, found by a straight line through two dry runs
    (the peak grows linearly with the length under sdpa) and checked with a dry run at the answer, shortened by 1 %
    until it fits."""
    c = _config(folder, 2048, lora="true", quantization="4bit", optimizer="adamw_8bit", micro_batch_size=1,
                effective_batch_size=1, chunked_loss="true")
    skeleton = model_skeleton(c, 0, checkpointing=True, lora=True, precision="bf16")

    def peak(tokens: int) -> int:
        terms = estimate(skeleton, c, kind=CHUNKED, micro=1, tokens=tokens, accum=1, precision="bf16",
                         optimizer="adamw_8bit", device="cuda", quantization="4bit")
        return sum(terms.values())

    a, b = 2048, 16384
    pa, pb = peak(a), peak(b)
    slope = (pb - pa) / (b - a)
    for budget in budgets:
        tokens = int(a + (SAFETY * budget * GIB - pa) / slope)
        checked = peak(tokens) if tokens > 0 else 0
        while tokens > 0 and checked > SAFETY * budget * GIB:
            tokens = int(tokens * 0.99)
            checked = peak(tokens)
        print(f"| {budget:g} GiB | {max(tokens, 0):,} | {checked / GIB:.2f} |", flush=True)


def main() -> None:
    """Print the ladder of each model, then the longest context of the 8 B shape at 8, 12 and 24 GiB."""
    from transformers import LlamaConfig

    folders = {}
    for name, shape in SHAPES.items():
        folders[name] = Path(tempfile.mkdtemp()) / name
        LlamaConfig(vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, **shape
                    ).save_pretrained(folders[name])
    print("| model | rung | full loss (GiB) | chunked loss (GiB) | of which overhead | logits term (GiB) |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for name, folder in folders.items():
        ladder(name, folder)
    print("\n| budget | longest sample, 8B on a 4-bit base (tokens) | predicted peak there (GiB) |")
    print("| ---: | ---: | ---: |")
    longest(folders["8B"], (8, 12, 24))


if __name__ == "__main__":
    main()
