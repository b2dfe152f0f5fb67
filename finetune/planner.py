"""From a memory budget and an effective batch to a training plan: micro-batch, accumulation, precision,
checkpointing, LoRA, and the predicted peak with its breakdown (contract: shared/design/memory.md).

The estimate is a *dry run*: the real model is built on the meta device (shapes and dtypes, no data, no weights)
and one accumulation window's forward and backward run on it at the worst-case length under the live-tensor
tracker. That follows the model's actual implementation (attention kernel, loss, saved tensors), so it needs no
per-architecture constants; on a CPU it matches measured live-tensor peaks to a few per cent. A real device can
keep different tensors (GPU attention kernels, allocator slack), which the optional probe measures.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from finetune.config import Config, ConfigError, resolve_batch
from finetune.memory import LiveTensorTracker

GIB = 2**30
SAFETY = 0.95  # plan to 95 % of the budget: the estimate aims at ±5 % on a GPU
CUDA_CONTEXT = 512 * 2**20  # the CUDA context and kernels, outside the allocator's counts
ALLOCATOR_SLACK = 0.10  # reserved − allocated in training: PyTorch's caching allocator fragments
CPU_RUNTIME = 0  # live tensors only: the process's own footprint is not the model's
LEVELS = ("plain", "gradient checkpointing", "8-bit optimizer", "LoRA")


class PlanError(ConfigError):
    """No plan fits the budget; the message gives the smallest budget that would."""


@dataclass(frozen=True)
class Plan:
    """How to train within the budget: `micro_batch_size × grad_accum_steps × num_processes == effective`."""

    micro_batch_size: int
    grad_accum_steps: int
    num_processes: int
    effective_batch_size: int
    precision: str
    gradient_checkpointing: bool
    lora: bool
    optimizer: str
    budget_bytes: int | None
    predicted_peak_bytes: int
    breakdown: dict[str, int]
    device: str
    worst_case_tokens: int
    method: str  # "dry-run" or "probe"
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """The plan as plan.json holds it."""
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        return d

    def apply(self, c: Config) -> Config:
        """The config with the plan's choices filled in (what `finetune train` then runs)."""
        return c.replace(micro_batch_size=self.micro_batch_size, grad_accum_steps=self.grad_accum_steps,
                         effective_batch_size=self.effective_batch_size, precision=self.precision,
                         gradient_checkpointing=str(self.gradient_checkpointing).lower(),
                         lora=str(self.lora).lower(), optimizer=self.optimizer)


def resolve_precision(precision: str) -> str:
    """`auto` → bf16 (or fp16) on a GPU that has it, fp32 elsewhere; fp16 off a GPU is refused."""
    cuda = torch.cuda.is_available()
    if precision == "auto":
        if not cuda:
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if precision == "fp16" and not cuda:
        raise ConfigError(["precision=fp16 needs a CUDA GPU (its loss scaling is GPU-only): use fp32 or auto."])
    return precision


def device_memory() -> tuple[str, int]:
    """(description, total bytes) of the device training will use: the first GPU, else this machine's RAM."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"cuda ({props.name})", int(props.total_memory)
    import psutil

    return "cpu", int(psutil.virtual_memory().total)


def _has_8bit_optimizer() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def model_skeleton(c: Config, num_labels: int, *, checkpointing: bool, lora: bool) -> Any:
    """The configured model as fake tensors (shapes, dtypes and a device, no data and no weights read), with
    checkpointing and LoRA as asked."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from finetune.modeling import quiet_transformers, resolve_model_path

    quiet_transformers()
    model_config = AutoConfig.from_pretrained(resolve_model_path(c.model), trust_remote_code=c.trust_remote_code)
    if c.task == "classification":
        model_config.num_labels = num_labels
    auto = AutoModelForSequenceClassification if c.task == "classification" else AutoModelForCausalLM
    fake = FakeTensorMode()
    with fake, _adapters_stay_where_made():
        model = auto.from_config(model_config, trust_remote_code=c.trust_remote_code, dtype=torch.float32)
        model = prepare_for_training(model, c, checkpointing=checkpointing, lora=lora)
    model._finetune_fake_mode = fake  # the dry run must run its ops under the same fake mode
    return model


