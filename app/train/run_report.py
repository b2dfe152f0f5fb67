"""The Run panel as pure functions of the job's status: the state line, the progress bar with its ETA, the latest
step's figures, the log tail, how to open the run's tracker dashboards, and (a GRPO run) the latest evaluation's
sample completions with their rewards."""

from __future__ import annotations

import html
from typing import Any

from app.local.training import JobStatus
from app.mapping import in_form_words
from app.report import HEADLINE_METRICS, STATE_TITLES, data_lines, event_line, final_metrics
from finetune.kinds.rewards import SAMPLE_FIELDS


def _since_last_start(events: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    if not starts:
        return None, []
    return events[starts[-1]], events[starts[-1] + 1:]


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
    """A progress bar with step/total, percentage and ETA; a sweep's line of trials above it."""
    if status.sweep is not None:
        line = html.escape(status.sweep.line)
        return f'<div class="ft-sweep-progress" id="sweep-progress">{line}</div>' + _bar(status)
    return _bar(status)


def _bar(status: JobStatus) -> str:
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


def trackers_markdown(report_to: list[str], run_dir: Any) -> str:
    """How to open the run's local tracker dashboards, as commands to type where the app runs."""
    from finetune.run.tracking import dashboard_command

    commands = dashboard_command(report_to, run_dir) if run_dir else []
    others = [t for t in report_to if t not in ("tensorboard", "trackio")]
    lines = [f"Dashboard: `{c}`" for c in commands]
    if others:
        lines.append(f"Also logged to {', '.join(others)} (see that service's own page).")
    return "\n\n".join(lines)


def log_text(status: JobStatus, lines: int = 12) -> str:
    """The last events as readable lines, then whatever the child printed (warnings, errors)."""
    # The total comes from the latest start, which may be older than the events shown (not "step 193/?").
    total = next((e["total_steps"] for e in reversed(status.events) if e.get("event") == "start"), None)
    out = []
    for e in status.events[-200:]:
        if e.get("event") == "start":
            total = e["total_steps"]
        line = event_line(e, total)
        if line:
            out.append(line)
    text = "\n".join(out[-lines:])
    if status.output_tail.strip():
        text += ("\n\n" if text else "") + "--- output of the training process ---\n" + status.output_tail
    return text




SAMPLE_CHARS = 300  # of a prompt or completion in the table (the event keeps more)


def latest_samples(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest `samples` event (a few held-out prompts, completions and rewards after an evaluation), or None."""
    return next((e for e in reversed(events) if e.get("event") == "samples" and isinstance(e.get("rows"), list)),
                None)


def samples_html(events: list[dict[str, Any]]) -> str:
    """The latest evaluation's sample completions as a table: prompt, completion, reward, then each reward
    function's score; "" for a run without any (only a kind that generates while it trains writes them)."""
    latest = latest_samples(events)
    if latest is None or not latest["rows"]:
        return ""
    rows = [r for r in latest["rows"] if isinstance(r, dict)]
    names = list(dict.fromkeys(k for r in rows for k in (r.get("rewards") or {})))
    head = "".join(f"<th>{html.escape(h)}</th>" for h in (*SAMPLE_FIELDS, *names))

    def cell(value: Any) -> str:
        if value is None:
            return "<td>—</td>"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return f'<td class="ft-num">{value:.3g}</td>'
        shown = str(value)
        shown = shown if len(shown) <= SAMPLE_CHARS else shown[:SAMPLE_CHARS - 1] + "…"
        return f'<td style="white-space:pre-wrap">{html.escape(shown)}</td>'

    body = "".join("<tr>" + "".join(cell(r.get(f)) for f in SAMPLE_FIELDS)
                   + "".join(cell((r.get("rewards") or {}).get(n)) for n in names) + "</tr>" for r in rows)
    return (f'<div class="ft-samples"><b>Sample completions at step {int(latest.get("step", 0))}</b> (held-out '
            f'prompts, as the evaluation generated and scored them)<table><thead><tr>{head}</tr></thead>'
            f'<tbody>{body}</tbody></table></div>')
