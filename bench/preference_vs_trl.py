"""Benchmark: `finetune train` (task: preference, DPO) vs TRL's `DPOTrainer` on the same tiny model and pairs.

Both train the same freshly initialised tiny GPT-2 (built from a config, the bundled tokenizer; no download) for
`--steps` optimizer steps of `--batch` pairs with DPO (β = 0.1), AdamW at a constant learning rate, no warm-up, no
weight decay, gradient clipping at 1.0, fp32, on the CPU, the reference precomputed once before training in both
(`precompute_reference` here, `precompute_ref_log_probs` in TRL). Printed: the loss of every step side by side,
the held-out preference accuracy (`rewards/accuracies`: the chosen reply's implicit reward above the rejected
one's) after training, and seconds per optimizer step (the training loop alone: TRL's `train_runtime`, our
`train_seconds`, each over the steps; the precompute pass is inside both).

The pairs: `--data` (a JSONL of prompt/chosen/rejected text), or `--hub NAME` (a hub dataset with those columns),
or by default a preference task from the bundled SST-2 sample (assets/sst2_sample.csv): prompt "A positive review:",
a positive sentence preferred over a negative one. The two tools visit the pairs in different random orders, so
their curves agree in trend, not step by step (the step-one loss and gradient equality is tests/test_preference.py).

    python bench/preference_vs_trl.py                 # 60 steps of 8 pairs
    python bench/preference_vs_trl.py --steps 10      # a quick smoke run
    python bench/preference_vs_trl.py --data pairs.jsonl --json results.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

BETA, LEARNING_RATE, MAX_LENGTH, SEED = 0.1, 5e-4, 64, 0


def sst2_pairs(n: int) -> list[dict[str, str]]:
    """Preference pairs from the bundled SST-2 sample: a positive sentence preferred over a negative one."""
    with open(REPO_ROOT / "assets" / "sst2_sample.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    positive = [r["sentence"] for r in rows if r["label"] == "1"]
    negative = [r["sentence"] for r in rows if r["label"] == "0"]
    rng = random.Random(SEED)
    rng.shuffle(positive)
    rng.shuffle(negative)
    return [{"prompt": "A positive review:", "chosen": " " + p, "rejected": " " + q}
            for p, q in zip(positive[:n], negative[:n], strict=False)]


def load_pairs(args: argparse.Namespace) -> list[dict[str, str]]:
    """The pairs the benchmark trains and evaluates on."""
    if args.data:
        return [json.loads(line) for line in Path(args.data).read_text(encoding="utf-8").splitlines() if line.strip()]
    if args.hub:
        import datasets

        table = datasets.load_dataset(args.hub, split="train")
        return [{k: str(r[k]) for k in ("prompt", "chosen", "rejected")} for r in table.select(range(args.pairs))]
    return sst2_pairs(args.pairs)


def tiny_model(folder: Path) -> str:
    """A 2-layer GPT-2 (hidden 64, no dropout) with the bundled tokenizer, saved to `folder`."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from finetune.models.load import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("bundled:all-MiniLM-L6-v2"))
    tok.eos_token = "[SEP]"
    torch.manual_seed(SEED)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     bos_token_id=tok.cls_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def run_finetune(model: str, train: Path, held_out: Path, out: Path, steps: int, batch: int) -> dict:
    """Our run: the step losses, seconds per step and the held-out metrics."""
    from finetune.config.schema import from_dict
    from finetune.run.events import read_events
    from finetune.train.loop import train as train_run

    c = from_dict({"model": model, "dataset": str(train), "eval_dataset": str(held_out), "task": "preference",
                   "preference_loss": "dpo", "beta": BETA, "max_length": MAX_LENGTH, "output_dir": str(out),
                   "max_steps": steps, "effective_batch_size": batch, "micro_batch_size": batch,
                   "learning_rate": LEARNING_RATE, "lr_scheduler": "constant", "warmup_ratio": 0.0,
                   "weight_decay": 0.0, "max_grad_norm": 1.0, "optimizer": "adamw", "precision": "fp32",
                   "seed": SEED, "logging_every": 1, "lora": "false", "precompute_reference": "true"})
    result = train_run(c)
    events = read_events(out / "events.jsonl")
    seconds = json.loads((out / "metrics.json").read_text())["train_seconds"]
    return {"losses": [e["loss"] for e in events if e["event"] == "step"], "seconds_per_step": seconds / steps,
            "accuracy": result.metrics.get("rewards/accuracies"), "margin": result.metrics.get("rewards/margins")}


def run_trl(model: str, pairs: list[dict], held_out: list[dict], out: Path, steps: int, batch: int) -> dict:
    """TRL's DPOTrainer with the same settings."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(out), loss_type=["sigmoid"], beta=BETA, per_device_train_batch_size=batch,
                     per_device_eval_batch_size=batch, learning_rate=LEARNING_RATE, lr_scheduler_type="constant",
                     warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=steps, logging_steps=1,
                     report_to=[], use_cpu=True, max_length=MAX_LENGTH, seed=SEED, save_strategy="no",
                     precompute_ref_log_probs=True, dataloader_num_workers=0)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model), args=args,
                         train_dataset=Dataset.from_list(pairs), eval_dataset=Dataset.from_list(held_out),
                         processing_class=AutoTokenizer.from_pretrained(model))
    output = trainer.train()
    metrics = trainer.evaluate()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return {"losses": losses, "seconds_per_step": output.metrics["train_runtime"] / steps,
            "accuracy": metrics.get("eval_rewards/accuracies"), "margin": metrics.get("eval_rewards/margins")}


def main() -> None:
    """Run both tools and print the curves and timings side by side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=400, help="pairs built from SST-2 (or read from --hub)")
    parser.add_argument("--data", help="a JSONL of prompt/chosen/rejected")
    parser.add_argument("--hub", help="a hub dataset with prompt/chosen/rejected text columns")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    pairs = load_pairs(args)
    cut = max(1, len(pairs) // 5)
    train_pairs, held_out = pairs[cut:], pairs[:cut]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # a cold data and plan cache
        model = tiny_model(tmp_path / "model")
        for name, rows in (("train", train_pairs), ("eval", held_out)):
            (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        ours = run_finetune(model, tmp_path / "train.jsonl", tmp_path / "eval.jsonl", tmp_path / "ours", args.steps,
                            args.batch)
        theirs = run_trl(model, train_pairs, held_out, tmp_path / "trl", args.steps, args.batch)
    print(f"{len(train_pairs)} training pairs, {len(held_out)} held out; {args.steps} steps of {args.batch} pairs")
    print(f"{'step':>5} {'finetune':>10} {'TRL':>10}")
    for i, (a, b) in enumerate(zip(ours["losses"], theirs["losses"], strict=False), start=1):
        print(f"{i:5d} {a:10.4f} {b:10.4f}")
    for name, r in (("finetune", ours), ("TRL DPOTrainer", theirs)):
        print(f"{name}: {r['seconds_per_step']:.3f} s/step, held-out rewards/accuracies {r['accuracy']:.3f}, "
              f"rewards/margins {r['margin']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"finetune": ours, "trl": theirs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
