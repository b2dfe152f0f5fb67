"""Benchmark: GRPO here (`task: grpo`) and through TRL's `GRPOTrainer`, side by side in one run, on the same tiny
model, prompts and reward.

The task is arithmetic with `exact_match` (`finetune.kinds.rewards.exact_match`: the completion's final number
against the answer): by default every sum `a + b =` of two numbers below `--operands` (15: 225 problems, shuffled),
or `--data FILE`, a JSON Lines file of `prompt` and `answer` (assets/arithmetic_sample.jsonl is one). The last
fifth is held out, and a few more so that the training prompts fill whole steps (176 and 49 by default). The
model is a 2-layer GPT-2 (hidden 64, 4 heads, dropout 0) built here from its config on a word-level tokenizer
made from the data's words (every whitespace-separated word a token, so a number is one token): nothing is
downloaded, and on 2 CPU cores the whole benchmark takes a few minutes.

1. **SFT.** A freshly initialised model learns the answer's format (the number, then the end of sequence) with our
   `task: causal_lm` for `--sft-steps` (150) steps of 16 training problems (prompt masked, learning rate 3e-3): on
   purpose too short to learn every sum, so that the rewards still vary within a group.
2. **GRPO**, from that SFT model, here and through TRL, with the same settings: `--steps` optimizer steps of
   `--prompts` training prompts × `--generations` (G) completions each (one micro-batch, no accumulation), at most
   `--completion-length` new tokens, temperature 1, `loss_type: dapo`, ε 0.2, β 0 (no reference), rewards scaled
   by their group's standard deviation, AdamW at a constant `--learning-rate`, no warm-up, no weight decay,
   clipping at 1.0, fp32 on the CPU, seed 0. TRL's reward function calls the same `exact_match`.
3. **Reward before and after**, measured the same way for the SFT model and both trained ones: the mean
   `exact_match` of G sampled completions per prompt (temperature 1, seeded) on the training prompts (those GRPO
   trains on) and on the held-out ones, and of the greedy completion on the held-out ones; and each trainer's
   own logged training reward (`reward`) over its first and last five steps. Seconds per step: training time over
   steps, from each tool's own count (our `train_seconds`, TRL's `train_runtime`).

    nice python bench/grpo_vs_trl.py                         # the default sums
    python bench/grpo_vs_trl.py --data assets/arithmetic_sample.jsonl --sft-steps 120
    python bench/grpo_vs_trl.py --quick                       # a smoke run (a few steps each)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

SEED = 0
SFT_BATCH, SFT_LEARNING_RATE = 16, 3e-3
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def sums(operands: int) -> list[dict[str, str]]:
    """Every problem `a + b =` with a and b below `operands`, shuffled with the benchmark's seed."""
    rows = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(operands) for b in range(operands)]
    random.Random(SEED).shuffle(rows)
    return rows


def refuse(sentence: str) -> None:
    """Bad input: one sentence on stderr, exit 2."""
    print(sentence, file=sys.stderr)
    raise SystemExit(2)


