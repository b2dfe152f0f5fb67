"""The loss charts the app draws itself, as SVG: the Run panel's training and evaluation loss (each task's too, in a
multi-task run; a preference or reward run's reward curves beside it; a GRPO run's reward, mean ± std, and its
completions' length), and the Runs tab's comparison of several runs.

Drawn by the app, not `gr.LinePlot`: Gradio 6.31 fixes a plot's colours from its first data (an eval split that
comes later got no colour until a reload) and cuts its legend off below the frame.
"""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd

from finetune import registry as kinds

MAX_PLOT_POINTS = 1000  # the whole curve is re-sent each update; beyond this, every k-th training step is shown


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
CHART_W, CHART_H, PAD = 640, 220, 6  # the drawing's units; its axes' numbers sit outside it, in the page's


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


# The metric curves the kinds declare (their entries' `curves`: GRPO's reward ± its standard deviation, its
# completions' length), each drawn for a run whose events carry the metric.
METRIC_CURVES = tuple(dict.fromkeys(curve for e in kinds.ENTRIES.values() for curve in e.curves))


def metric_frame(events: list[dict[str, Any]], name: str, std: str | None = None) -> pd.DataFrame:
    """Metric `name` of each optimizer step (`train`, from the step events' metrics) and evaluation (`eval`), as
    `loss_frame` lays it out (the value in `loss`), with `lo` and `hi` = value ∓ metric `std` (NaN without one);
    empty for a run whose events do not carry it."""
    def rows(kind: str) -> list[tuple[int, float, float]]:
        out = {}
        for e in events:
            metrics = e.get("metrics") or {}
            if e.get("event") == kind and isinstance(metrics.get(name), (int, float)):
                spread = metrics.get(std) if std else None
                out[e["step"]] = (float(metrics[name]), float(spread) if isinstance(spread, (int, float)) else math.nan)
        return [(step, v, sd) for step, (v, sd) in out.items()]  # a step restarted with overwrite: its latest

    train = rows("step")
    if len(train) > MAX_PLOT_POINTS:
        stride = -(-len(train) // MAX_PLOT_POINTS)
        train = train[::stride] + ([train[-1]] if (len(train) - 1) % stride else [])
    data = [(step, v, split, v - sd, v + sd) for split, part in (("train", train), ("eval", rows("eval")))
            for step, v, sd in part]
    frame = pd.DataFrame(data, columns=["step", "loss", "split", "lo", "hi"])
    return frame.astype({"step": "int64", "loss": "float64", "split": "str", "lo": "float64", "hi": "float64"})


def curves_html(events: list[dict[str, Any]]) -> str | None:
    """The run's charts: the loss, then (a preference run) its reward curves, (a GRPO run) its reward with its
    spread and its completions' length; None before any point."""
    frame, rewards = loss_frame(events), reward_frame(events)
    if not len(frame):
        return None
    extra = loss_chart_html(rewards, title="Rewards at each evaluation", points=True) if len(rewards) else ""
    for name, std, title in METRIC_CURVES:
        curve = metric_frame(events, name, std or None)
        extra += loss_chart_html(curve, title=title) if len(curve) else ""
    return loss_chart_html(frame) + extra


def loss_chart_html(frame: pd.DataFrame, title: str = "Loss per optimizer step", points: bool = False) -> str:
    """The loss curves as an SVG the page draws itself: every split in its colour from the first update, evaluation
    (or, with `points`, every series) as points on its line (a single eval is still visible), and a legend above the
    chart that cannot be cut off.

    The axes' numbers are HTML beside the SVG, not SVG text: the lines scale with the width of the page, the
    numbers keep their size (SVG text in a 640-wide drawing shown 330 px wide was 6 px high)."""
    if not len(frame):
        return ""
    splits = list(dict.fromkeys(frame.split))
    x_lo, x_hi = float(frame.step.min()), float(frame.step.max())
    y_lo, y_hi = float(frame.loss.min()), float(frame.loss.max())
    banded = "lo" in frame and "hi" in frame and bool(frame.lo.notna().any())  # a spread around each value
    if banded:
        y_lo, y_hi = min(y_lo, float(frame.lo.min())), max(y_hi, float(frame.hi.max()))
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    margin = (y_hi - y_lo) * 0.05 or max(abs(y_hi) * 0.05, 0.05)
    y_lo, y_hi = y_lo - margin, y_hi + margin
    inner_w, inner_h = CHART_W - 2 * PAD, CHART_H - 2 * PAD

    def at(step: float, loss: float) -> tuple[float, float]:
        return (PAD + (step - x_lo) / (x_hi - x_lo) * inner_w, PAD + (y_hi - loss) / (y_hi - y_lo) * inner_h)

    parts = [f'<rect x="{PAD}" y="{PAD}" width="{inner_w}" height="{inner_h}" fill="none" stroke="#9ca3af"/>']
    ticks = []
    for y in _ticks(y_lo, y_hi):
        _, py = at(x_lo, y)
        parts.append(f'<line x1="{PAD}" x2="{PAD + inner_w}" y1="{py:.1f}" y2="{py:.1f}" stroke="#e5e7eb"/>')
        ticks.append(f'<span class="ft-tick ft-ty" style="top:{100 * py / CHART_H:.2f}%">{y:.4g}</span>')
    for x in _ticks(x_lo, x_hi, 6):
        if float(x).is_integer():
            px, _ = at(x, y_lo)
            ticks.append(f'<span class="ft-tick ft-tx" style="left:{100 * px / CHART_W:.2f}%">{int(x)}</span>')
    for split in splits:
        rows = frame[frame.split == split].sort_values("step")
        xy = [at(float(s), float(v)) for s, v in zip(rows.step, rows.loss, strict=True)]
        colour = _colour(split, splits)
        if banded:
            parts += _band(split, rows, colour, at)
        dash = ' stroke-dasharray="6 3"' if split.startswith("eval") else ""
        path = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(xy))
        parts.append(f'<path data-split="{html.escape(split)}" d="{path}" fill="none" stroke="{colour}" '
                     f'stroke-width="2"{dash}/>')
        if split.startswith("eval") or points:
            parts += [f'<circle data-split="{html.escape(split)}" cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{colour}"/>'
                      for x, y in xy]
    key_dash = ' stroke-dasharray="5 3"'
    legend = " ".join(
        f'<span class="ft-key"><svg width="22" height="10" aria-hidden="true"><line x1="1" x2="21" y1="5" y2="5" '
        f'stroke="{_colour(s, splits)}" stroke-width="3"{key_dash if s.startswith("eval") else ""}/></svg>'
        f'{html.escape(s)}</span>' for s in splits)
    return (f'<div class="ft-chart"><div class="ft-legend"><b>{html.escape(title)}</b> {legend}</div>'
            f'<div class="ft-plot"><div class="ft-area">'
            f'<svg viewBox="0 0 {CHART_W} {CHART_H}" role="img" aria-label="{html.escape(title)}: '
            f'{html.escape(", ".join(splits))}">{"".join(parts)}</svg>{"".join(ticks)}</div></div>'
            '<div class="ft-axis-title">optimizer step</div></div>')


