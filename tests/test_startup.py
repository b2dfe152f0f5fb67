"""What a start costs: a plan made once is reused while nothing it depends on changes, the start event says how
long the start took, and loss.png is drawn after the run without holding it up."""

from __future__ import annotations

import json
import time

import pytest
from conftest import run_train

from finetune.config.schema import from_dict
from finetune.engine.runtime import seconds_since_process_start
from finetune.plan import estimate, planner
from finetune.run.rundir import plot_loss_in_background

CPU = ("cpu", 64 * 2**30)

# These tests are about a plan read back: each starts from an empty plan cache of its own.
pytestmark = pytest.mark.fresh_plans


def _no_dry_run(*args, **kwargs):
    raise AssertionError("the dry run ran although an identical plan was cached")


def test_a_second_run_with_the_same_settings_reuses_the_plan(tmp_path, monkeypatch, tiny_bert, cls_csv):
    settings = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 16, "max_steps": 1}
    run_train(tmp_path / "first", **settings)
    first = json.loads((tmp_path / "first" / "plan.json").read_text())
    monkeypatch.setattr(estimate, "model_skeleton", _no_dry_run)
    _, events, _ = run_train(tmp_path / "second", **settings)
    second = json.loads((tmp_path / "second" / "plan.json").read_text())
    assert (first["method"], second["method"]) == ("dry-run", "cached dry-run")
    assert {**second, "method": "dry-run", "time": first["time"]} == first  # time: corrected by the first run
    start = events[0]
    # The process's age when the run started: in-process here, so below the test process's age now (however long the
    # suite has run before this test).
    assert start["event"] == "start" and 0 < start["startup_s"] <= seconds_since_process_start()
    assert events[1]["event"] == "step" and events[1]["time"] >= start["time"]


def _plan(c, lengths=(20, 5, 30)):
    plan, _ = planner.plan_run(c, list(lengths), ["neg", "pos"], num_processes=1, device="cpu")
    return plan


@pytest.mark.parametrize("change", [{"max_length": 16}, {"memory_budget_gb": 4}, {"model": "tiny_gpt2"},
                                   {"effective_batch_size": 8}, {"lora": "true"}])
def test_a_change_the_plan_depends_on_plans_again(change, monkeypatch, request, tiny_bert):
    base = from_dict({"model": tiny_bert, "dataset": "x.csv", "effective_batch_size": 16, "plan_probe": "false"})
    if change.get("model") == "tiny_gpt2":
        change = {"model": request.getfixturevalue("tiny_gpt2"), "task": "causal_lm"}
    made = []
    monkeypatch.setattr(planner, "make_plan", lambda *a, make=planner.make_plan, **k: made.append(1) or make(*a, **k))
    assert _plan(base).method == "dry-run" and _plan(base).method == "cached dry-run" and len(made) == 1
    changed = base.replace(**change)
    # A shorter max_length is a different worst case: the lengths the data gives are truncated to it.
    lengths = [16, 5, 16] if "max_length" in change else (20, 5, 30)
    assert _plan(changed, lengths).method == "dry-run" and len(made) == 2
    assert _plan(changed, lengths).method == "cached dry-run" and len(made) == 2


def test_a_corrupt_cache_file_is_planned_again(tmp_path, tiny_bert):
    c = from_dict({"model": tiny_bert, "dataset": "x.csv", "effective_batch_size": 16, "plan_probe": "false"})
    _plan(c)
    (cached,) = (tmp_path / "cache" / "finetune" / "plans").glob("*.json")
    cached.write_text('{"micro_batch_size": 4')  # cut short
    assert _plan(c).method == "dry-run"
    cached.write_text('{"micro_batch_size": 4}')  # from another version of the plan
    assert _plan(c).method == "dry-run"
    assert _plan(c).method == "cached dry-run"


def test_loss_png_is_drawn_where_the_readme_says_after_the_run(tmp_path, tiny_bert, cls_csv):
    run_train(tmp_path / "r", model=tiny_bert, dataset=cls_csv, effective_batch_size=16, max_steps=2)
    png = tmp_path / "r" / "loss.png"
    deadline = time.monotonic() + 120
    while not png.is_file() and time.monotonic() < deadline:  # drawn by a background process
        time.sleep(0.2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    png.unlink()
    assert plot_loss_in_background(tmp_path / "r").wait(timeout=120) == 0 and png.stat().st_size > 1000