@contextlib.contextmanager
def _adapters_stay_where_made() -> Any:
    """Let peft build adapters on fake tensors.

    peft moves new adapter layers to their base layer's device with `Module.to()`, which cannot swap fake tensors
    (under the fake mode they are already made there, in float32), and deep-copies the head it trains, which would
    give the copies a fake mode of their own (mixing modes fails, and collecting the orphans crashed torch 2.13).
    Deep copies of modules get fresh tensors of the same shapes in the active mode instead: the dry run needs
    shapes, not values."""
    real_deepcopy = copy.deepcopy

    def deepcopy(obj: Any, memo: dict | None = None, *args: Any) -> Any:
        if isinstance(obj, torch.nn.Module):
            memo = dict(memo or {})
            for t in [*obj.parameters(), *obj.buffers()]:
                fresh = torch.empty(t.shape, dtype=t.dtype)
                memo[id(t)] = torch.nn.Parameter(fresh, t.requires_grad) if isinstance(t, torch.nn.Parameter) \
                    else fresh
        return real_deepcopy(obj, memo, *args)

    with mock.patch.object(torch.nn.Module, "to", lambda self, *args, **kwargs: self), \
            mock.patch.object(copy, "deepcopy", deepcopy):
        yield


def prepare_for_training(model: Any, c: Config, *, checkpointing: bool, lora: bool) -> Any:
    """Turn on gradient checkpointing and wrap in LoRA adapters, the same way for the dry run and for training."""
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = c.lora_target_modules
        modules = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
        task_type = "SEQ_CLS" if c.task == "classification" else "CAUSAL_LM"
        model = get_peft_model(model, LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha, lora_dropout=c.lora_dropout,
                                                 target_modules=modules, task_type=task_type))
    return model


def _bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def dry_run(model: Any, causal: bool, micro: int, tokens: int, accum: int, precision: str) -> int:
    """Peak bytes that one window's forward and backward add on top of weights and optimizer state.

    Two micro-batches stand for any window of k ≥ 2 (from the second on, the window's gradients are resident and
    each micro-batch repeats the same pattern). Autocast acts on fake tensors as on real ones, so mixed precision
    keeps exactly the half- and full-precision tensors a real run keeps."""
    from finetune.evaluate import loss_sum

    fake = model._finetune_fake_mode
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    model.train()
    with fake:
        ids = torch.zeros((micro, tokens), dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "labels": ids if causal else torch.zeros(micro, dtype=torch.long)}
    try:
        with fake, LiveTensorTracker() as tracker:
            for _ in range(min(accum, 2)):
                with torch.autocast("cpu", dtype=half or torch.float32, enabled=half is not None):
                    loss, _ = loss_sum(model, batch, causal)
                loss.backward()
                del loss
    finally:
        for p in model.parameters():
            p.grad = None
    return tracker.peak


def estimate(model: Any, c: Config, *, causal: bool, micro: int, tokens: int, accum: int, precision: str,
             optimizer: str, device: str) -> dict[str, int]:
    """Peak memory by term for one configuration (bytes)."""
    params = list(model.parameters())
    gradients = _bytes(p for p in params if p.requires_grad)
    state_per_byte = {"adamw": 2.0, "adamw_8bit": 0.5, "sgd": 0.0}[optimizer]  # relative to fp32 parameter bytes
    terms = {"weights": _bytes(params), "optimizer_state": int(state_per_byte * gradients)}
    window = dry_run(model, causal, micro, tokens, accum, precision)
    # The window's peak holds gradients (all of them with accumulation; without it, whichever is larger of the
    # activations at the end of forward and the gradients at the end of backward), logits and activations.
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0) or 0
    terms["gradients"] = min(gradients, window)
    terms["logits"] = min(2 * micro * tokens * vocab * 4 if causal else 0, window - terms["gradients"])
    terms["activations"] = window - terms["gradients"] - terms["logits"]
    tensors = sum(terms.values())
    terms["overhead"] = CUDA_CONTEXT + int(ALLOCATOR_SLACK * tensors) if device.startswith("cuda") else CPU_RUNTIME
    return terms


