"""Benchmark: training throughput and padding with and without `packing`, side by side in one run.

The data is an instruction-set shape: prompt/completion pairs whose prompt and completion lengths (in words) are
drawn from log-normal distributions (long-tailed: most pairs are short, a few are long), cut to `max_length`
tokens by the encoding. The model is a tiny Llama (2 layers, hidden 64, the bundled tokenizer's 30,522-token
vocabulary) built from a config, trained on the CPU in fp32 for one epoch, each configuration in a fresh
`python -m finetune train` child process:

- `unpacked, random batches`: `group_by_length=false`, windows of `--batch` samples;
- `unpacked, length-grouped`: finetune's default (`group_by_length=true`), windows of `--batch` samples;
- `packed`: `packing=true`, windows of `--rows` rows of `max_length` (about as many tokens per step as `--batch`
  samples).

Each window is one micro-batch (no accumulation), so padding costs compute directly. *tokens/s* is real (non-pad)
training tokens per second of the run's training loop (`metrics.json`'s train_seconds); *padding* is the share of
the token slots of all micro-batches that are padding, from the same windows and micro-batches the loop trains on.

    python bench/packing.py                      # 300 pairs, max_length 512 (a few minutes on 2 CPU cores)
    python bench/packing.py --samples 100        # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

REPO_ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the a model data train token window batch loss step learn answer question explain write list short long "
         "code python function value error result first second because which where when how why what").split()


def make_data(path: Path, samples: int, seed: int) -> None:
    """Prompt/completion pairs with long-tailed word counts (log-normal: median ~25-word prompts, ~60-word
    completions, a tail to several hundred)."""
    rng = np.random.default_rng(seed)
    prompt_words = np.clip(rng.lognormal(np.log(25), 0.9, samples).astype(int), 3, 2000)
    completion_words = np.clip(rng.lognormal(np.log(60), 1.0, samples).astype(int), 1, 2000)
    with path.open("w") as f:
        for p, c in zip(prompt_words, completion_words, strict=True):
            f.write(json.dumps({"prompt": " ".join(rng.choice(WORDS, p)),
                                "completion": " ".join(rng.choice(WORDS, c))}) + "\n")


def make_model(path: Path) -> None:
    """A 2-layer Llama with the bundled tokenizer ([SEP] as end of sequence)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from finetune.models.pretrained import resolve_model_path

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(resolve_model_path("bundled:all-MiniLM-L6-v2"))
    tok.eos_token = "[SEP]"
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.cls_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def sample_lengths(values: dict[str, object]) -> str:
    """The tokenised samples' lengths, as a line."""
    from transformers import AutoTokenizer

    from finetune.config.schema import from_dict
    from finetune.data.load import load_data

    c = from_dict({**values, "packing": False})
    lengths = load_data(c, AutoTokenizer.from_pretrained(c.model))[0].lengths
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99]).astype(int)
    return (f"sample lengths in tokens: median {p50}, mean {lengths.mean():.0f}, 90th percentile {p90}, 99th {p99}, "
            f"max {lengths.max()} (cut at {c.max_length}: {int((lengths == c.max_length).sum())} samples)")


def padding(values: dict[str, object]) -> tuple[float, int, int]:
    """(padding share of the micro-batches' token slots, rows, samples) for one epoch of this configuration."""
    from transformers import AutoTokenizer

    from finetune.config.schema import from_dict
    from finetune.data.load import load_data
    from finetune.engine.step import share_of

    c = from_dict(values)
    data = load_data(c, AutoTokenizer.from_pretrained(c.model))[0]
    slots = real = 0
    for window in data.windows(c.effective_batch_size, seed=c.seed, epoch=0, shuffle=c.shuffle,
                               group_by_length=c.group_by_length):
        for mb in share_of(window, data.lengths, c.micro_batch_size, 0, 1)[0]:
            slots += len(mb) * int(data.lengths[mb].max())
            real += int(data.lengths[mb].sum())
    samples = pc.sum(pc.list_value_length(data.rows.with_format("arrow")["segment_lengths"])).as_py() \
        if c.packing else len(data)
    return 1 - real / slots, len(data), samples


def run(values: dict[str, object], out: Path, env: dict[str, str]) -> dict[str, float]:
    """Train in a child process; returns its metrics and the real tokens it trained on."""
    args = [sys.executable, "-m", "finetune", "train", *(f"{k}={v}" for k, v in values.items()),
            f"output_dir={out}"]
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    metrics = json.loads((out / "metrics.json").read_text())
    steps = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    tokens = [e["tokens"] for e in steps if e["event"] == "step"][-1]
    return {**metrics, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="samples per window, unpacked")
    parser.add_argument("--rows", type=int, default=4, help="rows per window, packed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        env = {**os.environ, "HF_DATASETS_CACHE": str(tmp / "datasets"), "XDG_CACHE_HOME": str(tmp / "cache"),
               "PYTHONPATH": str(REPO_ROOT)}
        os.environ.update({k: env[k] for k in ("HF_DATASETS_CACHE", "XDG_CACHE_HOME")})
        make_data(tmp / "pairs.jsonl", args.samples, args.seed)
        make_model(tmp / "model")
        base = {"model": tmp / "model", "dataset": tmp / "pairs.jsonl", "task": "causal_lm",
                "max_length": args.max_length, "eval_fraction": 0, "epochs": 1, "precision": "fp32",
                "logging_every": 1, "seed": args.seed}
        configs = {
            "unpacked, random batches": {"group_by_length": False, "effective_batch_size": args.batch,
                                         "micro_batch_size": args.batch},
            "unpacked, length-grouped": {"group_by_length": True, "effective_batch_size": args.batch,
                                         "micro_batch_size": args.batch},
            "packed": {"packing": True, "effective_batch_size": args.rows, "micro_batch_size": args.rows},
        }
        print(f"{args.samples} prompt/completion pairs, max_length {args.max_length}, tiny Llama on "
              f"{len(os.sched_getaffinity(0))} CPU core(s), fp32, one epoch; {sample_lengths(base)}\n")
        print("| configuration | rows (samples) | optimizer steps | padding | real tokens | train s | tokens/s |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, extra in configs.items():
            values = {**base, **extra}
            pad, rows, samples = padding(values)
            m = run(values, tmp / name.replace(" ", "_").replace(",", ""), env)
            print(f"| {name} | {rows} ({samples}) | {m['steps']} | {pad:.1%} | {m['tokens']:,} | "
                  f"{m['train_seconds']:.1f} | {m['tokens'] / m['train_seconds']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
