"""Peak live memory of a multi-task window: one task's graph at a time (what finetune does) vs summing the tasks'
losses before one backward (the naive way), side by side, with each task's graph alone for comparison.

Three classification tasks on one shared encoder (finetune.models.heads.MultiHeadModel), one micro-batch each of
different lengths. Counted with finetune.plan.memory.LiveTensorTracker: the bytes of every tensor torch creates while it
runs (activations, gradients, temporaries), not the weights, which exist before. CPU, fp32.

    python bench/multitask_memory.py [--model bundled:all-MiniLM-L6-v2] [--batch 16]
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.nn.functional as F

from finetune.config.schema import from_dict
from finetune.models.heads import build_multihead
from finetune.models.pretrained import load_model
from finetune.plan.memory import LiveTensorTracker
from finetune.registry import kind

TASKS = {"sentiment": (2, 128), "topic": (4, 96), "nli": (3, 64)}  # name: (labels, tokens per sample)


def batch(model: torch.nn.Module, size: int, tokens: int, labels: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, model.config.vocab_size, (size, tokens), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(0, labels, (size,), generator=g)}


def loss_of(model: torch.nn.Module, task: str, b: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(task=task, input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return F.cross_entropy(logits, b["labels"], reduction="sum") / len(b["labels"])


def peak(model: torch.nn.Module, batches: dict[str, dict], how: str) -> int:
    """Peak live bytes of one window's forward and backward: `one-at-a-time`, `summed` or a single task's name."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    with LiveTensorTracker() as tracker:
        if how == "one-at-a-time":
            for task, b in batches.items():
                loss_of(model, task, b).backward()
        elif how == "summed":
            sum(loss_of(model, task, b) for task, b in batches.items()).backward()
        else:
            loss_of(model, how, batches[how]).backward()
    return tracker.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled:all-MiniLM-L6-v2")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    c = from_dict({"model": args.model})
    first = load_model(c, ["a", "b"])
    heads = {name: kind("classification").model_kwargs([str(i) for i in range(n)]) for name, (n, _) in TASKS.items()}
    model = build_multihead(first, heads)
    model.train()
    batches = {name: batch(model, args.batch, tokens, n, i) for i, (name, (n, tokens)) in enumerate(TASKS.items())}
    mib = 2 ** 20
    print(f"{args.model}, micro-batch {args.batch}, fp32, CPU; peak live MiB above the weights")
    singles = {name: peak(model, batches, name) for name in TASKS}
    for name, value in singles.items():
        print(f"  {name} alone ({TASKS[name][1]} tokens): {value / mib:8.1f}")
    one = peak(model, batches, "one-at-a-time")
    summed = peak(model, batches, "summed")
    largest = max(singles.values())
    print(f"  one graph at a time (finetune):  {one / mib:8.1f}   (largest single task {largest / mib:.1f})")
    print(f"  losses summed, one backward:     {summed / mib:8.1f}   (sum of the single tasks "
          f"{sum(singles.values()) / mib:.1f})")


if __name__ == "__main__":
    main()
