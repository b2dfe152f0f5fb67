"""The planner's reverse questions: the longest context that fits a budget (`finetune plan --longest`), and the
smallest budget that fits a config, each on the cheapest rung the config allows at micro-batch 1."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from finetune.config.batch import resolve_batch
from finetune.config.schema import Config
from finetune.engine.runtime import device_memory, resolve_precision
from finetune.errors import PlanError
from finetune.plan.estimate import SAFETY, estimate, kind_terms, reused_skeleton, rung_kind, worst_case_tokens
from finetune.plan.ladder import OFFLOAD_RUNG, TILED_RUNG, Level, rungs
from finetune.plan.plan import GIB, HOST_SHARE, HostMemory, human_size


def _terms_by_length(c: Config, num_labels: int, step: Level, device_name: str
                     ) -> tuple[Callable[[int], tuple[dict[str, int], int]], int]:
    """On rung `step` at micro-batch 1: a function from a length to the device's terms there and the host's
    offloaded bytes, and the model's positions (the longest length to ask about)."""
    cuda = device_name.startswith("cuda")
    precision = resolve_precision(c.precision, cuda=cuda)
    skeleton, windows = reused_skeleton(c, num_labels, checkpointing=step.checkpointing, lora=step.lora,
                                        precision=precision, offload=step.offload, tiled=step.tiled)
    batch = resolve_batch(c, 1)  # micro-batch 1: the whole batch accumulated
    positions = getattr(skeleton.model.config, "max_position_embeddings", None) or c.max_length
    kind = rung_kind(c, skeleton, chunked=step.chunked, lora=step.lora)

    def terms_at(tokens: int) -> tuple[dict[str, int], int]:
        offloaded: dict[str, int] = {}
        terms = estimate(skeleton, c, kind=kind, micro=1, tokens=tokens, accum=batch.per_process,
                         precision=precision, optimizer=step.optimizer, device=device_name,
                         quantization=step.quantization, windows=windows, host=offloaded)
        terms |= kind_terms(kind, skeleton, cuda=cuda, micro=1, tokens=tokens, precision=precision,
                            window=batch.effective_batch_size)
        return terms, offloaded["offloaded_activations"]

    return terms_at, positions


def longest_context(c: Config, num_labels: int, *, device: tuple[str, int] | None = None,
                    host: HostMemory | None = None, explain: dict[str, int] | None = None) -> tuple[int, str]:
    """The reverse question: the largest `max_length` whose one sample fits the budget at micro-batch 1 on the
    cheapest rung of the ladder that the config allows, and that rung's name (`finetune plan --longest`); with
    activation offload, its host copies fit `host` too (default: this machine's RAM). `explain`, when given,
    receives the terms of the peak at the answer (`finetune plan --longest --explain`)."""
    device_name, _ = device or device_memory()
    cuda = device_name.startswith("cuda")
    if not c.memory_budget_gb:
        raise PlanError(["The longest context that fits needs a budget: set memory_budget_gb."])
    step = rungs(c, [], cuda=cuda, precision=resolve_precision(c.precision, cuda=cuda))[-1]
    terms_at, positions = _terms_by_length(c, num_labels, step, device_name)
    limit, host_limit = SAFETY * c.memory_budget_gb * GIB, HOST_SHARE * (host or HostMemory.here()).bytes

    def peak(tokens: int) -> int:
        """The device's peak, or the host's offloaded bytes in the device limit's units when they are the
        tighter constraint: a length fits when both fit (the max of the two is still piecewise affine)."""
        terms, offloaded = terms_at(tokens)
        return max(sum(terms.values()), math.ceil(offloaded * limit / host_limit))

    tokens = longest_within(peak, limit, min(positions, 131072))
    if explain is not None and tokens:  # the dry run at the answer is kept: no new one
        terms, offloaded = terms_at(tokens)
        explain |= terms | ({"CPU memory (offloaded activations)": offloaded} if offloaded else {})
    return tokens, step.name


