"""FSDP: the loop's own window (`share_of`, `backward_window`, `optimizer_step`) on a model sharded by torch's FSDP2
trains like one unsharded process, and a sharded checkpoint resumes exactly.

What really runs: FSDP2 via torch directly (`fully_shard` per decoder layer and at the root, as accelerate's
transformer-layer auto-wrap does), 2 CPU processes over gloo, fp32. accelerate's FSDP path is not exercised on CPU:
`accelerate launch` with an FSDP config does not shard without CUDA (it runs DDP), so accelerate's `Accelerator` is
replaced by a thin adapter over torch.distributed that keeps accelerate's protocol (loss ÷ accumulation steps,
gradient sync only on a window's last micro-batch). The clipping, the full state dict for saving and the checkpoint
calls are accelerate's own FSDP2 code (`_clip_grad_norm_dtensor_aware`, `get_state_dict`) or the torch calls it makes
(`get_model_state_dict`/`get_optimizer_state_dict` with `dcp.save`/`dcp.load`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import assert_same_weights, load_weights

from finetune.data.load import IGNORE_INDEX
from finetune.engine.step import backward_window, optimizer_step, share_of
from finetune.registry import kind

# 9 samples in windows of 4: two full windows, then a tail of 1, smaller than the number of processes (one process
# joins with a weight-0 stand-in). Two epochs: 6 optimizer steps; the checkpoint is taken after step 3.
LENGTHS = [3, 17, 5, 30, 8, 2, 12, 25, 6]
WINDOW, EPOCHS, CHECKPOINT_AFTER = 4, 2, 3
MAX_GRAD_NORM = 0.5  # small enough that every step clips
LEARNING_RATE = {"sgd": 0.5, "adamw": 1e-3}

CAUSAL = kind("causal_lm")
pytestmark = pytest.mark.slow  # two spawned gloo processes and two optimizers' runs: the fast lane leaves it out


class TorchDistributed:
    """accelerate's part of the window protocol over torch.distributed (see the module docstring)."""

    def __init__(self, num_processes: int):
        self.num_processes = num_processes
        self.device = torch.device("cpu")
        self.gradient_accumulation_steps = 1
        self.step = 0
        self.scaler = None

    @contextlib.contextmanager
    def accumulate(self, model):
        # As accelerate does for FSDP2: no gradient reduce-scatter until the window's last micro-batch.
        self.step += 1
        sync = self.step % self.gradient_accumulation_steps == 0
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(sync)
        yield

    def backward(self, loss):
        (loss / self.gradient_accumulation_steps).backward()

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        tensor = tensor.clone()
        if self.num_processes > 1:
            dist.all_reduce(tensor)
        return tensor

    def clip_grad_norm_(self, parameters, max_norm):
        from accelerate import Accelerator

        # accelerate's own FSDP2 clipping (it uses no state of the Accelerator): a norm over every process's shards.
        return Accelerator._clip_grad_norm_dtensor_aware(None, list(parameters), max_norm)


def samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(5, 1000, (n,), generator=g) for n in LENGTHS]


def collate(data: list[torch.Tensor], indices: list[int]) -> dict[str, torch.Tensor]:
    width = max(len(data[i]) for i in indices)
    ids = torch.zeros((len(indices), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, i in enumerate(indices):
        n = len(data[i])
        ids[row, :n], mask[row, :n], labels[row, :n] = data[i], 1, data[i]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def build(model_dir: str, optimizer_name: str, sharded: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    model.train()
    # The optimizer is made after sharding, over the DTensor parameters (as accelerate re-points it for FSDP2).
    lr = LEARNING_RATE[optimizer_name]
    optimizer = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer_name == "sgd"
                 else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=False))
    return model, optimizer


def train_steps(model, optimizer, d: TorchDistributed, micro_batch_size: int, rank: int, steps: range,
                on_step=None) -> list[tuple[float, float]]:
    """Optimizer steps `steps` (0-based) of the run, as train.py computes each window; (loss, grad norm) each."""
    data = samples()
    windows = [list(range(s, min(s + WINDOW, len(data)))) for s in range(0, len(data), WINDOW)] * EPOCHS
    params = [p for p in model.parameters() if p.requires_grad]
    logged = []
    for step in steps:
        window = windows[step]
        micro, weight = share_of(window, LENGTHS, micro_batch_size, rank, d.num_processes)
        local = sum(LENGTHS[i] - 1 for mb in micro for i in mb) if weight else 0
        count = int(d.reduce(torch.tensor(local), "sum").item())
        loss_sum = backward_window(model, micro, lambda mb: collate(data, mb), count, d, kind=CAUSAL, weight=weight)
        grad_norm, skipped = optimizer_step(params, optimizer, None, d, MAX_GRAD_NORM)
        assert not skipped
        logged.append(((d.reduce(loss_sum, "sum") / count).item(), float(grad_norm)))
        if on_step:
            on_step(step + 1)
    return logged


def full_state(model, sharded: bool) -> dict[str, torch.Tensor]:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    if not sharded:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    # accelerate's own FSDP2 branch of get_state_dict: the full state dict, on rank 0, gathered by every process.
    fsdp2 = SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True)
    return Accelerator.get_state_dict(fsdp2, model)


