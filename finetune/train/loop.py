"""The training loop: exact gradient accumulation on accelerate (the contract is docs/training.md).

One optimizer step trains on one *window* of samples. Each process takes its share of the window, computes the
*sum* of per-sample (or per-target-token) losses micro-batch by micro-batch, and scales it by the number of targets
in the whole window over all processes, counted before the window starts. So a window of k micro-batches of B gives
the gradient of one batch of k·B, a short last window is normalised by its real size, and padding or masked prompt
tokens never shift the weights of the others.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, set_seed

from finetune.config.batch import BatchSplit, counted, divisors, resolve_batch, samples_of, splits_samples
from finetune.config.schema import Config
from finetune.data.load import Encoded, windows_per_epoch
from finetune.data.mixing import MultiData
from finetune.data.stream import StreamData
from finetune.engine.optim import make_optimizer, make_scheduler
from finetune.engine.runtime import (
    distributed_mode,
    fallback_note,
    make_accelerator,
    precision_of,
    requested_mode,
    resolve_precision,
    seconds_since_process_start,
)
from finetune.engine.step import optimizer_step
from finetune.errors import RunDirError, TrainingError
from finetune.kinds.base import TaskKind
from finetune.models import kernels as hub_kernels
from finetune.models import tiled_mlp
from finetune.models.pretrained import load_tokenizer
from finetune.plan import calibration, timing
from finetune.registry import configured
from finetune.run import rundir, tracking
from finetune.run.events import (
    Backoff,
    Checkpoint,
    Done,
    Error,
    Eval,
    Event,
    EventLog,
    Samples,
    Start,
    Step,
    Stopped,
)
from finetune.train.precompute import precompute
from finetune.train.stop import StopFlag
from finetune.train.variants import Variant, steps_per_window, variant_of
from finetune.use import hub

MAX_SKIPPED_IN_A_ROW = 25
# Evaluation batches, in micro-batches. Inference keeps no activations for a backward: a training micro-batch holds
# every layer's activations at once, an inference batch about one layer's at a time, so a classifier evaluates 4
# micro-batches at once within the plan's memory (fewer, larger batches: faster on a CPU). With checkpointing the
# training micro-batch kept only each layer's input, and a causal LM's logits grow with the batch: 2, as before.
EVAL_BATCHES_LARGE, EVAL_BATCHES = 4, 2


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


@dataclass(kw_only=True)
class RunResult:
    """How a run ended: `status` is done or stopped. A finished run also hands its caller what publishing it needs
    (`finetune.use.hub.push_after_training`): the run's resolved config and its event log."""

    status: str
    run_dir: Path
    step: int
    metrics: dict[str, float]
    is_main_process: bool = True
    config: Config | None = None
    log: EventLog | None = None


@dataclass(kw_only=True)
class Setup:
    """Everything the loop needs, built by `setup()`; `batch` is the split in use (an OOM back-off changes it)."""

    config: Config
    accelerator: Any
    batch: BatchSplit
    run_dir: Path
    tokenizer: Any
    train_data: Encoded | StreamData | MultiData
    eval_data: Encoded | None
    label_names: list[str] | None
    model: Any
    optimizer: Any
    scheduler: Any
    total_steps: int
    steps_per_epoch: int
    progress: Progress
    log: EventLog
    variant: Variant  # one task, segment recurrence or multi-task (finetune.train.variants)
    distributed: str = "single"  # how the run really distributes: single, ddp, fsdp or deepspeed
    note: str | None = None  # when that is not what the launcher asked for
    precomputed: dict[str, str] | None = None  # how a kind's precomputed columns were obtained, per part

    @property
    def kind(self) -> TaskKind:
        """The task kind: what the loss, its target count, the labels and the metrics are."""
        return configured(self.config)

    @property
    def eval_batch_size(self) -> int:
        """Samples per evaluation batch (see EVAL_BATCHES)."""
        # Logits over a vocabulary grow with the batch; a kind whose logits the planner does not count has small
        # ones.
        large = self.kind.logits_bytes(1, 1, 1, 1) == 0 and self.config.gradient_checkpointing != "true"
        return (EVAL_BATCHES_LARGE if large else EVAL_BATCHES) * max(samples_of(self.batch.micro_batch_size, self.kind),
                                                                     1)