def rungs_needed(c: Config, num_labels: int, tokens: int, *, device: tuple[str, int] | None = None
                 ) -> list[tuple[str, int]]:
    """The steps the ladder adds at its top (`auto`: the tiled MLP, activation offload) that the longest context
    of `tokens` was answered with, each with the predicted device peak at `tokens` without it (one more dry run
    each, on its own skeleton): over the budget where the answer needed it."""
    device_name, _ = device or device_memory()
    cuda = device_name.startswith("cuda")
    top = rungs(c, [], cuda=cuda, precision=resolve_precision(c.precision, cuda=cuda))[-1]
    without = [(TILED_RUNG, top._replace(tiled=False), c.tiled_mlp == "auto" and top.tiled),
               (OFFLOAD_RUNG, top._replace(offload=False), c.activation_offload == "auto" and top.offload)]
    return [(name, sum(_terms_by_length(c, num_labels, step, device_name)[0](tokens)[0].values()))
            for name, step, added in without if added]


def explain_longest(c: Config, num_labels: int, tokens: int, terms: dict[str, int], *,
                    device: tuple[str, int] | None = None) -> str:
    """The breakdown of the longest context's peak, largest term first, and what each of the ladder's last steps
    saved there (`finetune plan --longest --explain`)."""
    device_terms = {k: v for k, v in terms.items() if not k.startswith("CPU")}
    total = max(sum(device_terms.values()), 1)
    lines = [f"at {tokens} tokens, predicted peak {human_size(total)}:"]
    for term, value in sorted(terms.items(), key=lambda kv: -kv[1]):
        share = "" if term.startswith("CPU") else f" {value / total:4.0%}"
        lines.append(f"  {term.ljust(34)} {human_size(value):>10}{share}")
    budget = SAFETY * (c.memory_budget_gb or 0) * GIB
    for name, peak in rungs_needed(c, num_labels, tokens, device=device):
        verdict = "needed" if peak > budget else "not needed"
        lines.append(f"{name}: {verdict} (without it: {human_size(peak)} at {tokens} tokens, against "
                     f"{human_size(budget)} allowed)")
    return "\n".join(lines)


FIRST_LENGTH = 1024  # where the search for the longest context starts measuring: a short, quick dry run


def longest_within(peak: Callable[[int], int], limit: float, top: int) -> int:
    """The largest length in [1, top] whose `peak` is at most `limit` (0 when not even one token's is), for a peak
    that grows with the length: what a bisection over the lengths answers, with fewer dry runs.

    For a fixed rung the peak is affine in the length, or piecewise so where a term changes with it (which part of
    the window peaks, the chunked loss's last chunk, eager attention's quadratic scores). So each guess is where
    the straight line through the two measured lengths nearest the edge reaches `limit`, and the search ends where
    a measured length fits and the next one does not: four dry runs for an affine peak, against log2(top) ≈ 17.
    Where the same end of the interval moves twice in a row, the other end's distance from `limit` counts half
    (the Illinois rule, so a curved peak is not approached from one side only), and two steps that did not halve
    the interval are followed by a bisection step."""
    known: dict[int, int] = {}
    lo, bad = 0, top + 1  # every length up to `lo` fits (0: none measured), none from `bad` on (top + 1: unknown)
    guess, widths, moved, weights = min(top, FIRST_LENGTH), [], "", {"lo": 1.0, "bad": 1.0}
    while bad - lo > 1:
        if lo in known and bad in known:
            widths.append(bad - lo)
        bisect = len(widths) >= 3 and 2 * widths[-1] > widths[-3] and (lo + bad) // 2 != guess
        t = (lo + bad) // 2 if bisect else min(max(guess, lo + 1), bad - 1)
        known[t] = peak(t)
        end = "lo" if known[t] <= limit else "bad"
        lo, bad = (t, bad) if end == "lo" else (lo, t)
        other = "bad" if end == "lo" else "lo"
        weights[end] = 1.0
        weights[other] = weights[other] / 2 if end == moved else 1.0
        moved = end
        guess = _secant(known, limit, lo, bad, weights)
    return lo


