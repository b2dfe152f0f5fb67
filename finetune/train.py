"""The training loop: exact gradient accumulation on accelerate (the contract is shared/design/accumulation.md).

One optimizer step trains on one *window* of samples. Each process takes its share of the window, computes the
*sum* of per-sample (or per-target-token) losses micro-batch by micro-batch, and scales it by the number of targets
in the whole window over all processes, counted before the window starts. So a window of k micro-batches of B gives
the gradient of one batch of k·B, a short last window is normalised by its real size, and padding or masked prompt
tokens never shift the weights of the others.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune import data as D
from finetune import rundir
from finetune.config import BatchPlan, Config, ConfigError, resolve_batch
from finetune.evaluate import evaluate, loss_sum
from finetune.events import Backoff, Checkpoint, Done, Eval, Event, EventLog, Start, Step, Stopped
from finetune.modeling import load_model, load_tokenizer, save_model
from finetune.planner import make_plan, prepare_for_training, probe_enabled, refine_with_probe, resolve_precision

MAX_SKIPPED_IN_A_ROW = 25


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what to change."""


class StopFlag:
    """Cooperative cancellation, checked once per optimizer step (set from a signal handler or the GUI)."""

    def __init__(self) -> None:
        self.requested = False

    def request(self) -> None:
        """Ask the loop to stop after the current optimizer step."""
        self.requested = True


@dataclass
class Progress:
    """Where the run is; saved in every checkpoint so that a resumed run continues with the very next window."""

    step: int = 0
    epoch: int = 0
    window: int = 0  # next window of `epoch`
    samples: int = 0
    tokens: int = 0
    skipped: int = 0
    skipped_in_a_row: int = 0

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class RunResult:
    """How a run ended: `status` is done or stopped."""

    status: str
    run_dir: Path
    step: int
    metrics: dict[str, float]
    is_main_process: bool = True


@dataclass
class Setup:
    """Everything the loop needs, built by `setup()`."""

    config: Config
    accelerator: Any
    batch: BatchPlan
    run_dir: Path
    tokenizer: Any
    train_data: D.Encoded
    eval_data: D.Encoded | None
    label_names: list[str] | None
    model: Any
    optimizer: Any
    scheduler: Any
    total_steps: int
    steps_per_epoch: int
    progress: Progress
    log: EventLog

    @property
    def causal(self) -> bool:
        return self.config.task == "causal_lm"