def make_plan(c: Config, lengths: list[int], num_labels: int, *, num_processes: int = 1,
              device: tuple[str, int] | None = None) -> Plan:
    """Choose the largest micro-batch that divides the effective batch and fits, escalating in a fixed order."""
    device_name, device_total = device or device_memory()
    precision = resolve_precision(c.precision)
    causal = c.task == "causal_lm"
    tokens = max(lengths) if lengths else c.max_length
    budget = int(c.memory_budget_gb * GIB) if c.memory_budget_gb else None
    batch = resolve_batch(c.replace(micro_batch_size=None, grad_accum_steps=None)
                          if (c.micro_batch_size is None and c.grad_accum_steps is None) else c, num_processes)
    per_process = batch.effective_batch_size // num_processes
    if c.micro_batch_size or c.grad_accum_steps:
        candidates = [batch.micro_batch_size]  # the user fixed the split: check it, don't change it
    else:
        candidates = [d for d in range(per_process, 0, -1) if per_process % d == 0]
    notes: list[str] = []
    levels = _levels(c, notes)
    tried: list[tuple[str, int]] = []
    for level, checkpointing, optimizer, lora in levels:
        model = model_skeleton(c, num_labels, checkpointing=checkpointing, lora=lora)

        def peak_of(micro: int, model: Any = model, level: str = level, optimizer: str = optimizer
                    ) -> tuple[int, dict[str, int]]:
            terms = estimate(model, c, causal=causal, micro=micro, tokens=tokens, accum=per_process // micro,
                             precision=precision, optimizer=optimizer, device=device_name)
            tried.append((f"{level}, micro-batch {micro}", sum(terms.values())))
            return sum(terms.values()), terms

        def fits(peak: int) -> bool:
            return budget is None or peak <= SAFETY * budget

        # Without accumulation (the largest micro-batch) no gradients are resident during the forward, so that
        # plan can need less than a smaller micro-batch with accumulation. Among the plans with accumulation the
        # peak grows with the micro-batch: binary search between the two ends.
        if budget is None or fits(peak_of(candidates[0])[0]):
            chosen = candidates[0]
        elif len(candidates) == 1 or not fits(peak_of(candidates[-1])[0]):
            continue  # not even the smallest micro-batch fits: next level
        else:
            fitting, lo, hi = len(candidates) - 1, 1, len(candidates) - 2
            while lo <= hi:
                mid = (lo + hi) // 2
                if fits(peak_of(candidates[mid])[0]):
                    fitting, hi = mid, mid - 1
                else:
                    lo = mid + 1
            chosen = candidates[fitting]
        peak, terms = peak_of(chosen)
        if level != "plain":
            smallest: dict[str, int] = {}
            for name, p in tried:
                lower = name.split(",")[0]
                if lower != level:
                    smallest[lower] = min(p, smallest.get(lower, p))
            steps = "; ".join(f"{name} needs {_gib(p)}" for name, p in smallest.items())
            notes.append(f"Escalated to {level}, since the smallest plan of each earlier step does not fit "
                         f"{SAFETY:.0%} of the budget ({steps}).")
        return Plan(chosen, per_process // chosen, num_processes, batch.effective_batch_size, precision,
                    checkpointing, lora, optimizer, budget, peak, terms, device_name, tokens, "dry-run", tuple(notes))
    smallest = min(p for _, p in tried)
    hint = " (or drop micro_batch_size/grad_accum_steps so the planner may split the batch)" if len(candidates) == 1 \
        else ""
    raise PlanError([f"Nothing fits memory_budget_gb={c.memory_budget_gb:g}: the smallest plan tried "
                     f"({min(tried, key=lambda t: t[1])[0]}) needs {_gib(smallest)} at the longest sample of "
                     f"{tokens} tokens, so use a budget of at least {math.ceil(smallest / SAFETY / GIB * 100) / 100:g} "
                     f"GiB, a smaller max_length, or a smaller model{hint}."])


def probe_enabled(c: Config) -> bool:
    """`plan_probe`: auto measures on a GPU (where kernels and the allocator differ from the dry run)."""
    return c.plan_probe == "true" or (c.plan_probe == "auto" and torch.cuda.is_available())


def measure_window(model: Any, c: Config, *, micro: int, tokens: int, accum: int, precision: str) -> int:
    """Measured peak bytes of one real window (forward, backward, optimizer step) at the worst-case length.

    The weights do not change (the probe's own optimizer runs at learning rate 0 and is thrown away) and the
    random state is restored, so training afterwards is exactly what it would have been."""
    import gc

    from finetune.evaluate import loss_sum
    from finetune.memory import tensor_bytes
    from finetune.train import make_optimizer

    causal = c.task == "causal_lm"
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    rng = torch.get_rng_state(), (torch.cuda.get_rng_state_all() if cuda else None)
    optimizer = make_optimizer(c.replace(learning_rate=0.0), model)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    vocab = getattr(model.config, "vocab_size", 2)

    def window() -> None:
        for _ in range(min(accum, 2)):  # from the second micro-batch on, every one repeats the same pattern
            ids = torch.randint(3, vocab, (micro, tokens), device=device)
            labels = ids if causal else torch.zeros(micro, dtype=torch.long, device=device)
            with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
                loss, _ = loss_sum(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                           "labels": labels}, causal)
            loss.backward()
            del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    was_training = model.training
    model.train()
    try:
        window()  # the first window creates the optimizer state, as training's first step does
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            window()
            return int(torch.cuda.max_memory_allocated(device))
        static = tensor_bytes(list(model.parameters()) + [v for st in optimizer.state.values()
                                                          for v in st.values() if torch.is_tensor(v)])
        with LiveTensorTracker() as tracker:
            window()
        return static + tracker.peak
    finally:
        model.train(was_training)
        torch.set_rng_state(rng[0])
        if cuda:
            torch.cuda.set_rng_state_all(rng[1])
            torch.cuda.empty_cache()


