"""The Plan panel as pure functions of a plan (what `finetune plan --json` writes): the batch arithmetic, precision,
memory-saving choices and predicted peak in words, and the peak's parts as bars drawn by the app."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from app.mapping import in_form_words
from app.report import data_lines
from finetune.plan import timing

GIB = 1024**3

# The planner's words for how it estimated, and its terms, as a user reads them.
METHOD_WORDS = {"dry-run": "estimated on a weightless copy of the model",
                "cached dry-run": "estimated earlier for the same settings",
                "probe": "measured on a few real training steps"}
TERM_WORDS = {"optimizer_state": "optimizer state", "quantization_constants": "quantization constants",
              "dequantized_layer": "dequantized layer (work buffer)", "carried_cache": "carried memory",
              "logits": "logits", "overhead": "overhead"}
# Notes about savings the planner could not offer: noise on a plan that fits easily (under this share of the budget).
ROOMY = 0.5
SAVING_NOTES = ("8-bit AdamW", "8-bit AdamW and quantized bases skipped")
HOST_PART = "offloaded activations (CPU memory)"  # activation offload's host copies: RAM, not the device's peak


def term_label(term: str, plan: dict[str, Any]) -> str:
    """A breakdown term as the plan view names it; the quantized base names its quantization."""
    if term == "quantized_weights":
        return f"quantized weights ({plan.get('quantization')})"
    if term == "weights" and plan.get("lora") and plan.get("quantization") not in (None, "none"):
        return "unquantized weights"
    return TERM_WORDS.get(term, term.replace("_", " "))


def _roomy(plan: dict[str, Any]) -> bool:
    peak, budget = plan.get("predicted_peak_bytes"), plan.get("budget_bytes")
    return isinstance(peak, (int, float)) and bool(budget) and peak < ROOMY * budget


def plan_notes(plan: dict[str, Any]) -> list[str]:
    """The planner's notes the view shows: a plan far under its budget does not hear of savings it did not need."""
    notes = list(plan.get("notes") or [])
    if _roomy(plan):
        notes = [n for n in notes if not n.startswith(SAVING_NOTES)]
    return [in_form_words(n) for n in notes]


def plan_markdown(plan: dict[str, Any]) -> str:
    """The planner's answer in one readable block: batch arithmetic, precision, memory-saving choices, peak."""
    micro, accum, procs, eff = (plan.get(k) for k in ("micro_batch_size", "grad_accum_steps", "num_processes",
                                                      "effective_batch_size"))
    peak, budget = plan.get("predicted_peak_bytes"), plan.get("budget_bytes")
    quantized = plan.get("lora") and plan.get("quantization") not in (None, "none")
    lines = [f"**micro-batch {micro} × accumulation {accum} × {procs} process(es) = effective batch {eff}**",
             f"precision **{plan.get('precision')}** · gradient checkpointing **"
             f"{'on' if plan.get('gradient_checkpointing') else 'off'}** · LoRA **{'on' if plan.get('lora') else 'off'}"
             f"** · quantization **{plan['quantization'] if quantized else 'none'}** · optimizer "
             f"**{plan.get('optimizer')}** · device **{plan.get('device')}**"]
    if plan.get("activation_offload"):
        lines.append(f"activation offload **on**: the checkpointed layers' inputs wait in CPU memory "
                     f"(**{_size(plan.get('host_bytes') or 0)}** of RAM, not part of the device's peak)")
    if quantized:  # its share is a bar of plan_chart_html's
        lines.append(f"frozen base quantized **{plan['quantization']}** (bitsandbytes), unquantized weights in "
                     f"**{plan.get('base_dtype', 'fp32')}**")
    elif plan.get("lora") and plan.get("base_dtype") not in (None, "fp32"):
        lines.append(f"frozen base in **{plan['base_dtype']}**")
    if isinstance(peak, (int, float)):
        share = f" ({100 * peak / budget:.0f} % of the {budget / GIB:.2f} GiB budget)" if budget else ""
        method = f", {METHOD_WORDS.get(plan['method'], plan['method'])}" if plan.get("method") else ""
        padded = " (shorter samples padded to it)" if plan.get("padded") and isinstance(micro, int) and micro > 1 \
            else ""
        tokens = f" · longest micro-batch {micro} × {plan['worst_case_tokens']} tokens{padded}" \
            if plan.get("worst_case_tokens") else ""
        lines.append(f"predicted peak **{peak / GIB:.2f} GiB**{share}{method}{tokens}")
    breakdown = plan.get("breakdown") or {}
    if breakdown:
        lines.append(" · ".join(f"{term_label(term, plan)} {_size(b)}" for term, b in breakdown.items()
                                if isinstance(b, (int, float)) and b > 0))
    if plan.get("time"):  # finetune.plan.timing: the step time and the wall time, start to Done
        lines.append(f"predicted time **{timing.describe(plan['time'])}**")
    lines += data_lines(plan)  # `finetune plan --json` adds what long_documents does to the data
    notes = [f"- {note}" for note in plan_notes(plan)]
    return "\n\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "")


