"""What the page shows, as pure functions of a run's events and a plan: text, frames for the plots, progress."""

from __future__ import annotations

import html
import math
import time
from typing import Any

import pandas as pd

from app.jobs import JobStatus
from app.mapping import in_form_words
from finetune.config.schema import read_yaml
from finetune.data.chat import describe_dropped
from finetune.data.segments import Segmentation
from finetune.kinds import registry as kinds

GIB = 1024**3
# A finished run's headline metrics, every kind's (its registry entry), then the loss: a run has only its own kind's.
HEADLINE_METRICS = (*dict.fromkeys(m for n in kinds.names() for m in kinds.entry(n).metrics), "loss")
MAX_PLOT_POINTS = 1000  # the whole curve is re-sent each update; beyond this, every k-th training step is shown
STATE_TITLES = {"idle": "Ready", "starting": "Starting", "running": "Training", "stopping": "Stopping",
                "stopped": "Stopped", "done": "Done", "failed": "Failed"}


def _since_last_start(events: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    if not starts:
        return None, []
    return events[starts[-1]], events[starts[-1] + 1:]


def loss_frame(events: list[dict[str, Any]]) -> pd.DataFrame:
    """Training and evaluation loss per optimizer step, long format (step, loss, split), for `loss_chart_html`."""
    train = [(e["step"], e["loss"]) for e in events if e.get("event") == "step"]
    evals = [(e["step"], e["metrics"]["loss"]) for e in events
             if e.get("event") == "eval" and "loss" in e.get("metrics", {})]
    # A resumed run repeats no steps, but a run restarted with overwrite could: keep each step's latest value.
    train = list(dict(train).items())
    if len(train) > MAX_PLOT_POINTS:
        stride = -(-len(train) // MAX_PLOT_POINTS)
        train = train[::stride] + ([train[-1]] if (len(train) - 1) % stride else [])
    rows = [(s, float(v), "train") for s, v in train] + [(s, float(v), "eval") for s, v in evals]
    rows += _task_rows(events)
    frame = pd.DataFrame(rows, columns=["step", "loss", "split"])
    return frame.astype({"step": "int64", "loss": "float64", "split": "str"})


SERIES_COLOURS = {"train": "#1d4ed8", "eval": "#c2410c"}  # 6.7:1 and 5.2:1 on white: lines and text both readable
TASK_COLOURS = ("#1d4ed8", "#c2410c", "#047857", "#7e22ce", "#b45309", "#be123c")
CHART_W, CHART_H, PAD_L, PAD_R, PAD_T, PAD_B = 640, 240, 56, 16, 12, 34


def _colour(split: str, order: list[str]) -> str:
    if split in SERIES_COLOURS:
        return SERIES_COLOURS[split]
    tasks = sorted({s.split("/", 1)[1] for s in order if "/" in s})
    return TASK_COLOURS[tasks.index(split.split("/", 1)[1]) % len(TASK_COLOURS)] if "/" in split else "#374151"


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    """About `n` round values from lo to hi (1, 2 or 5 times a power of ten apart)."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


REWARD_CURVES = ("rewards/margins", "rewards/accuracies")  # preference runs' evaluation metrics, TRL's names


def reward_frame(events: list[dict[str, Any]]) -> pd.DataFrame:
    """A preference run's reward margin and accuracy at each evaluation (step, loss, split as in `loss_frame`;
    the value in `loss`); empty for other runs."""
    rows = [(e["step"], float(e["metrics"][name]), name) for name in REWARD_CURVES for e in events
            if e.get("event") == "eval" and isinstance(e.get("metrics", {}).get(name), (int, float))]
    frame = pd.DataFrame(rows, columns=["step", "loss", "split"])
    return frame.astype({"step": "int64", "loss": "float64", "split": "str"})


def curves_html(events: list[dict[str, Any]]) -> str | None:
    """The run's charts: the loss, then (a preference run) its reward curves beside it; None before any point."""
    frame, rewards = loss_frame(events), reward_frame(events)
    if not len(frame):
        return None
    extra = loss_chart_html(rewards, title="Rewards at each evaluation", points=True) if len(rewards) else ""
    return loss_chart_html(frame) + extra


def loss_chart_html(frame: pd.DataFrame, title: str = "Loss per optimizer step", points: bool = False) -> str:
    """The loss curves as an SVG the page draws itself: every split in its colour from the first update, evaluation
    (or, with `points`, every series) as points on its line (a single eval is still visible), and a legend above the
    chart that cannot be cut off."""
    if not len(frame):
        return ""
    splits = list(dict.fromkeys(frame.split))
    x_lo, x_hi = float(frame.step.min()), float(frame.step.max())
    y_lo, y_hi = float(frame.loss.min()), float(frame.loss.max())
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    margin = (y_hi - y_lo) * 0.05 or max(abs(y_hi) * 0.05, 0.05)
    y_lo, y_hi = y_lo - margin, y_hi + margin
    inner_w, inner_h = CHART_W - PAD_L - PAD_R, CHART_H - PAD_T - PAD_B

    def at(step: float, loss: float) -> tuple[float, float]:
        return (PAD_L + (step - x_lo) / (x_hi - x_lo) * inner_w, PAD_T + (y_hi - loss) / (y_hi - y_lo) * inner_h)

    parts = [f'<rect x="{PAD_L}" y="{PAD_T}" width="{inner_w}" height="{inner_h}" fill="none" stroke="#9ca3af"/>']
    for y in _ticks(y_lo, y_hi):
        _, py = at(x_lo, y)
        parts.append(f'<line x1="{PAD_L}" x2="{PAD_L + inner_w}" y1="{py:.1f}" y2="{py:.1f}" stroke="#e5e7eb"/>'
                     f'<text x="{PAD_L - 6}" y="{py + 4:.1f}" text-anchor="end">{y:.4g}</text>')
    for x in _ticks(x_lo, x_hi, 6):
        if float(x).is_integer():
            px, _ = at(x, y_lo)
            parts.append(f'<text x="{px:.1f}" y="{PAD_T + inner_h + 16}" text-anchor="middle">{int(x)}</text>')
    parts.append(f'<text x="{PAD_L + inner_w / 2}" y="{CHART_H - 2}" text-anchor="middle">optimizer step</text>')
    for split in splits:
        rows = frame[frame.split == split].sort_values("step")
        points = [at(float(s), float(v)) for s, v in zip(rows.step, rows.loss, strict=True)]
        colour = _colour(split, splits)
        dash = ' stroke-dasharray="6 3"' if split.startswith("eval") else ""
        path = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(points))
        parts.append(f'<path data-split="{html.escape(split)}" d="{path}" fill="none" stroke="{colour}" '
                     f'stroke-width="2"{dash}/>')
        if split.startswith("eval") or points:
            parts += [f'<circle data-split="{html.escape(split)}" cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{colour}"/>'
                      for x, y in points]
    key_dash = ' stroke-dasharray="5 3"'
    legend = " ".join(
        f'<span class="ft-key"><svg width="22" height="10" aria-hidden="true"><line x1="1" x2="21" y1="5" y2="5" '
        f'stroke="{_colour(s, splits)}" stroke-width="3"{key_dash if s.startswith("eval") else ""}/></svg>'
        f'{html.escape(s)}</span>' for s in splits)
    return (f'<div class="ft-chart"><div class="ft-legend"><b>{html.escape(title)}</b> {legend}</div>'
            f'<svg viewBox="0 0 {CHART_W} {CHART_H}" role="img" aria-label="{html.escape(title)}: '
            f'{html.escape(", ".join(splits))}">{"".join(parts)}</svg></div>')