def train(config: Config, *, stop: StopFlag | None = None, callbacks: list[Callable[[Event], None]] | None = None
          ) -> RunResult:
    """Fine-tune as `config` says; returns when done or stopped. Raises an `InputError` (ConfigError, DataError,
    ModelError, RunDirError, PlanError) for bad input, before any weight is loaded where possible, and
    TrainingError when training cannot go on; once the run has started, a failure is also its `error` event."""
    s = setup(config, callbacks or [])
    c, accelerator, p = s.config, s.accelerator, s.progress
    model, optimizer, scheduler = s.model, s.optimizer, s.scheduler
    stop = stop or StopFlag()
    params = [q for q in model.parameters() if q.requires_grad]
    repeats = steps_per_window(s.kind)
    s.log.emit(Start(total_steps=s.total_steps, steps_per_epoch=s.steps_per_epoch, num_train_samples=len(s.train_data),
                     num_eval_samples=len(s.eval_data or []), batch=s.batch, precision=precision_of(accelerator),
                     device=str(accelerator.device), run_dir=str(s.run_dir), step=p.step, resumed=c.resume,
                     distributed=s.distributed, note=s.note, startup_s=seconds_since_process_start(),
                     dropped_rows=getattr(s.train_data, "dropped", None) or None,
                     dropped_eval_rows=getattr(s.eval_data, "dropped", None) or None,
                     segmentation=getattr(s.train_data, "segmentation", None),
                     eval_segmentation=getattr(s.eval_data, "segmentation", None),
                     tasks=s.variant.shares(s), kernels=hub_kernels.record(accelerator.unwrap_model(model)),
                     tiled_mlp=tiled_mlp.tile_of(accelerator.unwrap_model(model)), precomputed=s.precomputed))
    model.train()
    clock, clock_samples = time.perf_counter(), p.samples
    train_start = clock
    # Outside the failure record: writing the error event to a full disk fails again, and is then said in words.
    with rundir.disk_full_is_one_sentence(s.run_dir, lambda m: s.log.emit(Error(message=m, exit_code=1))), \
            s.log.recording_failures():
        while p.step < s.total_steps:
            windows = s.train_data.windows(samples_of(s.batch.effective_batch_size, s.kind), seed=c.seed, epoch=p.epoch,
                                           shuffle=c.shuffle, group_by_length=c.group_by_length)
            # A kind may train each window several optimizer steps in a row (GRPO's num_iterations): each step is a
            # step, and `p.window` counts them. (Indexed, not listed: a stream's windows are read when indexed.)
            steps_in_epoch = len(windows) * repeats
            for w in range(p.window, steps_in_epoch):
                window = windows[w // repeats]
                while True:
                    try:
                        window_loss_sum, count = s.variant.backward(s, window)
                        break
                    except torch.OutOfMemoryError:
                        _back_off(s)  # the same window again with half the micro-batch: same gradient, less memory
                lr = scheduler.get_last_lr()[0]
                grad_norm, skipped = optimizer_step(params, optimizer, scheduler, accelerator, c.max_grad_norm)
                window_loss, task_losses = s.variant.window_loss(s, window_loss_sum, count)
                p.step += 1
                p.samples += counted(len(window), s.kind)  # GRPO counts completions, G per prompt
                p.tokens += s.train_data.num_tokens(window)
                p.skipped += int(skipped)
                p.skipped_in_a_row = p.skipped_in_a_row + 1 if skipped else 0
                p.window = w + 1
                epoch_progress = p.epoch + p.window / steps_in_epoch  # fractional: 1.5 is halfway through epoch 2
                if p.window == steps_in_epoch:
                    p.epoch, p.window = p.epoch + 1, 0
                if p.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                    raise TrainingError(f"fp16 overflowed on {p.skipped_in_a_row} optimizer steps in a row (loss "
                                        f"{window_loss:.4g}): training diverged. Lower learning_rate, or use "
                                        "precision=bf16 or fp32.")
                if p.step % c.logging_every == 0 or p.step == s.total_steps:
                    now = time.perf_counter()
                    rate = (p.samples - clock_samples) / max(now - clock, 1e-9)
                    clock, clock_samples = now, p.samples
                    s.log.emit(Step(step=p.step, epoch=round(epoch_progress, 4), loss=window_loss,
                                    grad_norm=float(grad_norm), lr=lr, samples=p.samples, tokens=p.tokens,
                                    skipped=p.skipped, samples_per_s=round(rate, 2), task_losses=task_losses,
                                    metrics=s.variant.step_metrics(s)))
                if c.eval_every and p.step % c.eval_every == 0 and p.step < s.total_steps:
                    _evaluate(s, epoch_progress)
                # Checkpoints only where a window's steps end: its kept completions are not saved, so a resumed run
                # starts at a window (the config makes save_every a multiple of the steps per window).
                at_window_end = p.window % repeats == 0
                if c.save_every and p.step % c.save_every == 0 and p.step < s.total_steps and at_window_end:
                    _save_checkpoint(s)
                if at_window_end and _stop_requested(stop, accelerator) and p.step < s.total_steps:
                    path = _save_checkpoint(s)
                    s.log.emit(Stopped(step=p.step, checkpoint=str(path)))
                    return RunResult(status="stopped", run_dir=s.run_dir, step=p.step, metrics={},
                                     is_main_process=accelerator.is_main_process)
                if p.step >= s.total_steps:
                    break
        return _finish(s, time.perf_counter() - train_start)


def _back_off(s: Setup) -> None:
    """After an out-of-memory error: drop the partial gradient and halve the micro-batch (doubling accumulation)."""
    s.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    old = s.batch
    if s.accelerator.num_processes > 1:
        # Another process may already wait in the gradient all-reduce; they cannot re-split together.
        raise TrainingError(f"Out of memory at micro_batch_size={old.micro_batch_size} with several processes: set "
                            "a smaller micro_batch_size or memory_budget_gb and restart (resume=true keeps progress).")
    # A micro-batch of whole samples, or of an equal part of one (GRPO: whole groups, or a divisor of G).
    smaller = next((d for d in reversed(divisors(old.per_process))
                    if d <= old.micro_batch_size // 2 and splits_samples(d, s.kind)), None)
    if smaller is None:
        raise TrainingError("Out of memory even at micro_batch_size=1: lower max_length, set lora=true or "
                            "gradient_checkpointing=true, or use a smaller model or a larger device.")
    s.batch = new = old.with_micro(smaller)
    s.log.emit(Backoff(step=s.progress.step + 1, micro_batch_size=new.micro_batch_size,
                       grad_accum_steps=new.grad_accum_steps,
                       message=f"out of memory at micro_batch_size={old.micro_batch_size}; retrying the step with "
                       f"{new.micro_batch_size} × {new.grad_accum_steps} (same effective batch and result)"))


def setup(c: Config, callbacks: list[Callable[[Event], None]]) -> Setup:
    """Accelerator, run directory, data, plan, model, optimizer and schedule, in fail-fast order; the variant of
    the loop (one task, segment recurrence, multi-task) loads the data and the model its own way."""
    tracking.check_available(c.report_to)  # a missing tracker package, or a push that cannot work, before any data
    hub.check_push(c)
    accelerator = make_accelerator(resolve_precision(c.precision))
    if c.output_dir is None:  # every process must agree on the same timestamped directory
        c = c.replace(output_dir=broadcast_object_list([rundir.default_output_dir()])[0])
    resolve_batch(c, accelerator.num_processes)  # refuse impossible batch arithmetic before anything is loaded
    run_dir = rundir.check_run_dir(c)
    if c.resume:
        c = rundir.resumed_config(c, run_dir)
    variant = variant_of(c)
    tokenizer = load_tokenizer(c)
    with accelerator.main_process_first():  # the main process tokenises into the cache, the others read it
        train_data, eval_data, label_names = variant.load_data(c, tokenizer, accelerator.num_processes)
    if c.messages_column is None and getattr(train_data, "messages", None):
        # config.yaml says the run trained on conversations (and so `finetune predict` chats with its model).
        c = c.replace(messages_column=train_data.messages)
    set_seed(c.seed)  # before the model is loaded: a new classification head is initialised from it
    # The plan needs the data (the worst-case length) but no weights: its dry run runs on fake tensors. The model
    # comes back loaded and prepared as the plan says (and, with the probe, measured).
    # Before prepare() the mode is what accelerate's state says; the note says when that is not what was asked for.
    mode = distributed_mode(accelerator)
    note = fallback_note(requested_mode(), mode, accelerator.num_processes, accelerator.device.type)
    plan, model = variant.plan(c, train_data, label_names, accelerator, mode)
    config = getattr(model, "config", None)
    if config is not None and tokenizer.pad_token_id is not None:
        # A sequence classifier on a causal LM scores the last token that is not `pad_token_id`: it must be the id
        # the micro-batches are padded with (a config without one got end-of-sequence when it was loaded).
        config.pad_token_id = tokenizer.pad_token_id
    if note:
        plan = dataclasses.replace(plan, notes=(note, *plan.notes))
    c = plan.apply(c)
    kind = configured(c)
    steps_per_epoch, total_steps = run_length(c, plan.batch, len(train_data))
    plan = dataclasses.replace(plan, time=predicted_time(c, plan, train_data, eval_data, total_steps, model,
                                                         accelerator.device.type))
    optimizer = make_optimizer(c, model)
    scheduler = make_scheduler(c, optimizer, total_steps)
    # The scheduler stays out of prepare(): a prepared scheduler steps once per process per optimizer step.
    model, optimizer = accelerator.prepare(model, optimizer)
    mode = distributed_mode(accelerator, model)  # what prepare() really did: fsdp only if parameters are sharded
    # Before a resumed run's checkpoint is loaded: a precomputed reference is the model as the run started (or
    # the values the first start stored in the data cache).
    precomputed = precompute(c, kind, model, tokenizer, accelerator, {"train": train_data, "eval": eval_data},
                             batch_size=EVAL_BATCHES * plan.batch.micro_batch_size)
    progress = Progress()
    trackers = tracking.sinks(accelerator, c, run_dir)  # the trackers get the records events.jsonl gets
    log = EventLog(run_dir / "events.jsonl" if accelerator.is_main_process else None,
                   [*callbacks, *trackers] if accelerator.is_main_process else [])
    _open_run_dir(c, run_dir, accelerator, plan, scheduler, progress)
    return Setup(config=c, accelerator=accelerator, batch=plan.batch, run_dir=run_dir, tokenizer=tokenizer,
                 train_data=train_data, eval_data=eval_data, label_names=label_names, model=model,
                 optimizer=optimizer, scheduler=scheduler, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                 progress=progress, log=log, variant=variant, distributed=mode, note=note,
                 precomputed=precomputed or None)


def run_length(c: Config, batch: BatchSplit, rows: int) -> tuple[int, int]:
    """(optimizer steps per epoch, total steps) of a run of `rows` training samples with `batch`."""
    kind = configured(c)
    steps_per_epoch = windows_per_epoch(rows, samples_of(batch.effective_batch_size, kind)) * steps_per_window(kind)
    return steps_per_epoch, c.max_steps or max(1, math.ceil(steps_per_epoch * c.epochs))


def predicted_time(c: Config, plan: Any, train_data: Any, eval_data: Any, steps: int, model: Any, device: str
                   ) -> dict[str, Any]:
    """What plan.json keeps of the run's predicted time (`finetune.plan.timing`); {} for data whose lengths are not
    known before it is read (a stream)."""
    lengths = train_data.lengths if isinstance(train_data, Encoded) else None
    if lengths is None or not len(lengths):
        return {}
    params, width = timing.model_size(model)
    return timing.for_run(plan, lengths=lengths, eval_lengths=eval_data.lengths if isinstance(eval_data, Encoded)
                          else None, steps=steps, eval_every=c.eval_every, params=params, width=width,
                          device=device, kind=c.task, model=c.model).to_dict()


def _open_run_dir(c: Config, run_dir: Path, accelerator: Any, plan: Any, scheduler: Any, progress: Progress) -> None:
    """A resumed run continues from its newest checkpoint; a new one writes its config and plan."""
    if c.resume:
        if accelerator.is_main_process:
            rundir.remove_partial_checkpoints(run_dir)
        _load_checkpoint(accelerator, rundir.checkpoints(run_dir)[-1], scheduler, progress,
                         quantized=plan.quantization != "none")
    elif accelerator.is_main_process:
        if c.overwrite and (kept := rundir.clear_run_dir(run_dir)):
            shown = ", ".join(str(k.relative_to(run_dir)) for k in kept[:3]) + (", …" if len(kept) > 3 else "")
            print(f"note: overwrite kept {len(kept)} file(s) that finetune did not write: {shown}", file=sys.stderr,
                  flush=True)
        created = not run_dir.exists()
        try:
            with rundir.disk_full_is_one_sentence(run_dir):
                rundir.mark_run_dir(run_dir)
                # The saved config describes the run, not this invocation: `finetune train config.yaml resume=true`
                # continues it and a plain `finetune train config.yaml` refuses to overwrite it.
                rundir.write_text(run_dir / "config.yaml", c.replace(overwrite=False, resume=False).to_yaml())
                rundir.write_json(run_dir / "plan.json", plan.to_dict())
        except TrainingError:
            # A full disk before the run began: take back what was written, so that starting again works as it
            # would have (a folder the run created goes too).
            for name in (rundir.MARKER, rundir.MANIFEST, "config.yaml", "plan.json"):
                (run_dir / name).unlink(missing_ok=True)
            if created and run_dir.is_dir() and not any(run_dir.iterdir()):
                run_dir.rmdir()
            raise
    accelerator.wait_for_everyone()


def _stop_requested(stop: StopFlag, accelerator: Any) -> bool:
    if accelerator.num_processes == 1:
        return stop.requested
    # Any process that was signalled stops them all, at the same step.
    flag = torch.tensor(int(stop.requested), device=accelerator.device)
    return bool(accelerator.reduce(flag, "sum").item())


def _evaluate(s: Setup, epoch: float) -> dict[str, float]:
    metrics = s.variant.evaluate(s)
    if metrics:
        s.log.emit(Eval(step=s.progress.step, epoch=round(epoch, 4), metrics=metrics))
        if rows := s.variant.samples(s):  # what the model generated, with its rewards (GRPO)
            s.log.emit(Samples(step=s.progress.step, rows=rows))
    return metrics


def _save_checkpoint(s: Setup) -> Path:
    """Write a checkpoint under a temporary name and rename it once every process has written its part, so a
    crash or a full disk mid-save leaves the previous checkpoint as the newest complete one."""
    accelerator = s.accelerator
    path = rundir.checkpoint_path(s.run_dir, s.progress.step)
    partial = rundir.partial_checkpoint(path)
    accelerator.save_state(str(partial))
    if accelerator.is_main_process:
        # The loop's own state as JSON, not registered with accelerate, which would pickle it.
        rundir.write_json(partial / rundir.TRAINER_STATE, {"progress": s.progress.state_dict(),
                                                            "scheduler": s.scheduler.state_dict()})
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        rundir.commit_checkpoint(partial, path)
        rundir.prune_checkpoints(s.run_dir)
        rundir.record_written(s.run_dir, "checkpoints")
        s.log.emit(Checkpoint(step=s.progress.step, checkpoint=str(path)))
    accelerator.wait_for_everyone()
    return path


def _load_checkpoint(accelerator: Any, path: Path, scheduler: Any, progress: Progress, quantized: bool = False
                     ) -> None:
    """Restore model, optimizer, scaler and random state (accelerate, no pickled objects) and the loop's state.
    A quantized base's constants are saved beside its weights under names the freshly loaded base does not
    register: they are frozen and loaded again from the model, so they are not required back (`strict`)."""
    state_file = path / rundir.TRAINER_STATE
    if not state_file.is_file():
        raise RunDirError(f"Checkpoint {str(path)!r} has no {rundir.TRAINER_STATE} (it was written by an "
                                 "older version of finetune): start the run again with overwrite=true.")
    accelerator.load_state(str(path), **({"strict": False} if quantized else {}))
    state = json.loads(state_file.read_text(encoding="utf-8"))
    progress.load_state_dict(state["progress"])
    scheduler.load_state_dict(state["scheduler"])


def _finish(s: Setup, seconds: float) -> RunResult:
    p, accelerator = s.progress, s.accelerator
    metrics = _evaluate(s, p.epoch + p.window / max(s.steps_per_epoch, 1))
    _save_checkpoint(s)
    model_dir = s.run_dir / "model"
    # Sharded parameters are gathered into one full state dict on the main process first; every process must take
    # part in the gathering. Unsharded models save their own parameters.
    state_dict = accelerator.get_state_dict(s.model) if s.distributed in ("fsdp", "deepspeed") else None
    if accelerator.is_main_process:
        s.variant.save(s, accelerator.unwrap_model(s.model), state_dict)
        for folder in ("model", "adapter"):
            rundir.record_written(s.run_dir, folder)
        summary = {**metrics, "steps": p.step, "samples": p.samples, "skipped_steps": p.skipped,
                   "train_seconds": round(seconds, 2), "train_samples_per_s": round(p.samples / max(seconds, 1e-9), 2)}
        rundir.write_json(s.run_dir / "metrics.json", summary)
        # The run is finished (metrics.json says so), so nothing can resume from its checkpoints: the last one held
        # the model again and the optimizer's state twice over (261 of a 20-step MiniLM run's 435 MB). It was saved
        # only so that a failure while saving the model could be resumed.
        rundir.prune_checkpoints(s.run_dir, keep=0)
        s.log.emit(Done(step=p.step, metrics=summary, model_dir=str(model_dir)))
        # What this run took corrects the next prediction of its kind here (finetune.plan.calibration).
        calibration.record_run(s.run_dir, kind=s.config.task, model=s.config.model)
        rundir.plot_loss_in_background(s.run_dir)
        metrics = summary
    accelerator.wait_for_everyone()
    return RunResult(status="done", run_dir=s.run_dir, step=p.step, metrics=metrics,
                     is_main_process=accelerator.is_main_process, config=s.config, log=s.log)