def run(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """One process of the sharded run (world 2) or the single unsharded one (world 1): both optimizers, the full
    run with a checkpoint after step 3, then a fresh model resumed from that checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from transformers import AutoTokenizer

    from finetune.engine.runtime import is_sharded
    from finetune.models.pretrained import save_model

    torch.set_num_threads(1)
    sharded = world > 1
    if sharded:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    d = TorchDistributed(world)
    micro_batch_size = 1 if sharded else 2  # 2 micro-batches per window either way, but split differently
    steps = len(range(0, len(LENGTHS), WINDOW)) * EPOCHS
    result = {}
    for name in ("sgd", "adamw"):
        ckpt = Path(out) / f"ckpt-{name}"
        model, optimizer = build(model_dir, name, sharded)
        assert is_sharded(model) == sharded

        def save(step, model=model, optimizer=optimizer, ckpt=ckpt):
            if step == CHECKPOINT_AFTER:
                if sharded:  # what accelerate's save_state writes for FSDP2 with SHARDED_STATE_DICT
                    msd, osd = get_state_dict(model, optimizer)
                    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(ckpt))
                else:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, ckpt)

        logged = train_steps(model, optimizer, d, micro_batch_size, rank, range(steps), on_step=save)
        final = full_state(model, sharded)
        if name == "sgd" and rank == 0:  # the final model as the run saves it
            save_model(model, AutoTokenizer.from_pretrained(model_dir), Path(out) / name,
                       state_dict=final if sharded else None)
        model, optimizer = build(model_dir, name, sharded)
        if sharded:
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optimizer": osd}
            dcp.load(state, checkpoint_id=str(ckpt))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        else:
            state = torch.load(ckpt)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        resumed = train_steps(model, optimizer, d, micro_batch_size, rank, range(CHECKPOINT_AFTER, steps))
        result[name] = {"logged": logged, "final": final, "resumed_logged": resumed,
                        "resumed_final": full_state(model, sharded)}
    if rank == 0:
        torch.save(result, Path(out) / "result.pt")
    if sharded:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    """The sharded run (2 processes, FSDP2, gloo) and the unsharded one, each with SGD and AdamW."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(run, args=(2, _free_port(), tiny_llama, str(two)), nprocs=2, join=True)
    run(0, 1, 0, tiny_llama, str(one))
    return torch.load(one / "result.pt"), torch.load(two / "result.pt"), one, two


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fsdp2_window_equals_one_process(runs, optimizer):
    """FSDP2 via torch directly, 2 CPU processes over gloo (accelerate's FSDP path not exercised on CPU): the same
    losses, clipped gradient norms and final weights as one unsharded process, over 6 optimizer steps with
    clipping on every step and a tail window of one sample."""
    one, two = runs[0][optimizer], runs[1][optimizer]
    (one_loss, one_norm), (two_loss, two_norm) = (torch.tensor(r["logged"], dtype=torch.float64).T for r in (one, two))
    torch.testing.assert_close(two_loss, one_loss, rtol=1e-5, atol=1e-6)
    # The norm of ~10⁶ float32 gradient entries, summed in another order (per shard, then over processes).
    torch.testing.assert_close(two_norm, one_norm, rtol=5e-5, atol=1e-6)
    assert all(norm > MAX_GRAD_NORM for _, norm in one["logged"])  # every step really clipped
    assert_same_weights(two["final"], one["final"], atol=1e-5)


def test_fsdp2_sharded_checkpoint_resumes_exactly(runs):
    """FSDP2 via torch directly, 2 CPU processes over gloo: model and optimizer state saved sharded with
    `dcp.save` after step 3 and loaded into a fresh sharded model continue to the uninterrupted run's weights."""
    for optimizer in ("sgd", "adamw"):
        two = runs[1][optimizer]
        assert two["resumed_logged"] == two["logged"][CHECKPOINT_AFTER:]
        assert_same_weights(two["resumed_final"], two["final"], rtol=0, atol=0)


def test_fsdp2_final_model_saves_gathered(runs):
    """The full state dict gathered from the shards (accelerate's FSDP2 `get_state_dict`) saves through
    `save_model` to the same `from_pretrained` weights as the unsharded model."""
    one_dir, two_dir = runs[2], runs[3]
    assert_same_weights(load_weights(two_dir / "sgd"), load_weights(one_dir / "sgd"), atol=1e-5)
