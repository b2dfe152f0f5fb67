"""What the page says stays true (issue #42), through the handlers: an empty continuation says so; the note over the
form, the Reproduce box and the Export block follow the run (or the imported file) they describe; a resumed run
stopped while it starts keeps its checkpoint and says so; the Runs table is one table, readable at 400 px."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import gradio as gr
import pandas as pd
from conftest import ROOT

from app.local import training
from app.local.export import ExportChild
from app.local.training import JobManager
from app.mapping import config_yaml, load_config_file
from app.runs.listing import TABLE_COLUMNS, runs_html
from app.tabs import handlers

SAMPLE = str(ROOT / "assets" / "sst2_sample.csv")
SKIP = gr.skip()


def _run(runs: Path, name: str, config: str, *, done: bool = True) -> Path:
    """A run folder as the app leaves it: its launch.yaml and, finished, a done event and a model folder."""
    run = runs / name
    (run / "model").mkdir(parents=True)
    (run / ".finetune-run").write_text("")
    (run / "launch.yaml").write_text(config)
    (run / "config.yaml").write_text(config)
    events = [{"event": "done", "time": time.time(), "step": 1, "metrics": {}, "model_dir": str(run / "model")}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) if done else "")
    return run


def _current(ctl, run: Path) -> None:
    """Make `run` the app's current (last) run."""
    ctl.state.jobs.training._job = training._Job(run_dir=run, config_path=run / "launch.yaml",
                                                 log_path=run / "launch.log", command=["python"], pid=-1,
                                                 proc=None, launched=time.time() - 60)


