"""The Runs tab and sweeps and benchmarks: a sweep's trials listed together (its best marked, a pruned trial called
so), and a run's lm-evaluation-harness scores compared beside its base's. Run folders are written as `finetune
sweep` and `finetune eval --benchmarks` leave them, without training."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from app.door.access import Access
from app.local.training import JobManager
from app.runs.listing import benchmarks_frame, list_runs
from app.tabs import handlers
from finetune.run.rundir import MARKER


def _run(runs: Path, name: str, started: float, end: str, sweep: dict | None = None) -> Path:
    """A run folder whose events start at `started` and end with `end` (done or stopped)."""
    run = runs / name
    run.mkdir(parents=True)
    (run / MARKER).write_text("{}")
    events = [{"event": "start", "time": started, "total_steps": 4, "step": 0},
              {"event": "step", "time": started + 1, "step": 2, "loss": 0.5},
              {"event": end, "time": started + 2, "step": 4 if end == "done" else 2,
               **({"metrics": {"loss": 0.4}} if end == "done" else {"checkpoint": ""})}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if sweep is not None:
        (run / "sweep.json").write_text(json.dumps({"sweep": "lr", "direction": "minimize", **sweep}))
    return run


def test_a_sweeps_trials_are_listed_together_with_the_best_marked(tmp_path):
    runs = tmp_path / "runs"
    _run(runs, "lr-trial-000", 100.0, "done", {"trial": 0, "state": "complete", "value": 0.40})
    _run(runs, "plain-old", 150.0, "done")
    _run(runs, "lr-trial-001", 200.0, "done", {"trial": 1, "state": "complete", "value": 0.30})
    _run(runs, "plain-new", 250.0, "done")
    _run(runs, "lr-trial-002", 300.0, "stopped", {"trial": 2, "state": "pruned", "value": None})
    _run(runs, "plain-newest", 400.0, "done")
    listed = list_runs(runs)
    # Newest first, the sweep's trials together where its newest trial would be.
    assert [r.name for r in listed] == ["plain-newest", "lr-trial-002", "lr-trial-001", "lr-trial-000",
                                        "plain-new", "plain-old"]
    shown = handlers(runs, JobManager(runs)).runs.refresh(None)
    status = dict(zip(shown.table.Run, shown.table.Status, strict=True))
    # minimize: the lower loss is the best; the pruned trial is never resumable.
    assert status["lr-trial-001"] == "Done · sweep lr #1 ★ best"
    assert status["lr-trial-000"] == "Done · sweep lr #0"
    assert status["lr-trial-002"] == "Pruned · sweep lr #2"
    assert status["plain-new"] == "Done"


def test_a_runs_benchmarks_are_compared_beside_its_base(tmp_path):
    runs = tmp_path / "runs"
    run = _run(runs, "chat", 100.0, "done")
    _run(runs, "other", 200.0, "done")
    score = {"acc": {"value": 0.875, "stderr": 0.069}, "acc_norm": {"value": 0.8, "stderr": None}}
    (run / "benchmarks.json").write_text(json.dumps({
        "harness": "lm-eval 0.4.13",
        "model": {"tasks": {"tiny_sentiment": {"metrics": score}}},
        "base": {"tasks": {"tiny_sentiment": {"metrics": {"acc": {"value": 0.5, "stderr": 0.1043}}}}}}))
    frame = benchmarks_frame(list_runs(runs))
    assert frame.values.tolist() == [["chat", "tiny_sentiment", "acc", "0.8750 ± 0.0690", "0.5000 ± 0.1043"],
                                     ["chat", "tiny_sentiment", "acc_norm", "0.8000", ""]]
    ctl = handlers(runs, JobManager(runs)).runs
    shown = ctl.select(["chat", "other"])
    assert shown.benchmarks["visible"] and shown.benchmarks["value"].Run.tolist() == ["chat", "chat"]
    assert not ctl.select(["other"]).benchmarks["visible"]  # no scores: no table


def test_the_runs_tab_evaluates_a_finished_run_in_a_child_whose_sentence_lands_in_its_log(tmp_path):
    """The Evaluate section runs `finetune eval RUN --benchmarks …` as a bounded child; an encoder run is refused by
    the harness's own check, in the child's log, in one sentence."""
    runs = tmp_path / "runs"
    run = _run(runs, "cls", 100.0, "done")
    (run / "metrics.json").write_text('{"loss": 0.4}')
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"],
                                                           "model_type": "bert"}))
    _run(runs, "stopped", 200.0, "stopped")
    ctl = handlers(runs, JobManager(runs)).runs
    assert ctl.evaluate(["cls"], " , ") == ("Name one or more benchmarks: registry tasks (hellaswag, arc_easy) or "
                                            "task YAML files.")
    assert ctl.evaluate(["stopped"], "hellaswag").startswith("Only a finished run can be evaluated")
    assert ctl.evaluate(["cls"], "hellaswag", True, 0).startswith("The limit is a number of examples")
    said = ctl.evaluate(["cls"], "hellaswag", True, 5)
    assert said.startswith("Evaluating `cls`") and said.endswith(f"`finetune eval {run} --benchmarks hellaswag --base "
                                                                 "--limit 5`.")
    child = ctl.state.jobs.evaluations.child
    assert child.proc.wait(timeout=300) == 2
    log = (run / "benchmarks.log").read_text()
    # On a shared server a task file would be read from the server's disk: registry names only.
    (runs / "alice").mkdir()
    (run).rename(runs / "alice" / "cls")
    shared = handlers(runs, JobManager(runs), access=Access("password", accounts=(("alice", "a"),))).runs
    assert shared.evaluate(["cls"], "hellaswag,../../x.yaml", request=SimpleNamespace(username="alice")) == (
        "⚠️ A shared server evaluates registry tasks only (hellaswag, arc_easy): a task file would be read from "
        "the server's disk.")
    last = log.strip().splitlines()[-1]
    assert last.startswith(f"error: '{run}' holds a text classification model, which lm-evaluation-harness does "
                           "not score"), log