def _secant(known: dict[int, int], limit: float, lo: int, bad: int, weights: dict[str, float]) -> int:
    """Where the line through the two measured lengths nearest the edge (`lo` fits, `bad` does not, their
    distances from `limit` weighted) reaches `limit`; with one length measured, twice or half of it."""
    if lo in known and bad in known:
        if len(known) >= 3 and (root := _parabola(known, limit, lo, bad)) is not None:
            return root
        below, above = (limit - known[lo]) * weights["lo"], (known[bad] - limit) * weights["bad"]
        return lo + math.floor((bad - lo) * below / (below + above))
    near = sorted(known, reverse=bad not in known)[:2]  # the two longest when all fit, else the two shortest
    if len(near) < 2:
        return 2 * lo if lo in known else bad // 2
    (a, pa), (b, pb) = sorted((t, known[t]) for t in near)
    if pb <= pa:  # flat here: the edge is further on, or (when nothing fits) at the shortest length
        return 2 * b if bad not in known else 1
    return a + math.floor((limit - pa) * (b - a) / (pb - pa))


def _parabola(known: dict[int, int], limit: float, lo: int, bad: int) -> int | None:
    """Where the parabola through `lo`, `bad` and the measured length nearest them reaches `limit`, if it does
    inside the interval: the peak is a parabola in the length where attention keeps its (tokens × tokens) scores
    (eager), a line elsewhere."""
    third = min((t for t in known if t not in (lo, bad)), key=lambda t: min(abs(t - lo), abs(t - bad)))
    (x0, y0), (x1, y1), (x2, y2) = ((t, float(known[t])) for t in (lo, bad, third))
    # Newton's divided differences: y = y0 + d1 (x - x0) + d2 (x - x0)(x - x1).
    d1 = (y1 - y0) / (x1 - x0)
    d2 = ((y2 - y1) / (x2 - x1) - d1) / (x2 - x0)
    # In u = x - x0: d2 u² + (d1 - d2 (x1 - x0)) u + (y0 - limit) = 0.
    a, b, c = d2, d1 - d2 * (x1 - x0), y0 - limit
    if abs(a) < 1e-12 * max(abs(b), 1e-300):
        return None
    disc = b * b - 4 * a * c
    if disc < 0:
        return None
    roots = [(-b + sign * math.sqrt(disc)) / (2 * a) + x0 for sign in (1, -1)]
    inside = [r for r in roots if lo <= r < bad]
    return math.floor(min(inside)) if inside else None


def smallest_budget(c: Config, lengths: Any, num_labels: int, *, device: tuple[str, int] | None = None
                    ) -> tuple[float, str]:
    """The smallest `memory_budget_gb` (GiB, rounded up to 0.01) that fits `c` on the cheapest rung the config
    allows (a 4-bit base where quantization may be used, with the chunked loss where it pays), at micro-batch 1,
    and that rung's name: what a refusal names, for a picker that warns before planning (`device` as `make_plan`)."""
    device_name, _ = device or device_memory()
    cuda = device_name.startswith("cuda")
    precision = resolve_precision(c.precision, cuda=cuda)
    tokens = worst_case_tokens(c, lengths)
    step = rungs(c, [], cuda=cuda, precision=precision)[-1]
    skeleton, windows = reused_skeleton(c, num_labels, checkpointing=step.checkpointing, lora=step.lora,
                                        precision=precision, offload=step.offload, tiled=step.tiled)
    kind = rung_kind(c, skeleton, chunked=step.chunked, lora=step.lora)
    batch = resolve_batch(c, 1)
    terms = estimate(skeleton, c, kind=kind, micro=1, tokens=tokens, accum=batch.per_process, precision=precision,
                     optimizer=step.optimizer, device=device_name, padded=False, quantization=step.quantization,
                     windows=windows)
    terms |= kind_terms(kind, skeleton, cuda=cuda, micro=1, tokens=tokens, precision=precision,
                        window=batch.effective_batch_size)
    return math.ceil(sum(terms.values()) / SAFETY / GIB * 100) / 100, step.name