def train(c: Config, *, stop: StopFlag | None = None, callbacks: list[Callable[[Event], None]] | None = None
          ) -> RunResult:
    """Fine-tune as `c` says; returns when done or stopped. Raises ConfigError/DataError/ModelError/RunDirError
    for bad input (before any weight is loaded where possible) and TrainingError when training cannot go on."""
    s = setup(c, callbacks or [])
    c, acc, model, opt, sched, p = s.config, s.accelerator, s.model, s.optimizer, s.scheduler, s.progress
    stop = stop or StopFlag()
    lengths = s.train_data.lengths
    params = [q for q in model.parameters() if q.requires_grad]
    clip = c.max_grad_norm if c.max_grad_norm > 0 else math.inf  # inf: measure the norm, never clip
    s.log.emit(Start(s.total_steps, s.steps_per_epoch, len(s.train_data), len(s.eval_data or []),
                     s.batch.micro_batch_size, s.batch.grad_accum_steps, s.batch.num_processes,
                     s.batch.effective_batch_size, _precision(acc), str(acc.device), str(s.run_dir), p.step, c.resume))
    model.train()
    clock, clock_samples = time.perf_counter(), p.samples
    train_start = clock
    while p.step < s.total_steps:
        windows = D.epoch_windows(lengths, s.batch.effective_batch_size, seed=c.seed, epoch=p.epoch,
                                  shuffle=c.shuffle, group_by_length=c.group_by_length)
        for w in range(p.window, len(windows)):
            window = windows[w]
            while True:
                try:
                    window_loss_sum, count = _backward_window(s, window)
                    break
                except torch.OutOfMemoryError:
                    _back_off(s)  # the same window again with half the micro-batch: same gradient, less memory
            # Once per window, on the summed gradient (sync step): clip_grad_norm_ unscales fp16 gradients first.
            grad_norm = acc.clip_grad_norm_(params, clip)
            lr = sched.get_last_lr()[0]
            scaler_before = acc.scaler.get_scale() if acc.scaler is not None else None
            opt.step()
            # An fp16 overflow makes the scaler back off. (accelerate's optimizer_step_was_skipped misses it with
            # fused optimizers, which the scaler always calls and which skip the update inside the kernel.)
            skipped = scaler_before is not None and acc.scaler.get_scale() < scaler_before
            if not skipped:
                sched.step()
            opt.zero_grad(set_to_none=True)
            window_loss = (acc.reduce(window_loss_sum, "sum") / max(count, 1)).item()
            p.step += 1
            p.samples += len(window)
            p.tokens += sum(lengths[i] for i in window)
            p.skipped += int(skipped)
            p.skipped_in_a_row = p.skipped_in_a_row + 1 if skipped else 0
            p.window = w + 1
            epoch_done = p.epoch + p.window / len(windows)
            if p.window == len(windows):
                p.epoch, p.window = p.epoch + 1, 0
            if p.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                raise TrainingError(f"fp16 overflowed on {p.skipped_in_a_row} optimizer steps in a row (loss "
                                    f"{window_loss:.4g}): training diverged. Lower learning_rate, or use "
                                    "precision=bf16 or fp32.")
            if p.step % c.logging_every == 0 or p.step == s.total_steps:
                now = time.perf_counter()
                rate = (p.samples - clock_samples) / max(now - clock, 1e-9)
                clock, clock_samples = now, p.samples
                s.log.emit(Step(p.step, round(epoch_done, 4), window_loss, float(grad_norm), lr, p.samples,
                                p.tokens, p.skipped, round(rate, 2)))
            if c.eval_every and p.step % c.eval_every == 0 and p.step < s.total_steps:
                _evaluate(s, epoch_done)
            if c.save_every and p.step % c.save_every == 0 and p.step < s.total_steps:
                _save_checkpoint(s)
            if _stop_requested(stop, acc) and p.step < s.total_steps:
                path = _save_checkpoint(s)
                s.log.emit(Stopped(p.step, str(path)))
                return RunResult("stopped", s.run_dir, p.step, {}, acc.is_main_process)
            if p.step >= s.total_steps:
                break
    return _finish(s, time.perf_counter() - train_start)


def _backward_window(s: Setup, window: list[int]) -> tuple[torch.Tensor, int]:
    """Accumulate one window's gradient; returns this process's loss sum and the window's global target count."""
    acc, lengths = s.accelerator, s.train_data.lengths
    micro = D.micro_batches(window, lengths, s.batch.micro_batch_size, acc.process_index, acc.num_processes)
    # Count the window's targets over all processes *before* its first backward: every micro-batch's loss sum is
    # divided by this one number, which is what makes k·B and (B, k) identical.
    count = _global_count(s, [i for mb in micro for i in mb])
    weight = 1.0
    if not micro:  # a tail window smaller than the number of processes: join the all-reduce with 0 weight
        micro, weight = [window[:1]], 0.0
    # accelerator.backward divides by gradient_accumulation_steps and DDP averages over processes: undo both, so
    # the gradient is exactly sum(losses) / count. Setting the steps per window is what flushes (and correctly
    # normalises) a short last window.
    acc.gradient_accumulation_steps = len(micro)
    acc.step = 0
    scale = weight * len(micro) * acc.num_processes / max(count, 1)
    loss_total = torch.zeros((), dtype=torch.float64, device=acc.device)
    for mb in micro:
        with acc.accumulate(s.model):
            batch = {k: v.to(acc.device) for k, v in D.collate(s.train_data, mb, s.tokenizer.pad_token_id,
                                                              s.causal).items()}
            loss, _ = loss_sum(s.model, batch, s.causal)
            acc.backward(loss * scale)
            loss_total += loss.detach().double() * weight
    return loss_total, count


