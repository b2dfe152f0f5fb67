"""The Train tab's Sweep section, through its handlers: every bad field refused in one sentence before anything is
written or started (an empty space, a range the schema refuses, too many trials for the server, an objective the
task never logs, …), the same access rules as Start, and a 2-trial sweep on the bundled MiniLM going through the
queue as one `finetune sweep` child: its progress in trials, Stop, the same sweep started again going on after the
trial it finished, and the Runs tab listing the sweep's folder and its trials with the best marked."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, wait_for_run

from app.door.access import Access
from app.door.limits import Limits, add_arguments, defaults, from_args
from app.local.training import JobManager
from app.mapping import FIELD_NAMES, config_to_values
from app.runs.listing import delete_run, list_runs, status_title
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


def test_the_objectives_offered_are_the_ones_the_task_logs_and_the_direction_follows(tmp_path):
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
    # The section's choices follow the form's task; a Space caps a sweep at 50 trials unless its operator says.
    ctl = handlers(tmp_path / "runs", SimpleNamespace(status=lambda: None))
    shown = ctl.sweep.objective_choices("regression")
    assert shown["objective"]["choices"][0] == shown["objective"]["value"] == "mse"
    assert shown["direction"] == "minimize"
    assert defaults({"SPACE_ID": "owner/app"}).max_trials == 50 and defaults({}).max_trials is None
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_args(parser.parse_args(["--max-trials", "0"])).max_trials is None
    assert from_args(parser.parse_args(["--max-trials", "8"])).max_trials == 8


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
    jobs = JobManager(runs, python=_fake_sweep(tmp_path))
    ctl = handlers(runs, jobs, access=PASSWORDS, samples=(Path(SAMPLE),))
    refused = ctl.sweep.start(*_values(), request=None)  # not signed in
    assert not refused.started and "sign" in refused.message.lower(), refused.message
    # A file outside the app's readable places is refused as Start refuses it.
    outside = tmp_path / "secret.csv"
    outside.write_text("sentence,label\na,0\n")
    refused = ctl.sweep.start(*_values(dataset=str(outside)), request=ALICE)
    assert not refused.started and "`dataset`" in refused.message, refused.message
    assert not (runs / "alice").exists() or not any((runs / "alice").iterdir())
    # A signed-in user's sweep goes into their own runs folder, named there; only they may stop it.
    started = ctl.sweep.start(*_values(), request=ALICE)
    assert started.started and started.run_dir == "runs/alice/lr", started.message
    assert (runs / "alice" / "lr" / "launch.yaml").is_file()
    escape = ctl.sweep.start(*_values({"name": "/tmp/elsewhere"}), request=ALICE)
    assert not escape.started and "Sweep name '/tmp/elsewhere' must be a folder name" in escape.message
    # (Stop once the child runs: a signal sent between its fork and its exec would be lost.)
    _wait_for(lambda: (s := jobs.status()).sweep and s.sweep.running == 1)
    assert ctl.run.stop(request=SimpleNamespace(username="bob")).startswith("⚠️")
    assert "Stopping" in ctl.run.stop(request=ALICE)
    wait_for_run(jobs, 90)


def _wait_for(check, seconds: float = 240.0, every: float = 0.1):
    deadline = time.time() + seconds
    while not (found := check()):
        assert time.time() < deadline, "timed out"
        time.sleep(every)
    return found


# A stand-in for `python -m finetune sweep CONFIG -q`, as the study leaves its folders: trial 0 complete (in the
# summary and the study's journal), trial 1 training until SIGINT stops the sweep (exit 130, as the CLI's Stop).
FAKE_SWEEP = """
import json, os, signal, sys, time, yaml
folder = yaml.safe_load(open(sys.argv[4]))["output_dir"]
def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)
best = {"number": 0, "state": "complete", "value": 0.75, "run": "lr-trial-000", "params": {}}
open(os.path.join(folder, "study.journal"), "a").close()
write(os.path.join(folder, "summary.json"), {"objective": "accuracy", "trials_wanted": 2, "best": best,
      "counts": {"complete": 1}, "trials": [best]})
trial = folder + "-trial-001"
write(os.path.join(trial, "sweep.json"), {"sweep": "lr", "sweep_dir": folder, "trial": 1, "state": "running",
      "params": {"learning_rate": 0.000312}})
with open(os.path.join(trial, "events.jsonl"), "w") as f:
    f.write(json.dumps({"event": "start", "time": time.time(), "step": 0, "total_steps": 4, "micro_batch_size": 8,
                        "grad_accum_steps": 1, "num_processes": 1, "effective_batch_size": 8, "precision": "fp32",
                        "device": "cpu", "resumed": False}) + "\\n")
