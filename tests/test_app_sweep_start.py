"""The Train tab's Sweep section, through its handlers: every bad field refused in one sentence before anything is
written or started (an empty space, a range the schema refuses, too many trials for the server, an objective the
task never logs, …), the same access rules as Start, and a 2-trial sweep on the bundled MiniLM going through the
queue as one `finetune sweep` child: its progress in trials, Stop, the same sweep started again going on after the
trial it finished, and the Runs tab listing the sweep's folder and its trials with the best marked."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, wait_for_run

from app.access import Access
from app.jobs.training import JobManager
from app.limits import Limits
from app.mapping import FIELD_NAMES, config_to_values
from app.runs.listing import list_runs, status_title
from app.tabs import handlers
from app.train import run_report
from app.train.sweep_form import SWEEP_INPUTS, direction_for, objectives, sweep_section
from finetune.config.schema import ConfigError, from_dict

pytest.importorskip("optuna")

SAMPLE = str(ROOT / "assets" / "sst2_sample.csv")
BASE = {"dataset": SAMPLE, "text_column": "sentence", "label_column": "label", "max_train_samples": 24,
        "eval_fraction": 0.25, "max_steps": 2, "eval_every": 1, "effective_batch_size": 8, "lora": "false"}
# The Sweep section as a user leaves it after typing: two trials over the learning rate.
SWEEP = {"name": "lr", "objective": "accuracy", "direction": "maximize", "trials": 2, "sampler": "tpe",
         "lr_on": True, "lr_low": 1e-5, "lr_high": 1e-3, "lr_log": True, "epochs_on": False, "epochs_low": 1,
         "epochs_high": 3, "warmup_on": False, "warmup_low": 0.0, "warmup_high": 0.2, "lora_r": "", "batch": ""}
ALICE = SimpleNamespace(username="alice")
PASSWORDS = Access("password", accounts=(("alice", "a-secret"),))


def _values(sweep: dict | None = None, **form) -> list:
    """The Sweep section's values, then the form's (`form`: widget values as typed, the schema's check to come)."""
    mine = {**SWEEP, **(sweep or {})}
    values = config_to_values(from_dict(BASE))
    for name, value in form.items():
        values[FIELD_NAMES.index(name)] = value
    return [mine[name] for name in SWEEP_INPUTS] + values


@pytest.fixture
def app(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    jobs = JobManager(runs)
    yield handlers(runs, jobs, server_limits=Limits(max_trials=50, max_epochs=5, max_effective_batch=64)), runs
    if jobs.status().active:  # a failed test leaves no child behind
        jobs.stop()
        jobs.stop()


def test_the_objectives_offered_are_the_ones_the_task_logs_and_the_direction_follows():
    assert objectives("classification") == ["accuracy", "macro_f1", "loss", "train_seconds", "train_samples_per_s"]
    assert objectives("regression")[:2] == ["mse", "rmse"]
    assert direction_for("accuracy") == "maximize" and direction_for("eval/loss") == "minimize"
    assert direction_for("mse") == "minimize"
    # The widgets spell the config's `sweep:` section: only what is ticked or typed is searched.
    section = sweep_section({**SWEEP, "lora_r": "8, 16 32", "epochs_on": True})
    assert section["space"] == {"learning_rate": {"low": 1e-5, "high": 1e-3, "log": True},
                                "epochs": {"low": 1, "high": 3}, "lora_r": [8, 16, 32]}
    assert section["trials"] == 2 and section["objective"] == "accuracy"
    with pytest.raises(ConfigError, match="LoRA rank choices '8, x' is not a list of whole numbers"):
        sweep_section({**SWEEP, "lora_r": "8, x"})


@pytest.mark.parametrize(("sweep", "form", "said"), [
    ({"lr_on": False}, {}, "`sweep.space` is empty: name at least one option to search"),
    ({"lr_low": -1.0}, {}, "`sweep.space.learning_rate`: `learning_rate` must be at least 0, not -1.0."),
    ({"lr_low": 0.0}, {}, "`sweep.space.learning_rate`: a log range needs low above 0, not 0."),
    ({"lr_low": 1e-2}, {}, "`sweep.space.learning_rate`: low (0.01) must be below high (0.001)."),
    ({"lr_high": None}, {}, "Learning rate is ticked but its low or high is empty: give both, or untick it."),
    ({"lora_r": "8, 0"}, {"lora": "true"}, "`sweep.space.lora_r`: `lora_r` must be at least 1, not 0."),
    ({"lora_r": "8, 16"}, {}, "LoRA rank choices are searched, but LoRA is off"),
    ({"batch": "16, x"}, {}, "Effective batch choices '16, x' is not a list of whole numbers"),
    ({"trials": 51}, {}, "Trials = 51 is above this server's limit of 50 trials per sweep: lower it."),
    ({"trials": 0}, {}, "`sweep.trials` must be a whole number of at least 1, not 0."),
    ({"objective": "bleu"}, {}, "`sweep.objective` 'bleu' is not a metric a task=classification run logs"),
    ({"objective": "accuracy"}, {"eval_fraction": 0.0}, "the config holds out no evaluation data"),
    ({"direction": "up"}, {}, "`sweep.direction` must be maximize or minimize"),
    ({"epochs_on": True, "epochs_high": 9}, {"max_steps": None},
     "The sweep's epochs = 9: `epochs` = 9 is above this server's limit of 5"),
    ({"batch": "16, 128"}, {}, "The sweep's effective_batch_size = 128: The effective batch of 128 samples is above"),
    ({"name": "../up"}, {}, "Sweep name '../up' must be a folder name"),
    ({"name": "a-trial-001"}, {}, "no '-trial-'"),
    ({}, {"learning_rate": -1}, "`learning_rate` must be at least 0"),
    ({}, {"dataset": "missing.csv"}, "missing.csv"),
])
def test_a_bad_field_is_one_sentence_and_nothing_starts(app, sweep, form, said):
    ctl, runs = app
    started = ctl.sweep.start(*_values(sweep, **form))
    assert not started.started and not started.queued, started.message
    assert said in started.message, started.message
    assert "\n" not in started.message and "Traceback" not in started.message
    assert ctl.state.jobs.status().state == "idle"
    assert not list(runs.glob("*")) or not any(p.is_dir() for p in runs.iterdir())


def test_a_sweep_follows_starts_rules_of_who_may_train_and_where(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    ctl = handlers(runs, JobManager(runs, python=str(tmp_path / "no-python")), access=PASSWORDS)
    refused = ctl.sweep.start(*_values(), request=None)  # not signed in
    assert not refused.started and "sign" in refused.message.lower(), refused.message
    # A file outside the app's readable places is refused as Start refuses it.
    outside = tmp_path / "secret.csv"
    outside.write_text("sentence,label\na,0\n")
    refused = ctl.sweep.start(*_values(dataset=str(outside)), request=ALICE)
    assert not refused.started and "`dataset`" in refused.message, refused.message
    assert not (runs / "alice").exists() or not any((runs / "alice").iterdir())


def _wait_for(check, seconds: float = 240.0, every: float = 0.1):
    deadline = time.time() + seconds
    while not (found := check()):
        assert time.time() < deadline, "timed out"
        time.sleep(every)
    return found


@pytest.mark.slow
def test_a_two_trial_sweep_runs_through_the_queue_stops_goes_on_and_marks_its_best(app):
    ctl, runs = app
    t0 = time.time()
    started = ctl.sweep.start(*_values())
    assert started.started, started.message
    assert started.command == "finetune sweep runs/lr/launch.yaml" and started.run_dir == "runs/lr"
    jobs = ctl.state.jobs
    # One child runs the whole sweep; the Run panel counts its trials.
    assert jobs.status().command.split()[2:4] == ["sweep", str(runs / "lr" / "launch.yaml")]
    first = _wait_for(lambda: (s := jobs.status()).sweep and s.sweep.running == 0 and s.progress and s)
    assert "Trial 1 of 2" in run_report.progress_html(first)
    # Stop once trial 0 has ended: the sweep stops in (or before) trial 1.
    _wait_for(lambda: (s := jobs.status()).sweep and s.sweep.finished == 1)
    assert "Stopping" in ctl.run.stop()
    stopped = wait_for_run(jobs, 120)
    assert stopped.state == "stopped" and "Start sweep again with the name lr" in stopped.message, stopped.message
    # Another sweep under the same name is refused; the same one goes on after its finished trial.
    other = ctl.sweep.start(*_values({"trials": 3}))
    assert not other.started and "was started with other settings" in other.message, other.message
    again = ctl.sweep.start(*_values())
    assert again.started and "going on after the 1 trial(s) it finished" in again.message, again.message
    done = wait_for_run(jobs, 240)
    took = time.time() - t0
    assert done.state == "done", (done.message, done.output_tail)
    assert done.sweep.finished == 2 and done.message.startswith("Sweep done: 2 trial(s); best: trial "), done.message
    summary = json.loads((runs / "lr" / "summary.json").read_text())
    assert summary["best"] is not None and (runs / "lr" / "sweep.png").is_file()
    # Trial 0 trained once: the second start did not run it again.
    events = [json.loads(line) for line in (runs / "lr-trial-000" / "events.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "start" for e in events) == 1
    listed = {r.name: r for r in list_runs(runs)}
    assert "lr" in listed and listed["lr"].task == "classification"
    best = [name for name, r in listed.items() if r.best]
    assert best == [summary["best"]["run"]]
    assert status_title(listed[best[0]]).endswith("★ best")
    assert status_title(listed["lr"]).startswith("Done · sweep of 2 trials")
    print(f"2-trial MiniLM sweep through the app, with a stop and a second start: {took:.1f} s")
