"""How long a run will take, before it starts: the step time and the wall time from start to Done.

The arithmetic (docs/planning.md, "Time and cost"):

- One optimizer step does about `FLOPS_PER_TOKEN` × P floating-point operations per token of its effective batch:
  2·P forward, 2·P backward through the activations, 2·P more for the weights' gradients (skipped for a LoRA run's
  frozen base), and 2·P more for the forward that gradient checkpointing runs again. P is the model's parameters,
  a token is one of the batch's mean sample length (the data's own lengths, not the worst case).
- A device does those at a rate: on this machine the rate a short timed probe measures (`probe_rate`: matmuls of the
  model's width over a micro-batch of its tokens, the shape that dominates a step), times `PROBE_SHARE` for what a
  step spends besides them; on a GPU elsewhere (`finetune plan --device cuda`, a Jobs flavor) `UTILISATION` of the
  GPU's dense peak (`PEAK_TFLOPS`).
- The wall time adds the evaluations (a forward pass, 2·P per token, over the evaluation rows each time) and the
  fixed costs, predicted apart from the steps: `STARTUP_S` (starting Python, importing torch and transformers,
  reading the data and the model, the plan) and `FINISH_S` (checkpoints, saving the model).
- Where runs of the same kind on the same device have finished before, their records (`finetune.plan.calibration`)
  replace the rate and the fixed costs: the step and evaluation times are the FLOPs × the median of their actual
  seconds per FLOP, the fixed costs the medians of what they took.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from finetune.plan import calibration

# Dense bf16 (fp16 on a T4) tensor-core TFLOPS per GPU, from NVIDIA's datasheets; the A10G is AWS's cut of the
# A10, counted at about half the A10's 125 to stay on the safe side.
PEAK_TFLOPS = {"T4": 65, "L4": 121, "L40S": 362, "A10G": 70, "A100": 312, "H100": 989, "H200": 989,
               "RTX PRO 6000": 400}
# The share of that peak a fine-tuning step keeps busy (its "model FLOPs utilisation"). Large pre-training runs
# report 0.3-0.5 (PaLM, Chowdhery et al. 2022, table 3: 46 %; Megatron-LM's GPT-3 175B runs, Narayanan et al. 2021:
# 52 % of the A100's peak); fine-tuning a small model on short sequences keeps a GPU far less busy (kernel launches,
# the optimizer, data), so the lower end is taken below it.
UTILISATION = 0.2
# What a step keeps of the probe's matmul rate on this machine: the probe times the largest matmuls alone; a step
# also runs attention, norms, the loss, the optimizer and Python between them. bench/time_estimate.py on a 2-core
# CPU (classification, causal LoRA and seq2seq runs) measured 0.3-0.55; 0.4 is taken.
PROBE_SHARE = 0.4
STEP_OVERHEAD_S = 0.02  # per optimizer step: the loop's Python, the events, the scheduler
# Without a calibration: process start to the first step (imports, data, model, plan), and the last step to Done
# (the final checkpoint and the saved model).
STARTUP_S = 5.0
FINISH_S = 1.0
PROBE_SECONDS = 0.3  # how long the probe multiplies
PROBE_TIMINGS = 5  # timed repetitions after the warm-up; their median is the rate


@dataclass(frozen=True, kw_only=True)
class TimeEstimate:
    """The predicted step time and wall time of a run, and what they rest on."""

    step_s: float
    steps: int
    eval_s: float  # all its evaluations together
    startup_s: float  # process start to the first step
    finish_s: float  # the last step to Done: the final checkpoint and the saved model
    total_s: float
    flops_per_step: float
    rate_flops: float  # operations per second a step sustains (before any calibration)
    basis: str  # where the rate comes from, in words
    # The arithmetic alone (FLOPs ÷ rate), before the calibration corrected it: what a finished run's record
    # compares its actual times with.
    arithmetic_step_s: float = 0.0
    arithmetic_eval_s: float = 0.0
    device_key: str = ""  # the device the calibration files it under ("cpu", a GPU's name); "" for a GPU elsewhere
    calibrated_runs: int = 0  # finished runs whose records corrected it (0: the arithmetic alone)

    def to_dict(self) -> dict[str, Any]:
        """As plan.json keeps it."""
        return asdict(self)


def flops_per_token(params: int, *, lora: bool, checkpointing: bool) -> float:
    """Floating-point operations per training token (see the module): 6·P, 4·P under LoRA, +2·P when checkpointing."""
    return (4 if lora else 6) * params + (2 * params if checkpointing else 0)


def gpu_rate(gpu_model: str, gpus: int = 1) -> tuple[float, str]:
    """(operations per second, in words) of `gpus` GPUs of `gpu_model` at `UTILISATION` of their peak."""
    peak = PEAK_TFLOPS.get(gpu_model, min(PEAK_TFLOPS.values())) * 1e12
    return peak * gpus * UTILISATION, f"{UTILISATION:.0%} of {gpus} × {gpu_model}'s {peak / 1e12:g} TFLOPS"


@functools.cache
def probe_rate(width: int, rows: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Operations per second of (rows × width) @ (width × 4·width) matmuls on `device`: after one warm-up, the
    median of `PROBE_TIMINGS` timings over `PROBE_SECONDS` in all; the shape of a transformer layer's largest
    products for a micro-batch of `rows` tokens."""
    # At least 512 rows: a smaller product times the call's overhead, not the arithmetic (a step's overhead is
    # `STEP_OVERHEAD_S`).
    rows, width = max(512, min(rows, 8192)), max(64, min(width, 8192))
    # Constants, not random numbers: the probe runs before training and must not move the run's random state.
    a = torch.full((rows, width), 0.5, device=device, dtype=dtype)
    b = torch.full((width, 4 * width), 0.25, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a @ b  # warm-up: threads, kernels, caches
    sync()
    rates = []
    # The median of several short timings, not the best: on a machine shared with other work the run will see the
    # load of a typical moment, not of the quietest one.
    for _ in range(PROBE_TIMINGS):
        done, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < PROBE_SECONDS / PROBE_TIMINGS:
            a @ b
            sync()
            done += 1
        rates.append(2 * rows * width * 4 * width * done / max(elapsed, 1e-9))
    return statistics.median(rates)


def estimate(*, params: int, lora: bool, checkpointing: bool, steps: int, samples_per_step: int,
             mean_tokens: float, eval_tokens: float, evaluations: int, rate: float, basis: str,
             startup_s: float = STARTUP_S, finish_s: float = FINISH_S,
             calibrated: calibration.Calibration | None = None, device_key: str = "") -> TimeEstimate:
    """The run's time from its numbers (see the module): `steps` optimizer steps of `samples_per_step` samples of
    `mean_tokens`, `evaluations` passes over `eval_tokens`, at `rate` operations per second; corrected by
    `calibrated` (finished runs' records) where given."""
    per_step = flops_per_token(params, lora=lora, checkpointing=checkpointing) * samples_per_step * mean_tokens
    arithmetic_step_s = per_step / rate + STEP_OVERHEAD_S
    arithmetic_eval_s = evaluations * 2 * params * eval_tokens / rate
    step_s, eval_s = arithmetic_step_s, arithmetic_eval_s
    if calibrated is not None:  # what the same kind's finished runs took here (their steps' overhead included)
        step_s = per_step * calibrated.step_s_per_flop
        eval_s = evaluations * 2 * params * eval_tokens * calibrated.eval_s_per_flop
        startup_s, finish_s = calibrated.startup_s, calibrated.finish_s
        basis = f"the seconds per FLOP of {calibrated.words()}; uncalibrated, {basis}"
    return TimeEstimate(step_s=step_s, steps=steps, eval_s=eval_s, startup_s=startup_s, finish_s=finish_s,
                        total_s=startup_s + steps * step_s + eval_s + finish_s, flops_per_step=per_step,
                        rate_flops=rate, basis=basis, arithmetic_step_s=arithmetic_step_s,
                        arithmetic_eval_s=arithmetic_eval_s, device_key=device_key,
                        calibrated_runs=calibrated.runs if calibrated is not None else 0)


def evaluations(steps: int, eval_every: int, has_eval: bool) -> int:
    """How many times a run evaluates: every `eval_every` steps and at the end (none without evaluation rows)."""
    if not has_eval:
        return 0
    return 1 + (math.ceil(steps / eval_every) - 1 if eval_every else 0)


def describe(estimate_: dict[str, Any]) -> str:
    """One line of the plan: the step time, the total, and its basis."""
    return (f"{_duration(estimate_['step_s'], fine=True)} a step × {estimate_['steps']:,} steps ≈ "
            f"{_duration(estimate_['total_s'])} start to Done ({estimate_['basis']}; docs/planning.md says how far "
            "to trust it)")


def _duration(seconds: float, fine: bool = False) -> str:
    if fine and seconds < 10:
        return f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    return f"{minutes:.0f} min" if minutes < 90 else f"{minutes / 60:.1f} h"


def model_size(model: Any) -> tuple[int, int]:
    """(parameters that multiply, width) of a model (loaded, or built on the meta device)."""
    text = model.config.get_text_config()
    width = next((v for v in (getattr(text, k, None) for k in ("hidden_size", "d_model", "n_embd", "dim"))
                  if isinstance(v, int)), 768)
    # An embedding is a lookup, not a product: its parameters cost no FLOPs per token (Kaplan et al. 2020 count
    # non-embedding parameters for the same reason), unless it is also the output head that multiplies.
    looked_up = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    multiplied = {id(head.weight)} if head is not None and getattr(head, "weight", None) is not None else set()
    lookups = sum(n for key, n in looked_up.items() if key not in multiplied)
    return sum(p.numel() for p in model.parameters()) - lookups, width


def device_key(device: str, processes: int = 1) -> str:
    """The device a calibration record is filed under: "cpu", or the GPU's name (and how many take part)."""
    name = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else device
    return name if processes == 1 else f"{processes} × {name}"


def for_run(plan: Any, *, lengths: Any, eval_lengths: Any, steps: int, eval_every: int, params: int, width: int,
            device: str, gpu: tuple[str, int] | None = None, kind: str = "", model: str = "") -> TimeEstimate:
    """The estimate of a planned run: its data's lengths, its steps, its model's size, on `device` here (probed and
    calibrated by the finished runs of `kind` here, `model`'s first) or on `gpu` (model, count) elsewhere."""
    mean = float(sum(lengths) / max(len(lengths), 1))
    batch = plan.batch
    calibrated, key = None, ""
    if gpu is not None:
        rate, basis = gpu_rate(*gpu)
    else:
        cuda = device.startswith("cuda")
        measured = probe_rate(width, int(batch.micro_batch_size * mean), "cuda" if cuda else "cpu",
                              torch.bfloat16 if cuda else torch.float32)
        rate = measured * PROBE_SHARE
        basis = f"this {'GPU' if cuda else 'CPU'}'s measured {measured / 1e9:,.0f} GFLOP/s × {PROBE_SHARE:g}"
        key = device_key("cuda" if cuda else "cpu", batch.num_processes)
        calibrated = calibration.for_prediction(kind, key, model) if kind else None
    return estimate(params=params, lora=plan.lora, checkpointing=plan.gradient_checkpointing, steps=steps,
                    samples_per_step=batch.effective_batch_size, mean_tokens=mean,
                    eval_tokens=float(sum(eval_lengths)) if eval_lengths is not None else 0.0,
                    evaluations=evaluations(steps, eval_every, eval_lengths is not None and len(eval_lengths) > 0),
                    rate=rate, basis=basis, calibrated=calibrated, device_key=key)
