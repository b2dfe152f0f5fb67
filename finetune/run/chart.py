"""loss.png drawn with Pillow: lines and markers over a grid, the axes' ticks and labels, a legend.

Every run ends by drawing its loss curve, and matplotlib's import alone is about 0.7 s of CPU (1.6 s with the
drawing, more on a busy machine): a sweep's trials, a test suite's runs and a Space's visitors pay it once per run.
Pillow (which matplotlib itself is built on) imports in a twentieth of that. The picture is drawn at twice its size
and scaled down, so its lines are smooth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

WIDTH, HEIGHT = 700, 400  # the picture's size in pixels (matplotlib's 7 × 4 inches at 100 dpi, as before)
SCALE = 2  # drawn at twice the size, then scaled down: anti-aliased lines and text
MARGIN = {"left": 72, "right": 16, "top": 14, "bottom": 52}
GRID, AXES, TEXT = (222, 222, 222), (0, 0, 0), (0, 0, 0)
COLOURS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))  # matplotlib's first four ("tab:")
FONT_SIZE = 12


@dataclass(frozen=True)
class Series:
    """One curve: its legend label, its points (x, y), and whether each point gets a round marker."""

    label: str
    points: Sequence[tuple[float, float]]
    markers: bool = False


def nice_ticks(low: float, high: float, most: int = 7, integer: bool = False) -> list[float]:
    """Round tick values covering [low, high]: steps of 1, 2, 2.5 or 5 times a power of ten, at most `most` of them
    (whole numbers only when `integer`)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return [0.0, 1.0]
    if high <= low:  # one value: room on both sides (a whole step of it for whole numbers)
        room = 1.0 if integer else (0.5 if low == 0 else abs(low) * 0.05)
        low, high = low - room, high + room
    power = 10 ** math.floor(math.log10((high - low) / max(most - 1, 1)))
    for multiple in (1, 2, 2.5, 5, 10, 20, 25, 50):
        step = multiple * power
        if integer and (step < 1 or step % 1):
            continue
        first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
        if last - first + 1 <= most:
            return [round(k * step, 12) for k in range(first, last + 1)]
    raise AssertionError("unreachable: a step of 50 powers covers any range in 7 ticks")


def tick_label(value: float, step: float) -> str:
    """A tick's text with as many decimals as its step needs (0.25 steps show two, 5 steps none)."""
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0
    while step > 0 and decimals < 12 and abs(step * 10**decimals - round(step * 10**decimals)) > 1e-6:
        decimals += 1  # a step like 0.25 needs one more
    text = f"{value:.{decimals}f}"
    return text.lstrip("-") if float(text) == 0 else text  # no "-0.00" for a value a rounding error below 0