def plan_frame(plan: dict[str, Any]) -> pd.DataFrame:
    """One row per term of the predicted peak, then the peak, the CPU memory that activation offload takes (a
    part of its own, outside the device's peak) and the budget, in GiB."""
    rows = [(term_label(term, plan), float(b) / GIB, "term") for term, b in (plan.get("breakdown") or {}).items()
            if isinstance(b, (int, float)) and b > 0]  # a term of nothing (no logits kept) is no part
    if isinstance(plan.get("predicted_peak_bytes"), (int, float)):
        rows.append(("predicted peak", plan["predicted_peak_bytes"] / GIB, "predicted peak"))
    if plan.get("activation_offload") and isinstance(plan.get("host_bytes"), (int, float)):
        rows.append((HOST_PART, float(plan["host_bytes"]) / GIB, "host"))
    if plan.get("budget_bytes"):
        rows.append(("budget", float(plan["budget_bytes"]) / GIB, "budget"))
    return pd.DataFrame(rows, columns=["part", "GiB", "kind"])


BAR_COLOURS = {"term": "#2563eb", "predicted peak": "#1e3a8a", "host": "#059669"}
MIN_BAR_PCT = 1.5  # a part too small to see still gets a sliver, and its number beside it
BUDGET_IN_SCALE = 1.5  # a budget up to this much above the peak is drawn on the same scale (as a marker)


def plan_chart_html(plan: dict[str, Any]) -> str:
    """The peak and its parts as horizontal bars scaled to the peak (parts small next to the budget stay
    readable), each with its size; the budget a marker line when it is near the peak, else said in words."""
    frame = plan_frame(plan)
    bars = frame[frame.kind != "budget"]
    if not len(bars):
        return ""
    device = bars[bars.kind != "host"]
    peak = float(device.GiB.max()) if len(device) else 0.0
    budget = float(frame[frame.kind == "budget"].GiB.iloc[0]) if (frame.kind == "budget").any() else None
    scale = max(peak, budget) if budget is not None and budget <= BUDGET_IN_SCALE * peak else peak
    scale = max(scale, float(bars.GiB.max())) or 1.0  # CPU memory may be larger than the device's peak
    marker = f'<div class="ft-budget-mark" style="left:{100 * budget / scale:.1f}%" title="budget"></div>' \
        if budget is not None and budget <= scale else ""
    rows = []
    for part, gib, kind in zip(bars.part, bars.GiB, bars.kind, strict=True):
        width = max(MIN_BAR_PCT, 100 * gib / scale) if gib > 0 else 0
        size = _size(gib * GIB)
        rows.append(f'<div class="ft-bar-row" data-part="{html.escape(part)}"><span class="ft-bar-name">'
                    f'{html.escape(part)}</span><span class="ft-bar-track"><span class="ft-bar" style="width:'
                    f'{width:.1f}%;background:{BAR_COLOURS[kind]}"></span>{marker}</span>'
                    f'<span class="ft-bar-size">{size}</span></div>')
    if budget is None:
        caption = "No budget set: the bars show the predicted peak and its parts."
    elif budget > scale:
        caption = (f"Bars scaled to the predicted peak; the budget of {budget:.2f} GiB is off the scale (the plan "
                   f"uses {100 * peak / budget:.0f} % of it).")
    else:
        caption = f"The grey line is the budget, {budget:.2f} GiB."
    if (bars.kind == "host").any():
        caption += " The green bar is CPU memory (activation offload), outside the device's peak and budget."
    return (f'<div class="ft-plan-chart" role="img" aria-label="Predicted peak and its parts">{"".join(rows)}'
            f'<p class="ft-bar-caption">{html.escape(caption)}</p></div>')


def _size(n: float) -> str:
    if n < 1024**2:
        return f"{n / 1024:.0f} KiB"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 1024**2:.1f} MiB"