def read_rows(path: Path) -> list[dict[str, str]]:
    """The `prompt` and `answer` of each row of a JSON Lines file."""
    if not path.is_file():
        refuse(f"{path} is not a file: give --data a JSON Lines file of prompt and answer.")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    missing = [i for i, r in enumerate(rows) if "prompt" not in r or "answer" not in r]
    if missing:
        refuse(f"{path}: row {missing[0] + 1} has no `prompt` or no `answer` (every row needs both).")
    return [{"prompt": str(r["prompt"]), "answer": str(r["answer"])} for r in rows]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """`rows` as a JSON Lines file at `path`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def tiny_model(folder: Path, rows: list[dict[str, str]]) -> str:
    """A 2-layer GPT-2 (hidden 64, 4 heads, no dropout) on a word-level tokenizer of the rows' words, saved to
    `folder`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = sorted({w for r in rows for w in (r["prompt"] + " " + r["answer"]).split()})
    vocab = {w: i for i, w in enumerate([PAD, EOS, UNK, *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    longest = max(len((r["prompt"] + " " + r["answer"]).split()) for r in rows)
    torch.manual_seed(SEED)
    cfg = GPT2Config(vocab_size=len(vocab), n_positions=longest + 16, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=vocab[EOS],
                     bos_token_id=vocab[EOS], pad_token_id=vocab[PAD])
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def run_sft(model: str, rows: list[dict[str, str]], folder: Path, steps: int) -> dict[str, Any]:
    """`task: causal_lm` on prompt/completion rows (the answer after the prompt): the model GRPO starts from."""
    from finetune.config.schema import from_dict
    from finetune.train.loop import train as train_run

    data = write_jsonl(folder / "sft.jsonl", [{"prompt": r["prompt"], "completion": " " + r["answer"]}
                                             for r in rows])
    start = time.perf_counter()
    train_run(from_dict({
        "model": model, "task": "causal_lm", "dataset": str(data), "output_dir": str(folder / "sft"),
        "max_steps": steps, "effective_batch_size": SFT_BATCH, "micro_batch_size": SFT_BATCH,
        "learning_rate": SFT_LEARNING_RATE, "lr_scheduler": "constant", "warmup_ratio": 0.0, "weight_decay": 0.0,
        "max_grad_norm": 1.0, "optimizer": "adamw", "precision": "fp32", "seed": SEED, "logging_every": 10,
        "eval_fraction": 0.0, "lora": "false", "max_length": 64}))
    return {"model": str(folder / "sft" / "model"), "wall_seconds": time.perf_counter() - start}


def run_finetune(model: str, train: Path, folder: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Our GRPO run: its logged rewards, seconds per step and the trained model's folder."""
    from finetune.config.schema import from_dict
    from finetune.run.events import read_events
    from finetune.train.loop import train as train_run

    out = folder / "finetune"
    c = from_dict({"model": model, "task": "grpo", "dataset": str(train), "output_dir": str(out),
                   "rewards": ["exact_match"], "answer_column": "answer", "num_generations": a.generations,
                   "max_completion_length": a.completion_length, "temperature": 1.0, "loss_type": "dapo",
                   "epsilon": 0.2, "beta": 0.0, "scale_rewards": "group",
                   "effective_batch_size": a.prompts * a.generations, "micro_batch_size": a.prompts * a.generations,
                   "max_steps": a.steps, "learning_rate": a.learning_rate, "lr_scheduler": "constant",
                   "warmup_ratio": 0.0, "weight_decay": 0.0, "max_grad_norm": 1.0, "optimizer": "adamw",
                   "precision": "fp32", "seed": SEED, "logging_every": 1, "eval_fraction": 0.0, "lora": "false",
                   "max_length": 64})
    start = time.perf_counter()
    train_run(c)
    wall = time.perf_counter() - start
    steps = [e for e in read_events(out / "events.jsonl") if e["event"] == "step"]
    seconds = json.loads((out / "metrics.json").read_text())["train_seconds"]
    return {"rewards": [e["metrics"]["reward"] if "metrics" in e else e["reward"] for e in steps],
            "seconds_per_step": seconds / a.steps, "wall_seconds": wall, "model": str(out / "model")}


def run_trl(model: str, rows: list[dict[str, str]], folder: Path, a: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer with the same settings and the same reward; the trained model is returned as `trained`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from finetune.kinds.rewards import exact_match

    def exact(prompts: list, completions: list, completion_ids: list, answer: list, **_: Any) -> list[float]:
        return [exact_match(text, truth) for text, truth in zip(completions, answer, strict=True)]

    start = time.perf_counter()
    args = GRPOConfig(output_dir=str(folder / "trl"), per_device_train_batch_size=a.prompts * a.generations,
                      num_generations=a.generations, max_completion_length=a.completion_length, temperature=1.0,
                      top_p=1.0, top_k=0, loss_type="dapo", epsilon=0.2, beta=0.0, scale_rewards="group",
                      learning_rate=a.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                      max_grad_norm=1.0, max_steps=a.steps, logging_steps=1, report_to=[], use_cpu=True, seed=SEED,
                      save_strategy="no", dataloader_num_workers=0)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model), reward_funcs=[exact], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(model))
    output = trainer.train()
    wall = time.perf_counter() - start
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"rewards": rewards, "seconds_per_step": output.metrics["train_runtime"] / a.steps,
            "wall_seconds": wall, "trained": trainer.model}


def mean_reward(model: Any, tokenizer: Any, rows: list[dict[str, str]], generations: int,
                completion_length: int) -> tuple[float, float]:
    """The mean exact_match on `rows`: of `generations` sampled completions per prompt (temperature 1, seeded),
    and of the greedy completion."""
    import torch

    from finetune.kinds.rewards import exact_match

    model.eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sampled = greedy = 0.0
    torch.manual_seed(SEED)
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]])
            for sample, count in ((True, generations), (False, 1)):
                prompt = ids.expand(count, -1)
                out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=sample,
                                     temperature=1.0 if sample else None, top_p=None, top_k=None,
                                     max_new_tokens=completion_length, eos_token_id=eos, pad_token_id=pad)
                texts = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
                score = sum(exact_match(t, row["answer"]) for t in texts) / count
                sampled, greedy = (sampled + score, greedy) if sample else (sampled, greedy + score)
    return sampled / len(rows), greedy / len(rows)


