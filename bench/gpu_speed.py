"""Speed and memory on one GPU: `transformers.Trainer` against `finetune train`, side by side, full and LoRA.

    python bench/gpu_speed.py                    # Llama-3.2-1B's shape, 1,024 tokens, 4 × 4 per step, 12 steps
    python bench/gpu_speed.py --shape tiny --device cpu --tokens 64 --steps 4   # a smoke run on a CPU

Both tools train the same model (built from its config, random weights, saved in bf16: nothing downloaded) on the
same texts (random words of the bundled tokenizer's vocabulary, each cut to exactly `--tokens` tokens, so no
padding), with the same micro-batch and accumulation, bf16 autocast over fp32 master weights (fp32 on a CPU), AdamW
at the same learning rate, gradient checkpointing on, and for LoRA the same rank, alpha and all-linear targets
(peft). Each row is a fresh process, so neither tool inherits the other's imports, allocations or compiled kernels.

Per row: tokens per second over the optimizer steps after the first two (the steady state; data loading, the
plan and the first steps' allocations are left out for both), seconds per step, the final loss, and the peak of
`torch.cuda.max_memory_allocated` over the whole run (on a CPU: not measured). Hub kernels are off for both
(`use_kernels=False`, `kernels=off`): the same layers run in both tools.

Without network, bring the wheels a stock image lacks (docs/benchmarks.md, "Running on a GPU machine without
network"); the script says in one line what is missing.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from preflight import check_packages  # noqa: E402

if __name__ == "__main__":
    check_packages("gpu_speed.py")

import torch  # noqa: E402

SHAPES = {
    "1B": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "tie_word_embeddings": True},
    "tiny": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "tie_word_embeddings": False},
}
LEARNING_RATE, LORA_R, LORA_ALPHA = 1e-4, 16, 32
WARM_STEPS = 2  # steps left out of the timing


def build(shape: str, folder: Path, tokens: int, rows: int) -> tuple[str, str]:
    """The model (saved in bf16 with the bundled tokenizer) and a CSV of `rows` texts of at least `tokens` tokens."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from finetune.config.modelpath import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("bundled:all-MiniLM-L6-v2"))
    tok.eos_token = "[SEP]"
    config = LlamaConfig(**SHAPES[shape], vocab_size=tok.vocab_size, max_position_embeddings=max(4096, tokens),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    words = [w for w in tok.get_vocab() if w.isalpha() and len(w) > 2]
    rng = random.Random(0)
    data = folder / "texts.csv"
    with open(data, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text"])
        for _ in range(rows):
            writer.writerow([" ".join(rng.choice(words) for _ in range(tokens + 16))])
    return str(folder / "model"), str(data)


def _peak(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def worker_trainer(args: argparse.Namespace) -> dict:
    """transformers.Trainer on the texts, cut to `tokens` tokens; step times from a callback."""
    import datasets
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    tok = AutoTokenizer.from_pretrained(args.model)
    rows = datasets.load_dataset("csv", data_files=args.data, split="train")
    rows = rows.map(lambda b: tok(b["text"], truncation=True, max_length=args.tokens), batched=True,
                    remove_columns=["text"])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, use_kernels=False)
    if args.mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter())

    bf16 = args.device == "cuda"
    training = TrainingArguments(output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=args.micro,
                                 gradient_accumulation_steps=args.accum, max_steps=args.steps,
                                 learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0,
                                 bf16=bf16, gradient_checkpointing=True,
                                 gradient_checkpointing_kwargs={"use_reentrant": False}, save_strategy="no",
                                 logging_steps=1, report_to="none", use_cpu=args.device == "cpu", seed=0)
    trainer = Trainer(model=model, args=training, train_dataset=rows, callbacks=[Clock()],
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = trainer.train()
    return {"times": times, "loss": trainer.state.log_history[-2].get("loss", result.training_loss),
            "peak_gib": _peak(args.device)}


def worker_finetune(args: argparse.Namespace) -> dict:
    """`finetune train` in-process with the same settings; step times from its events."""
    from finetune.config.schema import from_dict
    from finetune.run.events import read_events
    from finetune.train.loop import train

    out = Path(args.out) / "finetune"
    c = from_dict({"model": args.model, "dataset": args.data, "task": "causal_lm", "max_length": args.tokens,
                   "long_documents": "truncate", "micro_batch_size": args.micro, "grad_accum_steps": args.accum,
                   "max_steps": args.steps, "learning_rate": LEARNING_RATE, "lr_scheduler": "constant",
                   "warmup_ratio": 0.0, "optimizer": "adamw", "precision": "bf16" if args.device == "cuda" else "fp32",
                   "gradient_checkpointing": "true", "lora": "true" if args.mode == "lora" else "false",
                   "lora_r": LORA_R, "lora_alpha": LORA_ALPHA, "quantization": "none", "chunked_loss": "false",
                   "eval_fraction": 0.0, "kernels": "off", "output_dir": str(out), "plan_probe": "false",
                   "seed": 0})
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train(c)
    steps = [e for e in read_events(out / "events.jsonl") if e["event"] == "step"]
    return {"times": [e["time"] for e in steps], "loss": steps[-1]["loss"], "peak_gib": _peak(args.device)}


def summary(result: dict, args: argparse.Namespace) -> dict:
    """Tokens per second and seconds per step over the steps after the warm ones."""
    times = result["times"][WARM_STEPS - 1:]
    seconds = (times[-1] - times[0]) / max(1, len(times) - 1)
    tokens = args.micro * args.accum * args.tokens
    return {"tokens_per_s": tokens / seconds, "s_per_step": seconds, "loss": result["loss"],
            "peak_gib": result["peak_gib"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="1B")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--tokens", type=int, default=1024, help="Tokens per sample (default 1,024).")
    parser.add_argument("--micro", type=int, default=4, help="Samples per micro-batch (default 4).")
    parser.add_argument("--accum", type=int, default=4, help="Micro-batches per optimizer step (default 4).")
    parser.add_argument("--steps", type=int, default=12, help="Optimizer steps (default 12; the first 2 untimed).")
    parser.add_argument("--modes", nargs="+", choices=("full", "lora"), default=["full", "lora"])
    parser.add_argument("--worker", choices=("trainer", "finetune"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # one row, in this fresh process: its JSON on the last line
        from finetune.models.pretrained import quiet_transformers

        quiet_transformers()
        result = (worker_trainer if args.worker == "trainer" else worker_finetune)(args)
        print(json.dumps(summary(result, args)))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_speed.py needs a CUDA GPU (or --device cpu --shape tiny for a smoke run).", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model, data = build(args.shape, Path(tmp), args.tokens, args.micro * args.accum * args.steps)
        print(f"{args.shape} shape, {args.tokens} tokens × {args.micro} × {args.accum} per step, {args.steps} steps "
              f"(first {WARM_STEPS} untimed), {args.device}, torch {torch.__version__}\n")
        print("| mode | tool | tokens/s | s/step | final loss | peak GiB (max_memory_allocated) |")
        print("|---|---|---:|---:|---:|---:|")
        for mode in args.modes:
            for tool in ("trainer", "finetune"):
                command = [sys.executable, __file__, "--worker", tool, "--mode", mode, "--model", model, "--data",
                           data, "--out", str(Path(tmp) / f"{tool}-{mode}"), "--device", args.device, "--tokens",
                           str(args.tokens), "--micro", str(args.micro), "--accum", str(args.accum), "--steps",
                           str(args.steps)]
                proc = subprocess.run(command, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"| {mode} | {tool} | failed: {proc.stderr.strip().splitlines()[-1:]} | | | |", flush=True)
                    continue
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                peak = f"{row['peak_gib']:.2f}" if row["peak_gib"] is not None else "n/a (CPU)"
                print(f"| {mode} | {'transformers.Trainer' if tool == 'trainer' else 'finetune'} | "
                      f"{row['tokens_per_s']:,.0f} | {row['s_per_step']:.3f} | {row['loss']:.4f} | {peak} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
