"""loss.png's chart (finetune/run/chart.py): round ticks, lines where the points are, gaps where a loss is not finite,
and a picture for every run, even one without a point."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from finetune.run.chart import COLOURS, HEIGHT, WIDTH, Series, line_chart, nice_ticks, tick_label
from finetune.run.rundir import plot_loss

# Run again by .ci/floors: the font call needs Pillow 10.1, the declared floor.
pytestmark = pytest.mark.floors


@pytest.mark.parametrize(("low", "high", "integer", "expected"), [
    (0.31, 2.87, False, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]),
    (1, 300, True, [0, 50, 100, 150, 200, 250, 300]),
    (1, 3, True, [1, 2, 3]),  # whole steps only: no 1.5 for an optimizer step
    (0.6931, 0.6931, False, [0.64, 0.66, 0.68, 0.70, 0.72, 0.74]),  # one value: room around it
    (5, 5, True, [4, 5, 6]),
])
def test_ticks_are_round_and_cover_the_values(low, high, integer, expected):
    ticks = nice_ticks(low, high, integer=integer)
    assert ticks == pytest.approx(expected)
    assert ticks[0] <= low and ticks[-1] >= high and len(ticks) <= 7


def test_tick_labels_have_the_decimals_their_step_needs():
    assert [tick_label(v, 0.5) for v in (0.0, 0.5, 2.0)] == ["0.0", "0.5", "2.0"]
    assert [tick_label(v, 0.25) for v in (0.25, 1.0)] == ["0.25", "1.00"]
    assert [tick_label(v, 50) for v in (0, 150)] == ["0", "150"]
    assert tick_label(-1e-17, 0.02) == "0.00"


def _pixels_of(image: Image.Image, colour: tuple[int, int, int], tolerance: int = 40) -> list[tuple[int, int]]:
    """Where the picture is close to `colour` (lines are anti-aliased: their middle is the colour itself)."""
    width, r, g, b = image.width, *colour
    return [(i % width, i // width) for i, (pr, pg, pb) in enumerate(image.convert("RGB").getdata())
            if abs(pr - r) + abs(pg - g) + abs(pb - b) <= tolerance]


def _plot_columns(points: list[tuple[int, int]], legend_left: int) -> set[int]:
    return {x for x, _ in points if x < legend_left}


def test_the_lines_follow_their_points_and_a_nan_leaves_a_gap(tmp_path):
    out = tmp_path / "loss.png"
    train = [(step, 3.0 - step * 0.1) for step in range(1, 11)]
    train[4] = (5, math.nan)  # a NaN step (an fp16 overflow skipped): no line through it
    line_chart([Series("train", train), Series("eval", [(5, 2.6), (10, 2.2)], markers=True)], out,
               x_label="optimizer step", y_label="loss")
    image = Image.open(out)
    assert image.format == "PNG" and image.size == (WIDTH, HEIGHT)
    blue, orange = _pixels_of(image, COLOURS[0]), _pixels_of(image, COLOURS[1])
    assert blue and orange
    # The train line falls from left to right: its leftmost pixels are above (smaller y) its rightmost ones.
    legend_left = WIDTH - 110
    line = [(x, y) for x, y in blue if x < legend_left]
    left, right = min(line), max(line)
    assert left[1] < right[1]
    # Steps 4 to 6 have no line between them: the columns of the middle of that gap hold no blue.
    columns = _plot_columns(line, legend_left)
    xs = sorted(columns)
    step_width = (xs[-1] - xs[0]) / 9  # steps 1..10 span the line's columns
    middle = xs[0] + 4 * step_width  # step 5
    assert not any(abs(x - middle) < step_width * 0.6 for x in columns)
    assert any(abs(x - (middle - 2 * step_width)) < step_width * 0.4 for x in columns)  # step 3 is drawn


def test_a_run_without_steps_still_gets_a_picture(tmp_path):
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({"event": "start", "time": 0}) + "\n")
    plot_loss(events, tmp_path / "loss.png")
    image = Image.open(tmp_path / "loss.png")
    assert image.size == (WIDTH, HEIGHT) and not _pixels_of(image, COLOURS[0])
    assert not (tmp_path / "loss.png.tmp").exists()


def test_plot_loss_draws_train_and_eval_from_the_events(tmp_path):
    events = tmp_path / "events.jsonl"
    records = [{"event": "step", "step": s, "loss": 2.0 / s} for s in range(1, 21)]
    records += [{"event": "eval", "step": 10, "metrics": {"loss": 0.4}},
                {"event": "eval", "step": 20, "metrics": {"loss": 0.3, "accuracy": 0.9}},
                {"event": "eval", "step": 20, "metrics": {"accuracy": 0.9}}]  # no loss: not a point
    events.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_loss(events, tmp_path / "loss.png")
    image = Image.open(tmp_path / "loss.png")
    assert _pixels_of(image, COLOURS[0]) and _pixels_of(image, COLOURS[1])
