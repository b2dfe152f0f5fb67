"""Each task kind's case for the kind contract (tests/test_contract.py): one module per kind in `registry.names()`,
named after the kind, that defines `CASE` and the pytest fixtures it names (the conftest loads every module here as
a plugin, so a kind's own test file uses the same fixtures).

A kind without a module here fails the contract, so a new kind cannot skip it. A case is small on purpose: a model
of two layers of width 32 built from its config (no download) with the bundled tokenizer, a few dozen rows of
uneven lengths whose count leaves a short last window, and the config keys the kind needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COUNTS = ("sample", "token", "pair")


@dataclass(frozen=True)
class Case:
    """How the contract trains, resumes, runs the CLI on, adapts and plans one kind."""

    model: str  # the fixture of the kind's tiny model folder
    data: str  # the fixture of its small dataset (a file path)
    counts: str  # what the loss is counted over (one of COUNTS): which real two-process launch stands for it
    values: dict[str, Any]  # config keys of every run of the kind, `task` included
    batch: int  # the effective batch: the data's row count must leave a shorter last window
    micro: int  # the accumulated run's micro-batch: (micro, batch / micro) must train as (batch, 1)
    predict: tuple[str, ...]  # inputs for `finetune predict`
    predicted: frozenset[str]  # the keys every prediction record has
    # Accumulation variants: extra config keys, each checked on its own; the first is the one the other checks use.
    variants: dict[str, dict[str, Any]] = field(default_factory=lambda: {"plain": {}})
    lora: bool = True  # whether the kind trains with LoRA adapters
    # The kind's headline metrics (registry entry `metrics`) this case's data yields, where the kind reports some of
    # them only for some shapes of data (embedding: retrieval metrics for pairs, correlations for scored pairs).
    # Empty: all of them.
    metrics: tuple[str, ...] = ()
    # Kind-specific checks of the CLI's trained run folder and its printed predictions.
    check_run: Callable[[Path, list[dict]], None] | None = None
    # A known gap: why `finetune eval` of the run does not repeat its last evaluation yet. The contract then expects
    # that check to fail (strictly, so that the fix is noticed and this is removed).
    eval_gap: str = ""
    # Step metrics that count a margin's sign where every margin is exactly zero at the first step (DPO's policy is
    # its reference then): float rounding picks the sign there, so the contract compares them from the second step.
    tied_at_start: tuple[str, ...] = ()
    # Config keys whose values are fixtures besides the model and the data (distillation's `teacher_model`), by key.
    fixtures: dict[str, str] = field(default_factory=dict)