def _band(split: str, rows: pd.DataFrame, colour: str, at: Any) -> list[str]:
    """The spread of a series (its `lo` to `hi`): a shaded area under a training line, a whisker at each
    evaluation point (a few points, which an area would join across the steps between them)."""
    rows = rows[rows.lo.notna() & rows.hi.notna()]
    if not len(rows):
        return []
    tops = [at(float(s), float(h)) for s, h in zip(rows.step, rows.hi, strict=True)]
    bottoms = [at(float(s), float(lo)) for s, lo in zip(rows.step, rows.lo, strict=True)]
    name = html.escape(split)
    if split.startswith("eval") or len(rows) == 1:
        return [f'<line data-band="{name}" x1="{x:.1f}" x2="{x:.1f}" y1="{top:.1f}" y2="{bottom:.1f}" '
                f'stroke="{colour}" stroke-width="1.5"/>' for (x, top), (_, bottom) in zip(tops, bottoms, strict=True)]
    outline = " ".join(f"{x:.1f},{y:.1f}" for x, y in [*tops, *reversed(bottoms)])
    return [f'<polygon data-band="{name}" points="{outline}" fill="{colour}" fill-opacity="0.15" stroke="none"/>']


def _task_rows(events: list[dict[str, Any]]) -> list[tuple[int, float, str]]:
    """A multi-task run's curves: each task's training loss (`train/<task>`) and evaluation loss (`eval/<task>`)."""
    steps = [e for e in events if e.get("event") == "step" and e.get("task_losses")]
    if len(steps) > MAX_PLOT_POINTS:
        steps = steps[:: -(-len(steps) // MAX_PLOT_POINTS)]
    rows = [(e["step"], float(v), f"train/{task}") for e in steps for task, v in e["task_losses"].items()]
    rows += [(e["step"], float(v), f"eval/{key.removesuffix('/loss')}") for e in events if e.get("event") == "eval"
             for key, v in e.get("metrics", {}).items() if key.endswith("/loss")]
    return rows