def _task_rows(events: list[dict[str, Any]]) -> list[tuple[int, float, str]]:
    """A multi-task run's curves: each task's training loss (`train/<task>`) and evaluation loss (`eval/<task>`)."""
    steps = [e for e in events if e.get("event") == "step" and e.get("task_losses")]
    if len(steps) > MAX_PLOT_POINTS:
        steps = steps[:: -(-len(steps) // MAX_PLOT_POINTS)]
    rows = [(e["step"], float(v), f"train/{task}") for e in steps for task, v in e["task_losses"].items()]
    rows += [(e["step"], float(v), f"eval/{key.removesuffix('/loss')}") for e in events if e.get("event") == "eval"
             for key, v in e.get("metrics", {}).items() if key.endswith("/loss")]
    return rows


def eta_seconds(events: list[dict[str, Any]]) -> float | None:
    """Seconds left, from the pace of the optimizer steps since the latest start."""
    start, after = _since_last_start(events)
    steps = [e for e in after if e.get("event") == "step"]
    if start is None or len(steps) < 2:
        return None
    done_steps = steps[-1]["step"] - steps[0]["step"]
    if done_steps <= 0:
        return None
    per_step = (steps[-1]["time"] - steps[0]["time"]) / done_steps
    return max(0.0, (start["total_steps"] - steps[-1]["step"]) * per_step)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_html(status: JobStatus) -> str:
    """A progress bar with step/total, percentage and ETA."""
    if status.progress is None:
        label = {"idle": "No run yet.", "starting": "Starting: loading the data and the model…"}.get(
            status.state, STATE_TITLES.get(status.state, status.state))
        return f'<div class="ft-progress"><progress max="1" value="0"></progress><span>{html.escape(label)}</span>' \
            '</div>'
    step, total = status.progress
    parts = [f"step {step} / {total}", f"{100 * step / max(total, 1):.0f}%"]
    last_step = status.last("step")
    if last_step:
        parts.append(f"epoch {last_step['epoch']:.2f}")
    eta = eta_seconds(status.events)
    if status.state == "running" and eta is not None:
        parts.append(f"ETA {_duration(eta)}")
    elif status.state == "done":
        parts.append("finished")
    text = " · ".join(parts)
    return (f'<div class="ft-progress"><progress max="{total}" value="{step}" aria-label="Training progress">'
            f'</progress><span>{html.escape(text)}</span></div>')


def stats_markdown(status: JobStatus) -> str:
    """The latest step's figures: loss, learning rate, grad norm, throughput, skipped fp16 steps, last eval."""
    step = status.last("step")
    if step is None:
        return ""
    parts = [f"**loss** {step['loss']:.4f}", f"**lr** {step['lr']:.2e}", f"**grad norm** {step['grad_norm']:.3g}",
             f"**samples/s** {step['samples_per_s']:.1f}", f"**skipped fp16 steps** {step['skipped']}"]
    last_eval = status.last("eval")
    if last_eval:
        shown = ", ".join(f"{k} {v:.4f}" for k, v in last_eval["metrics"].items())
        parts.append(f"**eval @ {last_eval['step']}** {shown}")
    return " · ".join(parts)


def data_lines(facts: dict[str, Any] | None) -> list[str]:
    """What `long_documents` did to the data, from a start event or a plan: one line per data set, then any
    warning."""
    lines, warnings = [], []
    for name, key in (("training data", "segmentation"), ("evaluation data", "eval_segmentation")):
        counts = (facts or {}).get(key)
        if isinstance(counts, dict):
            lines.append(f"{name}: {Segmentation(**counts).sentence()}")
            warnings += [f"⚠️ {counts['warning']}"] if counts.get("warning") else []
    return lines + warnings


def status_markdown(status: JobStatus) -> str:
    """One line on the run's state (with the error message of a failed run), then what became of its data."""
    title = STATE_TITLES.get(status.state, status.state)
    if status.state == "idle":
        return "**Ready.** Check the plan, then press *Start training*."
    where = f" — `{status.run_dir}`" if status.run_dir else ""
    # An ended run says so: a refusal of the next Start, shown beside it, is not read as this run's news.
    text = f"Last run: **{title}**{where}" if status.state in ("stopped", "done", "failed") else f"**{title}**{where}"
    data = "".join(f"\n\n{line}" for line in data_lines(status.last("start")))
    if status.state == "failed":
        message = in_form_words(status.message) if status.message else \
            "The run failed without a message; see the log below."
        return f"{text}\n\n❌ {message}{data}"
    if status.state == "done":
        metrics = final_metrics(status)
        shown = ", ".join(f"{k} {metrics[k]:.4f}" for k in HEADLINE_METRICS if isinstance(metrics.get(k), (int, float)))
        return f"{text}{' — ' + shown if shown else ''}{data}"
    return f"{text}\n\n{status.message}{data}" if status.message else text + data


def try_kind(status: JobStatus) -> str | None:
    """What Try it offers for the finished run: "chat" (a causal LM trained on conversations, answered through its
    chat template, as `finetune predict` decides), "generate" (another causal LM), "classify", or None before a
    finished model."""
    if status.model_dir is None or status.run_dir is None:
        return None
    config = status.run_dir / "config.yaml"
    options = read_yaml(config) if config.is_file() else {}
    task = options.get("task", "classification")
    if task == "preference":  # a tuned causal LM: chatted with when it has a chat template, as `chat` needs
        return "chat" if has_chat_template(status.model_dir) else "generate"
    if task != "causal_lm":
        return "classify"
    return "chat" if options.get("messages_column") else "generate"


def has_chat_template(model_dir: Any) -> bool:
    """Whether a saved model folder has a chat template (its own file, or in its tokenizer config)."""
    import json
    from pathlib import Path

    folder = Path(model_dir)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def hub_markdown(status: JobStatus, on_space: bool) -> str:
    """How the run's last push went; on a Space (whose disk does not last) a finished, unpushed run is told to push."""
    push = status.last("push")
    if push and push.get("url"):
        return f"✅ Pushed to [{push['repo_id']}]({push['url']})."
    note = f"⚠️ The push to {push['repo_id']} failed: {push.get('error')}" if push else ""
    if on_space and status.state == "done":
        advice = ("💡 This Space's disk is wiped when the Space restarts: push the model to the Hub (or download "
                  "it) to keep it.")
        note = f"{note}\n\n{advice}" if note else advice
    return note


def trackers_markdown(report_to: list[str], run_dir: Any) -> str:
    """How to open the run's local tracker dashboards, as commands to type where the app runs."""
    from finetune.run.tracking import dashboard_command

    commands = dashboard_command(report_to, run_dir) if run_dir else []
    others = [t for t in report_to if t not in ("tensorboard", "trackio")]
    lines = [f"Dashboard: `{c}`" for c in commands]
    if others:
        lines.append(f"Also logged to {', '.join(others)} (see that service's own page).")
    return "\n\n".join(lines)


def final_metrics(status: JobStatus) -> dict[str, Any]:
    """The `done` event's metrics (empty until the run finishes)."""
    done = status.last("done")
    return dict(done["metrics"]) if done and status.state == "done" else {}


def _event_line(event: dict[str, Any], total: int | None) -> str | None:
    kind = event.get("event")
    clock = time.strftime("%H:%M:%S", time.localtime(event.get("time", 0)))
    if kind == "start":
        what = "resumed" if event.get("resumed") else "started"
        return (f"{clock} {what} at step {event['step']} of {event['total_steps']}: micro-batch "
                f"{event['micro_batch_size']} × accumulation {event['grad_accum_steps']} × {event['num_processes']} "
                "process(es) = "
                f"{event['effective_batch_size']}, {event['precision']} on {event['device']}"
                + "".join(f"\n{clock} {what} data: {describe_dropped(event[key])}"
                          for what, key in (("training", "dropped_rows"), ("evaluation", "dropped_eval_rows"))
                          if event.get(key))
                + "".join(f"\n{clock} {line}" for line in data_lines(event)))
    if kind == "step":
        return (f"{clock} step {event['step']}/{total or '?'} loss {event['loss']:.4f} lr {event['lr']:.2e} "
                f"grad {event['grad_norm']:.3g} {event['samples_per_s']:.1f} samples/s")
    if kind == "eval":
        return f"{clock} eval @ {event['step']}: " + ", ".join(f"{k} {v:.4f}" for k, v in event["metrics"].items())
    if kind == "checkpoint":
        return f"{clock} checkpoint {event['checkpoint']}"
    if kind == "stopped":
        return f"{clock} stopped at step {event['step']} (checkpoint {event['checkpoint']})"
    if kind == "done":
        return f"{clock} done: model in {event['model_dir']}"
    if kind == "error":
        return f"{clock} error: {event['message']}"
    if kind == "push":
        where = event.get("url") or f"{event['repo_id']} failed: {event.get('error')}"
        return f"{clock} push: {where}"
    return None


def log_text(status: JobStatus, lines: int = 12) -> str:
    """The last events as readable lines, then whatever the child printed (warnings, errors)."""
    # The total comes from the latest start, which may be older than the events shown (not "step 193/?").
    total = next((e["total_steps"] for e in reversed(status.events) if e.get("event") == "start"), None)
    out = []
    for e in status.events[-200:]:
        if e.get("event") == "start":
            total = e["total_steps"]
        line = _event_line(e, total)
        if line:
            out.append(line)
    text = "\n".join(out[-lines:])
    if status.output_tail.strip():
        text += ("\n\n" if text else "") + "--- output of the training process ---\n" + status.output_tail
    return text


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
    lines += data_lines(plan)  # `finetune plan --json` adds what long_documents does to the data
    notes = [f"- {note}" for note in plan_notes(plan)]
    return "\n\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "")


def plan_frame(plan: dict[str, Any]) -> pd.DataFrame:
    """One row per term of the predicted peak, then the peak and the budget, in GiB."""
    rows = [(term_label(term, plan), float(b) / GIB, "term") for term, b in (plan.get("breakdown") or {}).items()
            if isinstance(b, (int, float)) and b > 0]  # a term of nothing (no logits kept) is no part
    if isinstance(plan.get("predicted_peak_bytes"), (int, float)):
        rows.append(("predicted peak", plan["predicted_peak_bytes"] / GIB, "predicted peak"))
    if plan.get("budget_bytes"):
        rows.append(("budget", float(plan["budget_bytes"]) / GIB, "budget"))
    return pd.DataFrame(rows, columns=["part", "GiB", "kind"])


BAR_COLOURS = {"term": "#2563eb", "predicted peak": "#1e3a8a"}
MIN_BAR_PCT = 1.5  # a part too small to see still gets a sliver, and its number beside it
BUDGET_IN_SCALE = 1.5  # a budget up to this much above the peak is drawn on the same scale (as a marker)


def plan_chart_html(plan: dict[str, Any]) -> str:
    """The peak and its parts as horizontal bars scaled to the peak (parts small next to the budget stay
    readable), each with its size; the budget a marker line when it is near the peak, else said in words."""
    frame = plan_frame(plan)
    bars = frame[frame.kind != "budget"]
    if not len(bars):
        return ""
    peak = float(bars.GiB.max())
    budget = float(frame[frame.kind == "budget"].GiB.iloc[0]) if (frame.kind == "budget").any() else None
    scale = max(peak, budget) if budget is not None and budget <= BUDGET_IN_SCALE * peak else peak
    scale = scale or 1.0
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
    return (f'<div class="ft-plan-chart" role="img" aria-label="Predicted peak and its parts">{"".join(rows)}'
            f'<p class="ft-bar-caption">{html.escape(caption)}</p></div>')


def _size(n: float) -> str:
    if n < 1024**2:
        return f"{n / 1024:.0f} KiB"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 1024**2:.1f} MiB"