def stop(*_):
    write(os.path.join(trial, "sweep.json"), {"sweep": "lr", "sweep_dir": folder, "trial": 1, "state": "stopped"})
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
while True:
    time.sleep(0.05)
"""


def _fake_sweep(folder: Path) -> str:
    fake = folder / "fake-python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SWEEP}")
    fake.chmod(0o755)
    return str(fake)


def test_stop_stops_the_sweep_and_the_same_sweep_started_again_goes_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    jobs = JobManager(runs, python=_fake_sweep(tmp_path))
    ctl = handlers(runs, jobs)
    started = ctl.sweep.start(*_values())
    assert started.started and started.command == "finetune sweep runs/lr/launch.yaml", started.message
    # One child runs the whole sweep; the Run panel counts its trials and shows the trial in progress.
    running = _wait_for(lambda: (s := ctl.state.jobs.status()).sweep and s.sweep.running == 1 and s)
    assert running.state == "running" and running.message == ("Trial 2 of 2 (learning_rate=0.000312) · best so far "
                                                       "accuracy=0.75 (trial 0)")
    assert "Trial 2 of 2" in run_report.progress_html(running) and running.progress == (0, 4)
    assert jobs.status().command.split()[2:4] == ["sweep", str(runs / "lr" / "launch.yaml")]
    # Run on elsewhere is refused: the app runs a sweep's trials here.
    elsewhere = ctl.sweep.start_on("t4-small", *_values({"name": "other"}))
    assert not elsewhere.started and elsewhere.message.startswith("A sweep runs its trials on this machine")
    # A second sweep while it runs is queued behind it, as a second Start is.
    queued = ctl.sweep.start(*_values({"name": "other"}))
    assert queued.queued and queued.position == 1, queued.message
    assert "Cancelled" in ctl.run.cancel()
    assert "Stopping" in ctl.run.stop()
    stopped = wait_for_run(jobs, 90)
    assert stopped.state == "stopped", stopped.message
    assert stopped.message == ("Sweep stopped after 1 of 2 trials. Start sweep again with the name lr and the same "
                               "settings to continue: its finished trials are kept.")
    # Another search under the same name is refused; the same one goes on (its study keeps the finished trial).
    other = ctl.sweep.start(*_values({"trials": 3}))
    assert not other.started and "was started with other settings" in other.message, other.message
    again = ctl.sweep.start(*_values())
    assert again.started and "going on after the 1 trial(s) it finished" in again.message, again.message
    _wait_for(lambda: (s := jobs.status()).sweep and s.sweep.running == 1)
    ctl.run.stop()
    wait_for_run(jobs, 90)
    # Deleted in the Runs tab, the sweep's folder goes whole; its trials' folders left behind keep its name taken.
    assert delete_run(runs / "lr") == [] and not (runs / "lr").exists()
    refused = ctl.sweep.start(*_values({"trials": 3}))
    assert refused.message == ("Trials of an earlier sweep named lr are still in your runs (lr-trial-001, …): choose "
                               "another sweep name, or delete them in the Runs tab."), refused.message
    # A run's own folder is no sweep's.
    (runs / "plain").mkdir()
    refused = ctl.sweep.start(*_values({"name": "plain"}))
    assert "a folder the app did not make for a sweep" in refused.message, refused.message


@pytest.mark.slow
def test_a_two_trial_minilm_sweep_runs_through_the_queue_and_marks_its_best(app):
    ctl, runs = app
    t0 = time.time()
    started = ctl.sweep.start(*_values())
    assert started.started, started.message
    jobs = ctl.state.jobs
    seen = _wait_for(lambda: (s := jobs.status()).sweep and s.progress and s, 120)
    assert "Trial 1 of 2" in run_report.progress_html(seen) or "Trial 2 of 2" in run_report.progress_html(seen)
    done = wait_for_run(jobs, 240)
    took = time.time() - t0
    assert done.state == "done", (done.message, done.output_tail)
    summary = json.loads((runs / "lr" / "summary.json").read_text())
    best = summary["best"]
    assert done.message == (f"Sweep done: 2 trial(s); best: trial {best['number']} ({best['run']}), accuracy "
                            f"{best['value']:.4g}.")
    assert (runs / "lr" / "sweep.png").is_file() and done.events  # the best trial's curve stays on the panel
    listed = {r.name: r for r in list_runs(runs)}
    assert {"lr", "lr-trial-000", "lr-trial-001"} <= set(listed) and listed["lr"].task == "classification"
    assert [name for name, r in listed.items() if r.best] == [best["run"]]
    assert status_title(listed[best["run"]]).endswith("★ best")
    assert status_title(listed["lr"]).startswith("Done · sweep of 2 trials")
    print(f"2-trial MiniLM sweep through the app: {took:.1f} s")
