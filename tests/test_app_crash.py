"""Crash-safe runs with real `finetune train` children on a tiny BERT: a child killed from outside is a failed,
resumable run before and after an app restart; SIGTERM to a serving app (`docker stop`) stops the run with a
checkpoint before the app exits."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import served_app

from app.local.training import KILLED, JobManager
from app.tabs import handlers
from finetune.run.events import read_events
from finetune.run.rundir import checkpoints

pytestmark = pytest.mark.slow


def _until(check, timeout: float = 120, what: str = ""):
    deadline = time.time() + timeout
    while not (value := check()):
        assert time.time() < deadline, what
        time.sleep(0.2)
    return value


def test_a_training_child_killed_by_sigkill_fails_resumably_before_and_after_a_restart(tmp_path, monkeypatch,
                                                                                        tiny_bert, cls_csv):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runs = tmp_path / "runs"
    run_dir = runs / "oom"
    config = tmp_path / "oom.yaml"
    config.write_text(yaml.safe_dump({"model": tiny_bert, "dataset": cls_csv, "output_dir": str(run_dir),
                                      "effective_batch_size": 8, "eval_fraction": 0.0, "epochs": 400,
                                      "save_every": 2}))
    jobs = JobManager(runs)
    jobs.start(config, run_dir)
    try:
        _until(lambda: checkpoints(run_dir), what="no checkpoint")
    finally:
        os.killpg(jobs._job.pid, signal.SIGKILL)  # what the out-of-memory killer does (or a failed test's end)
    _until(lambda: not jobs.status().active)
    failed = jobs.status()
    assert (failed.state, failed.message, failed.returncode) == ("failed", KILLED, -9)
    assert failed.resumable and Path(failed.checkpoint) == checkpoints(run_dir)[-1]
    assert handlers(runs, jobs).follow.poll(None).resume_button["visible"]

    after_restart = JobManager(runs)  # a new app process: the same verdict, from current.json and the run folder
    status = after_restart.status()
    assert (status.state, status.message, status.resumable) == ("failed", KILLED, True)
    assert handlers(runs, after_restart).follow.poll(None).resume_button["visible"]


def test_sigterm_to_the_app_stops_the_run_with_a_checkpoint_before_the_app_exits(tmp_path, tiny_bert, cls_csv):
    from gradio_client import Client

    with served_app(tmp_path, OMP_NUM_THREADS="1", FINETUNE_STOP_GRACE="60") as (url, runs):
        config = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 8, "eval_fraction": 0.0,
                  "epochs": 400}
        started = Client(url, verbose=False).predict(config=config, api_name="/start")
        assert started["started"], started
        run_dir = tmp_path / started["run_dir"]
        _until(lambda: any(e["event"] == "step" for e in read_events(run_dir / "events.jsonl")), what="no step")
        (app,) = [p for p in psutil.Process().children() if "app" in p.cmdline()]
        app.send_signal(signal.SIGTERM)  # `docker stop`
        _until(lambda: not app.is_running() or app.status() == psutil.STATUS_ZOMBIE, timeout=60,
               what="the app did not exit")
        events = read_events(run_dir / "events.jsonl")
        assert events[-1]["event"] == "stopped" and checkpoints(run_dir), events[-3:]
