"""The evaluation's batch size (`eval_batch_size`): the largest batch of lm-evaluation-harness requests, at most
MOST_REQUESTS, whose forward without gradients fits the memory budget at the longest request.

The same arithmetic as a training plan, with a forward-only window: the weights, the activations of the layers
alive at once (no gradients are kept), and the logits with their log-softmax (`estimate_forward`), on the model's
skeleton of fake tensors, no weights read. The harness sorts its requests longest first and pads each batch to its
longest, so its first batch is the worst case: `batch_size` requests of the longest request's tokens."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.plan.estimate import SAFETY, estimate_forward
from finetune.plan.plan import GIB, human_size
from finetune.plan.skeleton import model_skeleton

MOST_REQUESTS = 64  # a larger batch gains little on a GPU that 64 requests already fill


@dataclass(frozen=True, kw_only=True)
class EvalPlan:
    """How to evaluate within the budget: the harness's batch size, the longest request, and the predicted peak."""

    batch_size: int
    tokens: int  # the longest request, in tokens (capped at the model's context)
    budget_bytes: int
    predicted_peak_bytes: int
    breakdown: dict[str, int]
    device: str
    method: str = "dry-run"
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """The plan as benchmarks.json keeps it."""
        return {**dataclasses.asdict(self), "notes": list(self.notes)}


def eval_batch_size(c: Config, *, tokens: int, budget: int, device: str, lora: bool = False,
                    given: int | None = None) -> EvalPlan:
    """The largest batch (at most MOST_REQUESTS) of `tokens`-token requests whose forward fits SAFETY of `budget`
    bytes on `device` (a `PlanError` when not even one does); `given`: the plan of that batch size, with a note
    when it does not fit. `c` names the model (and for a LoRA adapter, its base and the adapter's shape)."""
    skeleton = model_skeleton(c, 0, checkpointing=False, lora=lora)
    peaks: dict[int, dict[str, int]] = {}

    def terms(b: int) -> dict[str, int]:
        if b not in peaks:
            peaks[b] = estimate_forward(skeleton, micro=b, tokens=tokens, device=device)
        return peaks[b]

    def fits(b: int) -> bool:
        return sum(terms(b).values()) <= SAFETY * budget

    notes: tuple[str, ...] = ()
    if given is not None:
        chosen = given
        if not fits(given):
            notes = (f"--batch-size {given} is predicted to peak at {human_size(sum(terms(given).values()))}, over "
                     f"{SAFETY:.0%} of the budget ({human_size(budget)}): a smaller one would fit.",)
    elif not fits(1):
        peak, weights = sum(terms(1).values()), terms(1)["weights"]
        least = math.ceil(peak / SAFETY / GIB * 1000) / 1000
        raise PlanError([f"Evaluating {c.model!r} does not fit the memory budget of {human_size(budget)}: one "
                         f"request of {tokens} tokens is predicted to peak at {human_size(peak)} (weights "
                         f"{human_size(weights)}); give --memory-budget-gb of at least {least:g}, or use a device "
                         "with more memory."])
    else:  # the peak grows with the batch: the largest that fits, by bisection
        low, high = 1, MOST_REQUESTS
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        chosen = low
    breakdown = terms(chosen)
    return EvalPlan(batch_size=chosen, tokens=tokens, budget_bytes=budget, predicted_peak_bytes=sum(breakdown.values()),
                    breakdown=breakdown, device=device, notes=notes)


def render_eval(plan: EvalPlan) -> str:
    """The evaluation's plan in one line: the batch, the longest request and the predicted peak within the budget."""
    return (f"batch {plan.batch_size} × {plan.tokens} tokens (the longest request): predicted peak "
            f"{human_size(plan.predicted_peak_bytes)} of {human_size(plan.budget_bytes)} on {plan.device} ("
            + ", ".join(f"{term} {human_size(value)}" for term, value in plan.breakdown.items()) + ")"
            + "".join(f"; {note}" for note in plan.notes))
