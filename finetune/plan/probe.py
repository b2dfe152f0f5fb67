"""The probe (`plan_probe`): a dry-run plan corrected by the peaks of real windows measured on the loaded model."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from finetune.config.schema import Config
from finetune.engine.recurrence import Recurrence
from finetune.errors import PlanError
from finetune.plan.estimate import SAFETY, overhead
from finetune.plan.memory import measure_window
from finetune.plan.plan import Plan, gib
from finetune.plan.search import micro_candidates


def probe_enabled(c: Config) -> bool:
    """`plan_probe`: auto measures on a GPU (where kernels and the allocator differ from the dry run)."""
    return c.plan_probe == "true" or (c.plan_probe == "auto" and torch.cuda.is_available())


def refine_with_probe(plan: Plan, model: Any, c: Config, longest: int | None = None) -> Plan:
    """Correct a dry-run plan with measured peaks at two micro-batch sizes (fit peak = α + β·micro).

    `c` is the config the plan was made from: where it leaves the split open, a smaller micro-batch may be chosen.
    With segment recurrence, `longest` (the longest document) sets the segments and the carried memory."""
    candidates = micro_candidates(c, plan.batch)
    upper = plan.batch.micro_batch_size
    lower = next((d for d in candidates if d < upper), None)
    sizes = [b for b in (lower, upper) if b]
    planned = plan.apply(c)  # measure with what training will use (the plan's optimizer, precision)

    recurrence = Recurrence.of(c)
    memory, segments = None, 1
    if recurrence:  # unknown lengths (a stream): the full memory, as the dry run assumed
        longest = longest or c.max_document_length or recurrence.segment_length + recurrence.memory_length
        memory, segments = recurrence.memory_reached(longest), recurrence.num_segments(longest)

    def measured(b: int) -> int:
        return measure_window(model, planned, micro=b, tokens=plan.worst_case_tokens,
                              accum=max(plan.batch.per_process // b, 1) * segments, precision=plan.precision,
                              memory=memory, padded=plan.padded and b > 1)

    points = {b: measured(b) for b in sizes}
    if len(points) == 2:
        slope = (points[upper] - points[lower]) / (upper - lower)
        fit = {b: points[lower] + slope * (b - lower) for b in candidates}
    else:
        fit = {upper: points[upper]}
    tensors_dry = plan.predicted_peak_bytes - plan.breakdown["overhead"]
    for b in sorted((b for b in fit if b <= upper), reverse=True):
        tensors = int(max(fit[b], points.get(b, 0)))
        extra = overhead(tensors, plan.device)
        if plan.budget_bytes is None or tensors + extra <= SAFETY * plan.budget_bytes:
            # The measured total, split like the dry run: the fixed terms stay, the rest is activations.
            fixed = ("weights", "quantized_weights", "quantization_constants", "dequantized_layer", "optimizer_state",
                     "gradients")
            breakdown = {k: plan.breakdown[k] for k in fixed if k in plan.breakdown}
            breakdown["logits"] = plan.breakdown["logits"] * b // upper
            if "carried_cache" in plan.breakdown:
                breakdown["carried_cache"] = plan.breakdown["carried_cache"] * b // upper
            breakdown["activations"] = max(0, tensors - sum(breakdown.values()))
            breakdown["overhead"] = extra
            note = f"Probe measured {gib(points[upper])} at micro-batch {upper} (dry run: {gib(tensors_dry)})."
            return dataclasses.replace(plan, batch=plan.batch.with_micro(b),
                                       predicted_peak_bytes=sum(breakdown.values()), breakdown=breakdown,
                                       method="probe", notes=plan.notes + (note,))
    raise PlanError([f"The probe measured {gib(points[min(points)])} at micro-batch {min(points)}, over "
                     f"{SAFETY:.0%} of memory_budget_gb={c.memory_budget_gb:g}: raise the budget, lower max_length, or "
                     "set gradient_checkpointing=true or lora=true."])
