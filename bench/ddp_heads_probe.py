"""Probe of the DDP trap with one head per task (issue #10): two gloo processes, a shared body and two heads, each
process back-propagating one task per micro-batch under `no_sync` except the last, with DDP's default
`find_unused_parameters=False`. Prints the largest difference from the one-process gradient, without and with
every head in every graph (weight zero when unused), which is what `finetune.models.heads.MultiHeadModel` does.

    python bench/ddp_heads_probe.py
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class TwoHeads(nn.Module):
    def __init__(self, zero_trick: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.Linear(8, 3)])
        self.zero_trick = zero_trick

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        out = self.heads[task](torch.tanh(self.body(x)))
        if self.zero_trick:
            out = out + sum(p.sum() for t, h in enumerate(self.heads) if t != task for p in h.parameters()) * 0.0
        return out


# (task, samples) per micro-batch: rank 0 ends on task 0, rank 1 ends on task 1.
PLAN = {0: [(1, 0), (0, 1)], 1: [(0, 2), (1, 3)]}


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(3, 4, generator=g), torch.randint(0, 2, (3,), generator=g)


def reference() -> dict[str, torch.Tensor]:
    model = TwoHeads(False)
    for rank in PLAN:
        for task, i in PLAN[rank]:
            x, y = data(i)
            (nn.functional.cross_entropy(model(x, task), y, reduction="sum") / 2).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def worker(rank: int, zero_trick: bool, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = nn.parallel.DistributedDataParallel(TwoHeads(zero_trick))
    try:
        for k, (task, i) in enumerate(PLAN[rank]):
            last = k == len(PLAN[rank]) - 1
            with contextlib.nullcontext() if last else model.no_sync():  # no_sync covers the forward too
                x, y = data(i)
                nn.functional.cross_entropy(model(x, task), y, reduction="sum").backward()
        if rank == 0:
            out["grads"] = {n.removeprefix("module."): (p.grad.clone() if p.grad is not None else None)
                            for n, p in model.named_parameters()}
    except RuntimeError as e:
        if rank == 0:
            out["error"] = str(e).splitlines()[0]
    dist.destroy_process_group()


def probe(zero_trick: bool, port: int) -> str:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(zero_trick, port, out), nprocs=2)
        result = dict(out)
    if "error" in result:
        return f"error: {result['error']}"
    ref = reference()
    worst = max((ref[n] - (g if g is not None else torch.zeros_like(ref[n]))).abs().max().item()
                for n, g in result["grads"].items())
    return f"largest gradient difference from one process: {worst:.3g}"


if __name__ == "__main__":
    print("heads left out of the graph (default DDP):", probe(False, 29511))
    print("every head in every graph, weight zero:   ", probe(True, 29512))