def test_an_empty_continuation_says_so_as_the_chat_does(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    ctl = handlers(runs, JobManager(runs))
    _current(ctl, _run(runs, "lm", "task: causal_lm\ntext_column: text\n"))
    import finetune.use.predict

    monkeypatch.setattr(finetune.use.predict, "predict",
                        lambda run_dir, texts, **kw: [{"text": t, "generated": ""} for t in texts])
    shown = ctl.tryit.try_it("Once upon a time")
    assert shown.generated["visible"] and shown.generated["value"] == ""
    assert shown.message == "The model generated nothing: it may need more training, or more data."
    monkeypatch.setattr(finetune.use.predict, "predict",
                        lambda run_dir, texts, **kw: [{"text": t, "generated": " there was"} for t in texts])
    assert ctl.tryit.try_it("Once upon a time").message == ""


def test_the_poll_rewrites_the_reproduce_box_and_the_form_note_only_when_the_run_changes(tmp_path):
    runs = tmp_path / "runs"
    ctl = handlers(runs, JobManager(runs))
    first = _run(runs, "first", f"dataset: {SAMPLE}\nmax_steps: 3\n")
    _current(ctl, first)
    shown = ctl.follow.poll(None)
    # A new page: the run's command with its own config (a YAML exported earlier is gone), the reload's note kept.
    assert shown.command == f"finetune train {first / 'launch.yaml'}"
    assert shown.config_yaml == (first / "launch.yaml").read_text() and shown.config_file is None
    assert shown.form_note == SKIP
    # The same run goes on (a new event): an imported config in the box stays as it is.
    with open(first / "events.jsonl", "a") as f:
        f.write(json.dumps({"event": "eval", "time": time.time(), "step": 1, "metrics": {"loss": 0.5}}) + "\n")
    later = ctl.follow.poll(shown.signature)
    assert later.signature != shown.signature
    assert (later.command, later.config_yaml, later.config_file, later.form_note) == (SKIP, SKIP, SKIP, SKIP)
    # A newer run: "The form shows the settings of run first" is no longer true, and the box is the new run's.
    second = _run(runs, "second", f"dataset: {SAMPLE}\nmax_steps: 5\n")
    _current(ctl, second)
    newer = ctl.follow.poll(later.signature)
    assert newer.form_note == ""
    assert newer.command == f"finetune train {second / 'launch.yaml'}"
    assert newer.config_yaml == (second / "launch.yaml").read_text() and newer.config_file is None


def test_import_config_leaves_the_reproduce_box_to_that_config_and_names_it_over_the_form(tmp_path):
    runs = tmp_path / "runs"
    ctl = handlers(runs, JobManager(runs))
    path = tmp_path / "tiny.yaml"
    path.write_text(f"dataset: {SAMPLE}\nmax_steps: 6\n")
    shown = ctl.reproduce.import_config(str(path))
    assert shown.note == "Imported `tiny.yaml`." and shown.values["max_steps"] in (6, "6")
    assert shown.yaml == config_yaml(load_config_file(path))
    assert shown.command == "finetune train tiny.yaml" and shown.file is None
    assert shown.form_note == "The form shows the settings imported from `tiny.yaml`."
    path.write_text("max_steps: many\n")  # refused: the form, its note and the box stay as they are
    refused = ctl.reproduce.import_config(str(path))
    assert refused.note.startswith("⚠️") and (refused.command, refused.file, refused.form_note) == (SKIP, SKIP, SKIP)


def test_the_export_block_speaks_of_the_newer_run_not_of_the_last_export(tmp_path):
    runs = tmp_path / "runs"
    ctl = handlers(runs, JobManager(runs))
    older = _run(runs, "older", f"dataset: {SAMPLE}\n")
    (older / "export").mkdir()
    (older / "export" / "export.json").write_text(json.dumps({"format": "merged", "seconds": 12, "files": {}}))
    _current(ctl, older)
    ended = subprocess.Popen(["true"])
    ended.wait()
    ctl.state.jobs.exports._child = ExportChild(run_dir=older, owner=None, proc=ended, log=older / "export.log",
                                                started=time.time() - 5)
    assert ctl.inference.status()["state"] == "done"  # the current run's own export
    newer = _run(runs, "newer", f"dataset: {SAMPLE}\nmax_steps: 5\n", done=False)
    _current(ctl, newer)
    shown = ctl.inference.status()
    assert shown["run_dir"] is None and shown["state"] == "idle", shown
    assert shown["message"] == "The run has not finished: export it once it is done."


def test_a_resumed_run_stopped_while_it_starts_keeps_its_checkpoint_and_says_so(tmp_path):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    job = training._Job(run_dir=run, config_path=run / "config.yaml", log_path=run / "launch.log",
                        command=["python"], pid=-1, proc=None, launched=time.time(), stop_requested_at=time.time())
    jobs = JobManager(tmp_path / "runs")
    assert jobs._state(job, [], 130, False, "") == ("stopped", "The run was stopped before it saved a checkpoint.")
    (run / "checkpoints" / "step-0000074").mkdir(parents=True)  # saved by the session before the resume
    assert jobs._state(job, [], 130, False, "") == (
        "stopped", "The run was stopped while it started; its checkpoint of step 74 is kept. Resume continues "
                   "from it.")


def test_the_runs_table_is_one_table_whose_header_and_body_share_their_columns():
    frame = pd.DataFrame([["20260101-000000", "Done", "classification", "bundled:all-MiniLM-L6-v2", "20/20",
                           "accuracy 0.7500", "2026-01-01 10:00", "<b>x</b>", "predicted 30 s"]],
                         columns=TABLE_COLUMNS)
    html = runs_html(frame)
    assert html.count("<table>") == 1 and html.count("<th ") == len(TABLE_COLUMNS) == html.count("<td")
    # A region a keyboard can reach and scroll sideways (axe-core: scrollable-region-focusable), named.
    assert '<div class="ft-runs" role="region" aria-label="Your runs" tabindex="0">' in html
    assert "&lt;b&gt;x&lt;/b&gt;" in html and "<b>" not in html  # text, never markup
    # No runs: a sentence, and no empty region to scroll.
    empty = runs_html(pd.DataFrame(columns=TABLE_COLUMNS))
    assert "No runs yet" in empty and "tabindex" not in empty and "<table" not in empty