def line_chart(series: Sequence[Series], out: Path, *, x_label: str, y_label: str, integer_x: bool = True) -> None:
    """Draw `series` as a PNG at `out` (written whole: a temporary file renamed into place). Points that are not
    finite are left out, as matplotlib leaves them out; with no points at all the axes are drawn empty."""
    from PIL import Image, ImageDraw, ImageFont

    s = SCALE
    font = ImageFont.load_default(size=FONT_SIZE * s)
    image = Image.new("RGB", (WIDTH * s, HEIGHT * s), "white")
    draw = ImageDraw.Draw(image)
    runs = [_finite_runs(one.points) for one in series]  # a NaN or infinite loss breaks its line, as in matplotlib
    finite = [point for lines in runs for line in lines for point in line]
    xs = [x for x, _ in finite] or [0.0, 1.0]
    ys = [y for _, y in finite] or [0.0, 1.0]
    x_ticks = nice_ticks(min(xs), max(xs), integer=integer_x)
    y_ticks = nice_ticks(min(ys), max(ys))
    # The axes span the data and a little room (as matplotlib's 5 % margins), not the outer ticks.
    x_low, x_high = _span(min(xs), max(xs), x_ticks)
    y_low, y_high = _span(min(ys), max(ys), y_ticks)
    x_labels = {v: tick_label(v, _step(x_ticks)) for v in x_ticks if x_low <= v <= x_high}
    y_labels = {v: tick_label(v, _step(y_ticks)) for v in y_ticks if y_low <= v <= y_high}
    left = (MARGIN["left"] + max(0, max((len(t) for t in y_labels.values()), default=0) - 6) * 7) * s
    box = (left, MARGIN["top"] * s, (WIDTH - MARGIN["right"]) * s, (HEIGHT - MARGIN["bottom"]) * s)

    def at(x: float, y: float) -> tuple[float, float]:
        return (box[0] + (x - x_low) / (x_high - x_low) * (box[2] - box[0]),
                box[3] - (y - y_low) / (y_high - y_low) * (box[3] - box[1]))

    tick = 4 * s
    for value, text in x_labels.items():
        px = at(value, y_low)[0]
        draw.line([(px, box[1]), (px, box[3])], fill=GRID, width=s)
        draw.line([(px, box[3]), (px, box[3] + tick)], fill=AXES, width=s)
        draw.text((px, box[3] + tick + 2 * s), text, fill=TEXT, font=font, anchor="ma")
    for value, text in y_labels.items():
        py = at(x_low, value)[1]
        draw.line([(box[0], py), (box[2], py)], fill=GRID, width=s)
        draw.line([(box[0] - tick, py), (box[0], py)], fill=AXES, width=s)
        draw.text((box[0] - tick - 3 * s, py), text, fill=TEXT, font=font, anchor="rm")
    for number, (one, lines) in enumerate(zip(series, runs, strict=True)):
        colour = COLOURS[number % len(COLOURS)]
        for line in lines:
            pixels = [at(x, y) for x, y in line]
            if len(pixels) > 1:
                draw.line(pixels, fill=colour, width=(2 if one.markers else 1) * s + s // 2, joint="curve")
            if one.markers or len(pixels) == 1:
                for px, py in pixels:
                    r = 3 * s
                    draw.ellipse((px - r, py - r, px + r, py + r), fill=colour)
    draw.rectangle(box, outline=AXES, width=s)
    draw.text(((box[0] + box[2]) / 2, (HEIGHT - 6) * s), x_label, fill=TEXT, font=font, anchor="md")
    label = Image.new("RGB", (int(draw.textlength(y_label, font=font)) + 4 * s, (FONT_SIZE + 6) * s), "white")
    ImageDraw.Draw(label).text((2 * s, 0), y_label, fill=TEXT, font=font)
    label = label.rotate(90, expand=True)
    image.paste(label, (4 * s, int((box[1] + box[3]) / 2 - label.height / 2)))
    _legend(draw, font, list(series), box)
    image = image.resize((WIDTH, HEIGHT), Image.Resampling.LANCZOS)
    tmp = out.with_name(out.name + ".tmp")  # renamed when complete: a reader never sees half a picture
    image.save(tmp, format="PNG", optimize=False)
    tmp.replace(out)


def _finite_runs(points: Sequence[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """The points in runs of finite ones: a point that is not finite ends a run."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if math.isfinite(x) and math.isfinite(y):
            runs[-1].append((x, y))
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if run]


def _step(ticks: list[float]) -> float:
    return ticks[1] - ticks[0] if len(ticks) > 1 else 1.0


def _span(low: float, high: float, ticks: list[float]) -> tuple[float, float]:
    if high <= low:  # one value: in the middle, the axis reaching its farther tick on both sides
        room = max(low - ticks[0], ticks[-1] - low)
        return low - room, low + room
    room = (high - low) * 0.05
    return low - room, high + room


def _legend(draw: object, font: object, series: list[Series], box: tuple[float, float, float, float]) -> None:
    """The labels with a stroke of their colour, in a framed box at the plot's upper right."""
    labelled = [(number, one) for number, one in enumerate(series) if one.label]
    if not labelled:
        return
    s = SCALE
    row, sample = (FONT_SIZE + 6) * s, 24 * s
    width = sample + 8 * s + max(int(draw.textlength(one.label, font=font)) for _, one in labelled) + 12 * s
    right, top = box[2] - 8 * s, box[1] + 8 * s
    frame = (right - width, top, right, top + row * len(labelled) + 8 * s)
    draw.rounded_rectangle(frame, radius=3 * s, fill="white", outline=(204, 204, 204), width=s)
    for row_number, (number, one) in enumerate(labelled):
        colour = COLOURS[number % len(COLOURS)]
        y = top + 4 * s + row * row_number + row / 2
        x = frame[0] + 6 * s
        draw.line([(x, y), (x + sample, y)], fill=colour, width=2 * s)
        if one.markers:
            r = 3 * s
            draw.ellipse((x + sample / 2 - r, y - r, x + sample / 2 + r, y + r), fill=colour)
        draw.text((x + sample + 8 * s, y), one.label, fill=TEXT, font=font, anchor="lm")
