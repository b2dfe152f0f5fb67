"""Benchmark: a long-range recall task trained four ways, side by side — truncation, chunks, segment recurrence and
full backprop over the whole document.

Each document is `--length` words over a tiny word-level vocabulary: a key (one of 16 key words) first, then filler
words, and every `--every` words the marker `recall` followed by the key again. Most recalls can copy the previous
answer from a few dozen tokens back (*near* recalls: they teach the copying); the first recall of each block of
`max_length` tokens can only be answered from an earlier block (*far* recalls). A tiny Llama (trained from scratch,
the same seed and initial weights for every mode) is trained with `finetune.train.loop` as (a) truncation at
`max_length` (everything past it is lost), (b) chunks of `max_length` (every token is trained, but a chunk cannot
see an earlier one), (c) `segment_recurrence` with `max_length` segments and a memory covering the document, and
(d) full backprop over the whole document (`max_length` = the document).

Printed per mode: the far and near recall loss and accuracy on held-out documents (the token after each `recall`
marker; chance is ln 16 = 2.77 and 1/16), the loss over all tokens (the filler is a cycle, learnt in a few dozen
steps), each read the way the mode trains (a and b: blocks of `max_length` with no memory, c: segments with memory,
d: whole documents), the peak of live tensors of one training window (weights, AdamW state, the window's forward
and backward: the live-tensor tracker of finetune/plan/memory.py), the plan's predicted peak, and the training time
(noisy on a shared machine).

    python bench/long_range.py --jobs 4   # the defaults, the four modes at once
    python bench/long_range.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from finetune.config.schema import from_dict
from finetune.data.load import collate, load_data
from finetune.engine.recurrence import Recurrence
from finetune.engine.recurrence import backward_window as recurrent_backward_window
from finetune.engine.step import backward_window
from finetune.models.pretrained import load_tokenizer
from finetune.plan.memory import LiveTensorTracker, tensor_bytes
from finetune.registry import kind
from finetune.train.loop import train

KEYS = [f"key{i}" for i in range(16)]
FILLER = [f"w{i}" for i in range(48)]
MARKER = "recall"


def make_tokenizer(folder: Path) -> None:
    """A word-level tokenizer: one token per word, so a document's length in tokens is its length in words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[EOS]", "[UNK]", MARKER, *KEYS, *FILLER])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                            unk_token="[UNK]").save_pretrained(folder)


def make_model(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=3 + 1 + len(KEYS) + len(FILLER), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=1)
                     ).save_pretrained(folder)
    make_tokenizer(folder)


def document(rng: random.Random, length: int, every: int) -> list[str]:
    # The filler cycles through the filler words from a random start: quickly learnt, so that once it is, the
    # training signal is the recalls' (with random filler they are 3 targets in 1,000 of noise).
    key, offset = rng.choice(KEYS), rng.randrange(len(FILLER))
    words = [key] + [FILLER[(offset + i) % len(FILLER)] for i in range(length - 1)]
    for at in range(every, length - 1, every):
        words[at], words[at + 1] = MARKER, key
    return words