def main() -> None:
    """Build the model, train it with SFT, run GRPO with both tools and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="a JSON Lines file of prompt and answer (default: sums made here)")
    p.add_argument("--operands", type=int, default=15, help="the made-up sums' operands are below this (15)")
    p.add_argument("--sft-steps", type=int, default=150, help="SFT steps of 16 problems (150)")
    p.add_argument("--steps", type=int, default=60, help="GRPO optimizer steps (60)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (8)")
    p.add_argument("--generations", type=int, default=8, help="num_generations, G (8)")
    p.add_argument("--completion-length", type=int, default=4, help="max_completion_length (4)")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--quick", action="store_true", help="5 SFT steps, 3 GRPO steps of 2 prompts (a smoke run)")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    if a.quick:
        a.sft_steps, a.steps, a.prompts = 5, 3, 2
    rows = read_rows(a.data) if a.data else sums(a.operands)
    # A fifth held out, and whole steps of prompts for training (the rest held out too): no short last window.
    cut = (len(rows) - max(1, len(rows) // 5)) // a.prompts * a.prompts
    if cut == 0:
        refuse(f"{len(rows)} rows are too few for steps of {a.prompts} prompts and a fifth held out.")
    train_rows, held_out = rows[:cut], rows[cut:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.models.pretrained import quiet_transformers

    quiet_transformers()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(folder / "cache")  # a cold data and plan cache
        base = tiny_model(folder / "base", rows)
        tokenizer = AutoTokenizer.from_pretrained(base)
        train = write_jsonl(folder / "train.jsonl", train_rows)
        results["sft"] = run_sft(base, train_rows, folder, a.sft_steps)
        sft = results["sft"].pop("model")

        def reward_of(model: Any) -> tuple[float, float, float]:
            """The sampled mean reward on the training prompts, and the sampled and greedy ones held out."""
            train_sampled, _ = mean_reward(model, tokenizer, train_rows, a.generations, a.completion_length)
            return (train_sampled, *mean_reward(model, tokenizer, held_out, a.generations, a.completion_length))

        results["before"] = reward_of(AutoModelForCausalLM.from_pretrained(sft))
        ours = run_finetune(sft, train, folder, a)
        ours["after"] = reward_of(AutoModelForCausalLM.from_pretrained(ours.pop("model")))
        theirs = run_trl(sft, train_rows, folder, a)
        theirs["after"] = reward_of(theirs.pop("trained"))
        results |= {"finetune": ours, "trl": theirs}

    sft_seconds = results["sft"]["wall_seconds"]
    print(f"\nData: {a.data or f'sums of two numbers below {a.operands}'}, {len(train_rows)} training prompts, "
          f"{len(held_out)} held out. SFT: {a.sft_steps} steps of {SFT_BATCH} ({sft_seconds:.0f} s). "
          f"GRPO: {a.steps} steps of {a.prompts} prompts × G = {a.generations}, up to {a.completion_length} tokens, "
          f"learning rate {a.learning_rate:g}.")
    before = results["before"]
    print("\n| tool | training prompts, sampled (before → after) | held out, sampled (before → after) "
          "| held out, greedy (before → after) | logged training reward, first 5 steps → last 5 | s/step | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, name in (("finetune", "finetune train task=grpo"), ("trl", "TRL GRPOTrainer")):
        r = results[key]
        first, last = r["rewards"][:5], r["rewards"][-5:]
        print(f"| {name} | " + " | ".join(f"{x:.3f} → {y:.3f}" for x, y in zip(before, r["after"], strict=True))
              + f" | {sum(first) / len(first):.3f} → {sum(last) / len(last):.3f} | {r['seconds_per_step']:.2f} | "
              f"{r['wall_seconds']:.1f} |")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, **results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
