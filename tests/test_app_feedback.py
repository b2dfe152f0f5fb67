"""What a new user met in the page (issue #28), through the handlers: a reload refills the form with what was asked
(`auto`), not what the run resolved; "pushing to the Hub" only for a run that pushes; a Stop in the first second
stops a run even when the app ignores SIGINT, and the Runs tab then says "Stopped" as the Train tab does; messages
in the form's words; kind settings only for their kind; a sentence where there is no model yet."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, wait_for_run

from app.local import training
from app.local.training import JobManager, JobStatus
from app.mapping import config_yaml, in_form_words, shown_fields
from app.runs.listing import list_runs
from app.tabs import handlers
from app.tryit.panel import panel
from finetune.config.schema import from_dict

SAMPLE = str(ROOT / "assets" / "sst2_sample.csv")


def _job(run: Path, config: Path) -> training._Job:
    return training._Job(run_dir=run, config_path=config, log_path=run / "launch.log", command=["python"], pid=-1,
                         proc=None, launched=time.time() - 60)


def test_a_reload_after_a_resumed_run_refills_auto_not_the_resolved_settings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    run = runs / "20260101-000000"
    run.mkdir(parents=True)
    (run / ".finetune-run").write_text("")
    asked = from_dict({"dataset": SAMPLE, "max_steps": 20, "memory_budget_gb": 0.2})
    (run / "launch.yaml").write_text(config_yaml(asked))
    # What the run resolved (and what Resume launches with): every `auto` pinned.
    resolved = from_dict({"dataset": SAMPLE, "max_steps": 20, "memory_budget_gb": 0.2, "micro_batch_size": 32,
                          "grad_accum_steps": 1, "gradient_checkpointing": "false", "lora": "false",
                          "quantization": "none", "precision": "fp32", "output_dir": str(run)})
    (run / "config.yaml").write_text(config_yaml(resolved))
    (run / "events.jsonl").write_text(json.dumps({"event": "done", "time": time.time(), "metrics": {}}) + "\n")
    ctl = handlers(runs, JobManager(runs))
    ctl.state.jobs.training._job = _job(run, run / "config.yaml")  # a resumed run's job names config.yaml
    values = ctl.form.running_config().values
    assert (values["gradient_checkpointing"], values["lora"], values["quantization"], values["precision"]) == (
        "auto", "auto", "auto", "auto")
    assert values["micro_batch_size"] in ("", None) and values["grad_accum_steps"] in ("", None)
    assert values["max_steps"] == "20" and values["memory_budget_gb"] in (0.2, "0.2")


def test_done_says_pushing_only_for_a_run_that_pushes(tmp_path):
    jobs = JobManager(tmp_path / "runs")
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    plain, pushing = run / "plain.yaml", run / "push.yaml"
    plain.write_text(yaml.safe_dump({"dataset": SAMPLE}))
    pushing.write_text(yaml.safe_dump({"dataset": SAMPLE, "push_to_hub": "me/model"}))
    done = [{"event": "done", "time": time.time(), "metrics": {}}]
    # The child is still alive after its `done` event (saving, exiting; or uploading when it pushes).
    assert jobs._state(_job(run, plain), done, None, True, "") == ("running", "Training is done; finishing…")
    assert jobs._state(_job(run, pushing), done, None, True, "") == (
        "running", "Training is done; pushing the model to the Hub…")


def test_a_stop_that_lands_while_the_child_imports_is_a_stopped_run_whatever_its_exit_code(tmp_path):
    jobs = JobManager(tmp_path / "runs")
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    job = _job(run, run / "config.yaml")
    interrupted = 'Traceback (most recent call last):\n  File "<frozen abc>", line 106, in __new__\nKeyboardInterrupt\n'
    # An interpreter interrupted inside an import may exit 1 (not 130): the traceback's last line says why.
    assert jobs._state(job, [], 1, False, interrupted)[0] == "failed"  # nobody pressed Stop: it is a failure
    job.stop_requested_at = time.time()
    stopped = ("stopped", "The run was stopped before it saved a checkpoint.")
    assert jobs._state(job, [], 1, False, interrupted) == stopped
    assert jobs._state(job, [], 1, False, "error: something else\n")[0] == "failed"


@pytest.mark.slow
def test_a_stop_at_once_stops_the_run_when_the_app_ignores_sigint_and_runs_says_stopped(tmp_path, monkeypatch,
                                                                                          tiny_bert, cls_csv):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runs = tmp_path / "runs"
    jobs = JobManager(runs)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": tiny_bert, "dataset": cls_csv, "output_dir": str(runs / "r1"),
                                      "effective_batch_size": 8, "eval_fraction": 0.0, "epochs": 40}))
    (runs / "r1").mkdir()
    (runs / "r1" / ".finetune-run").write_text("")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job starts the app
    try:
        jobs.start(config, runs / "r1")
        jobs.stop()  # in the first second: the child is still importing
    finally:
        signal.signal(signal.SIGINT, previous)
    status = wait_for_run(jobs, 120, every=0.2)  # the stopped run must end
    assert status.state == "stopped", (status.message, status.output_tail)
    assert not any(e.get("event") == "step" for e in status.events)
    assert [r.state for r in list_runs(runs, status)] == ["stopped"]
    # Once another run is the current one, the Runs tab still says how this one ended.
    (runs / "r2").mkdir()
    jobs.start(config, runs / "r2")
    jobs.stop()
    assert {r.name: r.state for r in list_runs(runs)}["r1"] == "stopped"
    while jobs.status().active:
        time.sleep(0.2)


def test_messages_name_the_forms_fields_and_say_types_in_words():
    assert in_form_words("Nothing fits (or drop micro_batch_size/grad_accum_steps so the planner may split).") == (
        "Nothing fits (or drop **Micro-batch size** and **Gradient accumulation steps** so the planner may split).")
    assert in_form_words("Column 'chosen' must hold text or conversations (found large_string).").endswith(
        "(found text).")
    assert in_form_words("Tags column 'tags' holds int64, not a list.") == "Tags column 'tags' holds whole numbers, " \
        "not a list."
    assert in_form_words("'x' holds list<item: string>.") == "'x' holds lists of text."


def test_precompute_reference_shows_only_for_a_kind_that_has_it_among_its_settings():
    from finetune import registry as kinds

    for name in kinds.names():
        assert shown_fields(name).get("precompute_reference", False) == (
            "precompute_reference" in kinds.entry(name).settings), name


def test_try_it_and_export_say_why_there_is_no_model_yet(tmp_path):
    from app.export.publish import hub_markdown

    for status, words in ((JobStatus(state="idle"), "No trained model yet"),
                          (JobStatus(state="running", run_dir=tmp_path), "once the run has finished"),
                          (JobStatus(state="stopped", run_dir=tmp_path), "did not finish")):
        assert words in panel(status, new_model=True).message
        assert words in hub_markdown(status, on_space=False)
    ctl = handlers(tmp_path / "runs", JobManager(tmp_path / "runs"))
    assert ctl.inference.poll(None)["status"] == "Nothing to export yet: train a run to the end first."