def write_csv(path: Path, docs: list[list[str]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text"])
        w.writerows([" ".join(d)] for d in docs)


def chunked(docs: list[list[str]], size: int) -> list[list[str]]:
    """Documents cut into consecutive blocks of `size` tokens (with the end-of-sequence token each block gets)."""
    return [d[s: s + size - 1] for d in docs for s in range(0, len(d), size - 1)]


def evaluate(model: torch.nn.Module, ids: torch.Tensor, mode: str, segment: int) -> dict[str, float]:
    """Recall loss/accuracy and all-token loss of held-out documents, read the way `mode` trains."""
    model.eval()
    marker = 3
    losses, hits, total, count = {"near": [], "far": []}, {"near": 0, "far": 0}, 0.0, 0
    with torch.no_grad():
        for row in ids.split(8):
            if mode == "recurrence":
                recurrence = Recurrence(segment, row.size(1))
                cache, parts = recurrence.new_cache(model), []
                for start, end in recurrence.segments(row.size(1)):
                    parts.append(model(input_ids=row[:, start:end], cache=cache, use_cache=True).logits)
                logits = torch.cat(parts, 1)
            elif mode == "full":
                logits = model(input_ids=row).logits
            else:  # no memory: each block of `segment` tokens on its own
                logits = torch.cat([model(input_ids=row[:, s: s + segment]).logits
                                    for s in range(0, row.size(1), segment)], 1)
            logp = F.log_softmax(logits[:, :-1].float(), -1)
            target = row[:, 1:]
            nll = -logp.gather(-1, target[..., None])[..., 0]
            total, count = total + nll.sum().item(), count + nll.numel()
            at, far = row[:, :-1] == marker, far_recalls(row, segment)[:, :-1]
            for name, mask in (("near", at & ~far), ("far", far)):
                losses[name].append(nll[mask])
                hits[name] += int((logp.argmax(-1)[mask] == target[mask]).sum())
    out = {"loss": total / count}
    for name in ("near", "far"):
        found = torch.cat(losses[name])
        out[f"{name}_recall_loss"] = found.mean().item()
        out[f"{name}_recall_accuracy"] = hits[name] / max(len(found), 1)
    return out


def far_recalls(ids: torch.Tensor, segment: int) -> torch.Tensor:
    """Recall markers whose latest earlier key occurrence lies in an earlier block of `segment` tokens: only a model
    that carries context across the boundary can answer them."""
    is_key = (ids >= 4) & (ids < 4 + len(KEYS))
    positions = torch.arange(ids.size(1)).expand_as(ids)
    last_key = torch.cummax(torch.where(is_key, positions, torch.zeros_like(positions)), dim=1).values
    return (ids == 3) & (last_key // segment != positions // segment)


def window_peak(model: torch.nn.Module, data, mode: str, segment: int, micro: int, lr: float) -> int:
    """Live-tensor peak of one training window (the loop's own functions), weights and AdamW state included."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=False)
    window = list(np.argsort(-data.lengths)[:micro])
    count = data.num_targets(window, kind("causal_lm"))

    class One:
        num_processes, device, gradient_accumulation_steps, step, scaler = 1, torch.device("cpu"), 1, 0, None

        def accumulate(self, model):
            import contextlib

            return contextlib.nullcontext()

        def backward(self, loss):
            (loss / self.gradient_accumulation_steps).backward()

    def collate_fn(mb):
        return collate(data, mb, 0, kind("causal_lm"))

    def run() -> None:
        if mode == "recurrence":
            recurrent_backward_window(model, [window], collate_fn, count, One(), Recurrence(segment, 1 << 20),
                                      data.lengths)
        else:
            backward_window(model, [window], collate_fn, count, One(), kind=kind("causal_lm"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    run()
    static = tensor_bytes(list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values()])
    with LiveTensorTracker() as tracker:
        run()
    return static + tracker.peak


def run_mode(name: str, values: dict, work: Path, eval_ids: torch.Tensor, segment: int, batch: int, lr: float,
             threads: int) -> dict:
    """Train one mode with `finetune.train.loop`, then measure it (runs in its own process with --jobs)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    cfg = from_dict({**values, "output_dir": str(work / name)})
    start = time.perf_counter()
    result = train(cfg)
    seconds = time.perf_counter() - start
    model = AutoModelForCausalLM.from_pretrained(work / name / "model")
    metrics = evaluate(model, eval_ids, name if name in ("recurrence", "full") else "blocks", segment)
    peak = window_peak(model, load_data(cfg, load_tokenizer(cfg))[0], name, segment, batch, lr)
    plan = json.loads((work / name / "plan.json").read_text())
    row = {"mode": name, **metrics, "peak_mib": peak / 2**20, "plan_mib": plan["predicted_peak_bytes"] / 2**20,
           "seconds": seconds, "steps": result.step}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024, help="words (= tokens) per document")
    parser.add_argument("--segment", type=int, default=256, help="max_length: segment, chunk and truncation length")
    parser.add_argument("--every", type=int, default=50, help="a recall every this many words")
    parser.add_argument("--docs", type=int, default=256, help="training documents")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per mode")
    parser.add_argument("--batch", type=int, default=16, help="effective batch (documents, or chunks for b)")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--jobs", type=int, default=1, help="modes trained at once, each in its own process")
    parser.add_argument("--quick", action="store_true", help="a smoke run: short documents, few steps")
    parser.add_argument("--modes", default="truncate,chunk,recurrence,full")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.quick:
        args.length, args.segment, args.every, args.docs, args.steps = 512, 128, 40, 32, 10
    work = Path(tempfile.mkdtemp(prefix="long_range_"))
    make_model(work / "model")
    rng = random.Random(0)
    train_docs = [document(rng, args.length - 2, args.every) for _ in range(args.docs)]
    eval_docs = [document(rng, args.length - 2, args.every) for _ in range(32)]
    write_csv(work / "train.csv", train_docs)
    write_csv(work / "chunks.csv", chunked(train_docs, args.segment))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(work / "model")
    eval_ids = torch.tensor([tok(" ".join(d))["input_ids"] for d in eval_docs])
    common = {"model": str(work / "model"), "task": "causal_lm", "optimizer": "adamw", "learning_rate": args.lr,
              "warmup_ratio": 0.05, "weight_decay": 0.0, "eval_fraction": 0.0, "precision": "fp32",
              "max_steps": args.steps, "effective_batch_size": args.batch, "micro_batch_size": args.batch,
              "seed": 0, "logging_every": 10, "plan_probe": "false"}
    modes = {
        "truncate": {"dataset": str(work / "train.csv"), "max_length": args.segment},
        "chunk": {"dataset": str(work / "chunks.csv"), "max_length": args.segment},
        "recurrence": {"dataset": str(work / "train.csv"), "max_length": args.segment, "segment_recurrence": True,
                       "memory_length": args.length},
        "full": {"dataset": str(work / "train.csv"), "max_length": args.length},
    }
    names = args.modes.split(",")
    jobs = [(n, {**common, **modes[n]}, work, eval_ids, args.segment, args.batch, args.lr,
             max(1, 2 // args.jobs)) for n in names]
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            rows = pool.starmap(run_mode, jobs)
    else:
        rows = [run_mode(*job) for job in jobs]
    print(f"\n{args.length}-token documents, max_length {args.segment}, a recall every {args.every} tokens, "
          f"{args.steps} steps of {args.batch}; chance recall loss ln 16 = {math.log(16):.2f}\n")
    print("| mode | far recall loss | far recall accuracy | near recall loss | near recall accuracy | all-token loss "
          "| peak live memory (MiB) | plan (MiB) | time (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['far_recall_loss']:.3f} | {r['far_recall_accuracy']:.2f} | "
              f"{r['near_recall_loss']:.3f} | {r['near_recall_accuracy']:.2f} | {r['loss']:.3f} | "
              f"{r['peak_mib']:.1f} | {r['plan_mib']:.1f} | {r['seconds']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
