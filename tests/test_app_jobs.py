"""The app's job manager with real `finetune train` child processes on a tiny BERT: one job at a time, Stop → a
resumable stopped run, Resume → done, a failed run's message, and re-attaching from a new app process."""

from __future__ import annotations

import json
import os
import signal
import time
import zipfile
from pathlib import Path

import gradio as gr
import pytest
import yaml

from app.downloads import zip_model
from app.local.training import JobBusy, JobManager, JobStatus
from app.tabs import handlers

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """The children inherit the environment: one thread is plenty for the tiny model and keeps a busy machine from
    slowing them down by oversubscription."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _write_config(tmp_path: Path, run_dir: Path, **values) -> Path:
    path = tmp_path / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(run_dir), "effective_batch_size": 8, "eval_fraction": 0.0,
                                    **values}))
    return path


def _wait(jobs: JobManager, until, timeout: float = 120) -> JobStatus:
    deadline = time.time() + timeout
    while True:
        s = jobs.status()
        if until(s):
            return s
        assert time.time() < deadline, f"timed out in state {s.state}: {s.message}\n{s.output_tail}"
        time.sleep(0.2)


def _steps(s: JobStatus) -> list[int]:
    return [e["step"] for e in s.events if e["event"] == "step"]


def test_one_job_then_stop_then_resume_to_done(tmp_path, tiny_bert, cls_csv):
    from transformers import AutoModelForSequenceClassification

    jobs = JobManager(tmp_path / "runs")
    assert jobs.status().state == "idle"
    run_dir = tmp_path / "runs" / "r1"
    # 37 rows in windows of 8: 5 steps an epoch, 200 in all: Stop lands mid-run.
    config = _write_config(tmp_path, run_dir, model=tiny_bert, dataset=cls_csv, epochs=40)
    first = jobs.start(config, run_dir)
    assert first.state in ("starting", "running") and first.active

    with pytest.raises(JobBusy, match="A run is in progress .*only one job runs at a time"):
        jobs.start(config, tmp_path / "runs" / "r2")
    assert not (tmp_path / "runs" / "r2").exists()

    running = _wait(jobs, lambda s: _steps(s))
    assert running.state == "running" and jobs.stop().startswith("Stopping after the current optimizer step")
    stopped = _wait(jobs, lambda s: not s.active)
    assert stopped.state == "stopped" and stopped.returncode == 130, stopped.message
    last = stopped.events[-1]
    assert last["event"] == "stopped" and 0 < last["step"] < 200
    assert Path(stopped.checkpoint).is_dir() and stopped.model_dir is None
    assert jobs.stop() == "No run is in progress."

    jobs.resume(run_dir)
    done = _wait(jobs, lambda s: not s.active, timeout=180)
    assert done.state == "done" and done.returncode == 0, done.message
    assert [e["event"] for e in done.events if e["event"] == "start"] == ["start", "start"]
    assert _steps(done)[-1] == 200 and sorted(set(_steps(done))) == _steps(done)  # no step twice, none lost
    assert done.model_dir == run_dir / "model"

    # What the page shows of it: the poll's status, Download model (the current run: nothing picked), and Try it.
    ctl = handlers(tmp_path / "runs", jobs)
    shown = ctl.follow.poll(None)
    assert shown.status.startswith("Last run: **Done**") and "step 200 / 200" in shown.progress
    # The zip of its model, named after the run (handed out from a folder of its own).
    download = ctl.publish.model(None)["download"]
    assert Path(download["value"]).name == f"{run_dir.name}.zip" and download["interactive"]
    assert not shown.stop_button["interactive"] and not shown.resume_button["visible"]
    assert shown.command == f"finetune train {run_dir / 'config.yaml'} resume=true"
    # Nothing new: nothing re-sent (a nested result of None leaves all of its widgets alone).
    assert all(x == gr.skip() or x is None for x in vars(ctl.follow.poll(shown.signature)).values())
    assert shown.start_button["interactive"] and shown.try_panel.button["interactive"]
    tried = ctl.tryit.try_it("good great movie")
    assert tried.message == "" and set(tried.label["value"]) == {"neg", "pos"}
    assert abs(sum(tried.label["value"].values()) - 1) < 1e-3

    zipped = zip_model(done.model_dir, tmp_path / "model.zip")
    assert zip_model(done.model_dir, zipped) == zipped  # unchanged model: the zip is reused
    with zipfile.ZipFile(zipped) as z:
        z.extractall(tmp_path / "unzipped")
    (folder,) = list((tmp_path / "unzipped").iterdir())
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert sorted(model.config.id2label.values()) == ["neg", "pos"]


def test_a_failed_run_shows_the_cli_message(tmp_path, tiny_bert, cls_csv):
    jobs = JobManager(tmp_path / "runs")
    run_dir = tmp_path / "runs" / "bad"
    jobs.start(_write_config(tmp_path, run_dir, model=tiny_bert, dataset=cls_csv, text_column="review"), run_dir)
    failed = _wait(jobs, lambda s: not s.active)
    assert failed.state == "failed" and failed.returncode == 2
    assert failed.message.startswith("Text column 'review' is not in the data; its columns are: sentence, label.")


def test_a_new_app_process_reattaches_and_can_stop_the_run(tmp_path, tiny_bert, cls_csv):
    runs = tmp_path / "runs"
    first = JobManager(runs)
    run_dir = runs / "long"
    first.start(_write_config(tmp_path, run_dir, model=tiny_bert, dataset=cls_csv, epochs=400), run_dir)
    _wait(first, lambda s: _steps(s))

    # What a restarted app sees: the same run, still training, and Stop still works (by process group).
    second = JobManager(runs, stop_timeout=60)
    attached = second.status()
    assert attached.state == "running" and attached.run_dir == run_dir
    with pytest.raises(JobBusy):
        second.start(run_dir.parent / "long.yaml", runs / "other")
    second.stop()
    stopped = _wait(second, lambda s: not s.active)
    assert stopped.state == "stopped" and stopped.events[-1]["event"] == "stopped"
    assert _wait(first, lambda s: not s.active).returncode == 130  # the original parent reaps its child


def test_a_second_stop_kills_at_once(tmp_path, tiny_bert, cls_csv):
    """A run that does not stop by itself (frozen here, as one stuck in a long step or a slow save would be) is
    killed by the second Stop. Unfrozen, a tiny model's run could finish its graceful stop between the two presses."""
    jobs = JobManager(tmp_path / "runs")
    run_dir = tmp_path / "runs" / "k"
    jobs.start(_write_config(tmp_path, run_dir, model=tiny_bert, dataset=cls_csv, epochs=400), run_dir)
    _wait(jobs, lambda s: s.state == "running")
    os.killpg(json.loads((tmp_path / "runs" / "current.json").read_text())["pid"], signal.SIGSTOP)
    jobs.stop()
    assert jobs.stop().startswith("Killed the run")
    killed = jobs.status()
    assert not killed.active and killed.state == "stopped" and killed.returncode == -9
    assert killed.message.startswith("The run was killed")