def refine_with_probe(plan: Plan, model: Any, c: Config) -> Plan:
    """Correct a dry-run plan with measured peaks at two micro-batch sizes (fit peak = α + β·micro)."""
    per_process = plan.micro_batch_size * plan.grad_accum_steps
    fixed = bool(c.micro_batch_size or c.grad_accum_steps)
    candidates = [plan.micro_batch_size] if fixed else [d for d in range(per_process, 0, -1) if per_process % d == 0]
    upper = plan.micro_batch_size
    lower = next((d for d in candidates if d < upper), None)
    sizes = [b for b in (lower, upper) if b]

    def measured(b: int) -> int:
        return measure_window(model, c, micro=b, tokens=plan.worst_case_tokens, accum=max(per_process // b, 1),
                              precision=plan.precision)

    points = {b: measured(b) for b in sizes}
    if len(points) == 2:
        slope = (points[upper] - points[lower]) / (upper - lower)
        fit = {b: points[lower] + slope * (b - lower) for b in candidates}
    else:
        fit = {upper: points[upper]}
    tensors_dry = plan.predicted_peak_bytes - plan.breakdown["overhead"]
    for b in sorted((b for b in fit if b <= upper), reverse=True):
        tensors = int(max(fit[b], points.get(b, 0)))
        overhead = CUDA_CONTEXT + int(ALLOCATOR_SLACK * tensors) if plan.device.startswith("cuda") else CPU_RUNTIME
        if plan.budget_bytes is None or tensors + overhead <= SAFETY * plan.budget_bytes:
            # The measured total, split like the dry run: the fixed terms stay, the rest is activations.
            breakdown = {k: plan.breakdown[k] for k in ("weights", "optimizer_state", "gradients")}
            breakdown["logits"] = plan.breakdown["logits"] * b // upper
            breakdown["activations"] = max(0, tensors - sum(breakdown.values()))
            breakdown["overhead"] = overhead
            note = f"Probe measured {_gib(points[upper])} at micro-batch {upper} (dry run: {_gib(tensors_dry)})."
            return dataclasses.replace(plan, micro_batch_size=b, grad_accum_steps=per_process // b,
                                       predicted_peak_bytes=sum(breakdown.values()), breakdown=breakdown,
                                       method="probe", notes=plan.notes + (note,))
    raise PlanError([f"The probe measured {_gib(points[min(points)])} at micro-batch {min(points)}, over "
                     f"{SAFETY:.0%} of memory_budget_gb={c.memory_budget_gb:g}: raise the budget, lower max_length, or "
                     "set gradient_checkpointing=true or lora=true."])


def _levels(c: Config, notes: list[str]) -> list[tuple[str, bool, str, bool]]:
    """The escalation ladder as (name, checkpointing, optimizer, lora), respecting what the user fixed."""
    ckpt_allowed = c.gradient_checkpointing != "false"
    lora_allowed = c.lora != "false"
    base_ckpt = c.gradient_checkpointing == "true"
    base_lora = c.lora == "true"
    eight_bit = c.optimizer == "adamw" and _has_8bit_optimizer()
    if c.optimizer == "adamw" and not eight_bit:
        notes.append("8-bit AdamW skipped: it needs bitsandbytes on a CUDA GPU.")
    ladder = [("plain", base_ckpt, c.optimizer, base_lora)]
    if ckpt_allowed and not base_ckpt:
        ladder.append(("gradient checkpointing", True, c.optimizer, base_lora))
    if eight_bit:
        ladder.append(("8-bit optimizer", ckpt_allowed, "adamw_8bit", base_lora))
    if lora_allowed and not base_lora:
        ladder.append(("LoRA", ckpt_allowed, "adamw_8bit" if eight_bit else c.optimizer, True))
    return ladder


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def render(plan: Plan) -> str:
    """The plan as a readable table."""
    budget = _gib(plan.budget_bytes) if plan.budget_bytes else "none given"
    rows = [
        ("batch", f"{plan.micro_batch_size} micro × {plan.grad_accum_steps} accumulation × {plan.num_processes} "
                  f"process(es) = {plan.effective_batch_size} effective"),
        ("precision", plan.precision),
        ("gradient checkpointing", "on" if plan.gradient_checkpointing else "off"),
        ("LoRA", "on" if plan.lora else "off"),
        ("optimizer", plan.optimizer),
        ("worst-case micro-batch", f"{plan.micro_batch_size} × {plan.worst_case_tokens} tokens"),
        ("device", plan.device),
        ("budget", budget),
        ("predicted peak", f"{_gib(plan.predicted_peak_bytes)} ({plan.method})"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("")
    total = max(plan.predicted_peak_bytes, 1)
    for term, value in plan.breakdown.items():
        bar = "█" * round(30 * value / total)
        lines.append(f"  {term.ljust(16)} {value / 2**20:10.1f} MiB  {bar}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