def _back_off(s: Setup) -> None:
    """After an out-of-memory error: drop the partial gradient and halve the micro-batch (doubling accumulation)."""
    import gc

    s.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    b = s.batch
    if s.accelerator.num_processes > 1:
        # Another process may already wait in the gradient all-reduce; they cannot re-split together.
        raise TrainingError(f"Out of memory at micro_batch_size={b.micro_batch_size} with several processes: set a "
                            "smaller micro_batch_size or memory_budget_gb and restart (resume=true keeps progress).")
    per_process = b.micro_batch_size * b.grad_accum_steps
    smaller = next((d for d in range(b.micro_batch_size // 2, 0, -1) if per_process % d == 0), None)
    if smaller is None:
        raise TrainingError("Out of memory even at micro_batch_size=1: lower max_length, set lora=true or "
                            "gradient_checkpointing=true, or use a smaller model or a larger device.")
    s.batch = BatchPlan(smaller, per_process // smaller, b.num_processes, b.effective_batch_size)
    s.log.emit(Backoff(s.progress.step + 1, s.batch.micro_batch_size, s.batch.grad_accum_steps,
                       f"out of memory at micro_batch_size={b.micro_batch_size}; retrying the step with "
                       f"{s.batch.micro_batch_size} × {s.batch.grad_accum_steps} (same effective batch and result)"))


def setup(c: Config, callbacks: list[Callable[[Event], None]]) -> Setup:
    """Accelerator, run directory, data, model, optimizer and schedule, in fail-fast order."""
    from accelerate.utils import broadcast_object_list, set_seed

    acc = make_accelerator(resolve_precision(c.precision))
    if c.output_dir is None:  # every process must agree on the same timestamped directory
        c = c.replace(output_dir=broadcast_object_list([rundir.default_output_dir()])[0])
    resolve_batch(c, acc.num_processes)  # refuse impossible batch arithmetic before anything is loaded
    run_dir = rundir.check_run_dir(c)
    if c.resume:
        c = rundir.resumed_config(c, run_dir)
    tokenizer = load_tokenizer(c)
    train_data, eval_data, label_names = load_data(c, tokenizer)
    # The plan needs the data (the worst-case length) but no weights: it runs on the meta device.
    plan = make_plan(c, train_data.lengths, len(label_names or []), num_processes=acc.num_processes)
    c = plan.apply(c)
    batch = resolve_batch(c, acc.num_processes)
    steps_per_epoch = D.windows_per_epoch(len(train_data), batch.effective_batch_size)
    total_steps = c.max_steps or max(1, math.ceil(steps_per_epoch * c.epochs))

    set_seed(c.seed)
    model = prepare_for_training(load_model(c, label_names), c, checkpointing=plan.gradient_checkpointing,
                                 lora=plan.lora)
    if probe_enabled(c):
        model.to(acc.device)
        plan = refine_with_probe(plan, model, c)
        c = plan.apply(c)
        batch = resolve_batch(c, acc.num_processes)
    optimizer = make_optimizer(c, model)
    scheduler = make_scheduler(c, optimizer, total_steps)
    # The scheduler stays out of prepare(): a prepared scheduler steps once per process per optimizer step.
    model, optimizer = acc.prepare(model, optimizer)
    progress = Progress()

    log = EventLog(run_dir / "events.jsonl" if acc.is_main_process else None,
                   callbacks if acc.is_main_process else [])
    if c.resume:
        if acc.is_main_process:
            rundir.remove_partial_checkpoints(run_dir)
        _load_checkpoint(acc, rundir.checkpoints(run_dir)[-1], scheduler, progress)
    elif acc.is_main_process:
        rundir.clear_run_dir(run_dir) if c.overwrite else None
        rundir.mark_run_dir(run_dir)
        # The saved config describes the run, not this invocation: `finetune train config.yaml resume=true`
        # continues it and a plain `finetune train config.yaml` refuses to overwrite it.
        (run_dir / "config.yaml").write_text(c.replace(overwrite=False, resume=False).to_yaml(), encoding="utf-8")
        rundir.write_json(run_dir / "plan.json", plan.to_dict())
    acc.wait_for_everyone()
    return Setup(c, acc, batch, run_dir, tokenizer, train_data, eval_data, label_names, model, optimizer, scheduler,
                 total_steps, steps_per_epoch, progress, log)


def make_accelerator(precision: str) -> Any:
    """The accelerate `Accelerator` for a resolved precision (fp32, fp16 or bf16)."""
    from accelerate import Accelerator

    # Under a launcher (WORLD_SIZE > 1) without CUDA, accelerate only forms a gloo process group when asked for the
    # CPU explicitly; otherwise every process would train alone.
    cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(mixed_precision={"fp32": "no"}.get(precision, precision), cpu=cpu)


def _precision(acc: Any) -> str:
    return {"no": "fp32"}.get(str(acc.mixed_precision), str(acc.mixed_precision))


def load_data(c: Config, tokenizer: Any) -> tuple[D.Encoded, D.Encoded | None, list[str] | None]:
    """Training and evaluation data, tokenised, and the class names (classification)."""
    table = D.load_table(c.dataset, c.dataset_config, c.train_split) if c.dataset else None
    if table is None:
        raise ConfigError(["No `dataset` given: set dataset=<file or hub id> (for example "
                           "dataset=assets/sst2_sample.csv)."])
    cols = D.resolve_columns(c, list(table.column_names))
    if c.max_train_samples:
        table = table.select(range(min(c.max_train_samples, len(table))))
    if c.eval_dataset or c.eval_split:
        eval_table = D.load_table(c.eval_dataset or c.dataset, c.dataset_config, c.eval_split or "train")
        missing = [x for x in dataclasses.astuple(cols) if x and x not in eval_table.column_names]
        if missing:
            raise D.DataError(f"The evaluation data lacks column(s) {', '.join(missing)}; its columns are: "
                              f"{', '.join(eval_table.column_names)}.")
    elif c.eval_fraction > 0 and len(table) >= 10:
        parts = table.train_test_split(test_size=c.eval_fraction, seed=c.seed)
        table, eval_table = parts["train"], parts["test"]
    else:
        eval_table = None
    names = D.label_names_of(table, cols.label, c.dataset) if c.task == "classification" else None
    train_data = D.encode(table, cols, c, tokenizer, names, c.dataset)
    eval_data = (D.encode(eval_table, cols, c, tokenizer, names, c.eval_dataset or c.dataset)
                 if eval_table is not None else None)
    return train_data, eval_data, names


def make_optimizer(c: Config, model: Any) -> torch.optim.Optimizer:
    """AdamW or SGD; no weight decay on biases and norm weights (the 1-D parameters)."""
    params = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    groups = [{"params": [q for _, q in params if q.ndim >= 2], "weight_decay": c.weight_decay},
              {"params": [q for _, q in params if q.ndim < 2], "weight_decay": 0.0}]
    if c.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=c.learning_rate)
    if c.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=c.learning_rate)
    # The fused kernel is ~9x faster than the per-tensor loop on CPU (7 vs 62 ms a step for MiniLM) and on GPU.
    try:
        return torch.optim.AdamW(groups, lr=c.learning_rate, fused=True)
    except RuntimeError:  # a device or dtype the fused kernel does not cover
        return torch.optim.AdamW(groups, lr=c.learning_rate)


def make_scheduler(c: Config, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """The LR schedule, sized in optimizer steps."""
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup"}.get(c.lr_scheduler, c.lr_scheduler)
    return get_scheduler(name, optimizer, num_warmup_steps=round(c.warmup_ratio * total_steps),
                         num_training_steps=total_steps)


def _global_count(s: Setup, indices: list[int]) -> int:
    local = s.train_data.num_targets(indices, s.causal)
    if s.accelerator.num_processes == 1:
        return local
    return int(s.accelerator.reduce(torch.tensor(local, device=s.accelerator.device), "sum").item())


def _stop_requested(stop: StopFlag, acc: Any) -> bool:
    if acc.num_processes == 1:
        return stop.requested
    # Any process that was signalled stops them all, at the same step.
    flag = torch.tensor(int(stop.requested), device=acc.device)
    return bool(acc.reduce(flag, "sum").item())


def _evaluate(s: Setup, epoch: float) -> dict[str, float]:
    if s.eval_data is None or len(s.eval_data) == 0:
        return {}
    metrics = evaluate(s.model, s.eval_data, causal=s.causal, num_labels=len(s.label_names or []),
                       batch_size=2 * s.batch.micro_batch_size, pad_id=s.tokenizer.pad_token_id,
                       accelerator=s.accelerator)
    s.log.emit(Eval(s.progress.step, round(epoch, 4), metrics))
    return metrics


def _save_checkpoint(s: Setup) -> Path:
    """Write a checkpoint under a temporary name and rename it once every process has written its part, so a
    crash or a full disk mid-save leaves the previous checkpoint as the newest complete one."""
    acc = s.accelerator
    path = rundir.checkpoint_path(s.run_dir, s.progress.step)
    partial = rundir.partial_checkpoint(path)
    acc.save_state(str(partial))
    if acc.is_main_process:
        # The loop's own state as JSON, not registered with accelerate, which would pickle it.
        rundir.write_json(partial / rundir.TRAINER_STATE, {"progress": s.progress.state_dict(),
                                                            "scheduler": s.scheduler.state_dict()})
    acc.wait_for_everyone()
    if acc.is_main_process:
        rundir.commit_checkpoint(partial, path)
        rundir.prune_checkpoints(s.run_dir)
        s.log.emit(Checkpoint(s.progress.step, str(path)))
    acc.wait_for_everyone()
    return path


def _load_checkpoint(acc: Any, path: Path, scheduler: Any, progress: Progress) -> None:
    """Restore model, optimizer, scaler and random state (accelerate, no pickled objects) and the loop's state."""
    state_file = path / rundir.TRAINER_STATE
    if not state_file.is_file():
        raise rundir.RunDirError(f"Checkpoint {str(path)!r} has no {rundir.TRAINER_STATE} (it was written by an "
                                 "older version of finetune): start the run again with overwrite=true.")
    acc.load_state(str(path))
    state = json.loads(state_file.read_text(encoding="utf-8"))
    progress.load_state_dict(state["progress"])
    scheduler.load_state_dict(state["scheduler"])


def _finish(s: Setup, seconds: float) -> RunResult:
    p, acc = s.progress, s.accelerator
    metrics = _evaluate(s, p.epoch + p.window / max(s.steps_per_epoch, 1))
    _save_checkpoint(s)
    model_dir = s.run_dir / "model"
    if acc.is_main_process:
        save_model(acc.unwrap_model(s.model), s.tokenizer, s.run_dir, merge_lora=s.config.merge_lora)
        summary = {**metrics, "steps": p.step, "samples": p.samples, "skipped_steps": p.skipped,
                   "train_seconds": round(seconds, 2), "train_samples_per_s": round(p.samples / max(seconds, 1e-9), 2)}
        rundir.write_json(s.run_dir / "metrics.json", summary)
        s.log.emit(Done(p.step, summary, str(model_dir)))
        rundir.plot_loss(s.run_dir / "events.jsonl", s.run_dir / "loss.png")
        metrics = summary
    acc.wait_for_everyone()
    return RunResult("done", s.run_dir, p.step, metrics, acc.is_main_process)
