"""`finetune sweep`: a search's bad input refused in one sentence before anything runs; trials planned into the
budget (one that cannot fit pruned, never started), trained as runs grouped by their sweep.json, pruned by the median
of their evaluation curves, summarised and plotted; a sweep killed mid-trial resumes without re-running a finished
trial."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from finetune.cli import main
from finetune.config.schema import from_dict
from finetune.run.events import Eval
from finetune.sweep.space import load_sweep, parse_spec
from finetune.sweep.study import LOCK_FILE, STUDY_FILE, run_sweep, trial_folder

pytest.importorskip("optuna")


def _write(tmp_path: Path, sweep: dict, **values) -> Path:
    path = tmp_path / "sweep.yaml"
    base = {"dataset": "data.csv", "eval_fraction": 0.2, "output_dir": str(tmp_path / "runs" / "s")}
    path.write_text(yaml.safe_dump({**base, **values, "sweep": sweep}), encoding="utf-8")
    return path


GOOD = {"objective": "eval/accuracy", "direction": "maximize", "trials": 3,
        "space": {"learning_rate": {"low": 1.0e-5, "high": 1.0e-3, "log": True}, "lora_r": [8, 16]}}


@pytest.mark.parametrize(("change", "said"), [
    ({"space": {"learning_rat": [1e-4]}}, "Unknown option `learning_rat`. Did you mean `learning_rate`?"),
    ({"objective": "bleu"}, "`sweep.objective` 'bleu' is not a metric a task=classification run logs: use one of "
                            "loss, accuracy, macro_f1, train_seconds, train_samples_per_s."),
    ({"space": {}}, "`sweep.space` is empty"),
    ({"space": {"learning_rate": {"low": -1.0, "high": 1.0e-3}}}, "`sweep.space.learning_rate`: `learning_rate` "
                                                                  "must be at least 0, not -1.0."),
    ({"space": {"learning_rate": {"low": 0.0, "high": 1.0e-3, "log": True}}}, "a log range needs low above 0"),
    ({"sampler": "grid"}, "`learning_rate` is a range"),
])
def test_a_bad_sweep_is_one_sentence_and_exit_2_before_anything_runs(tmp_path, capsys, change, said):
    path = _write(tmp_path, {**GOOD, **change})
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert said in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_an_evaluation_objective_needs_evaluation_data():
    config = from_dict({"dataset": "data.csv", "eval_fraction": 0.0})
    with pytest.raises(Exception, match="holds out no evaluation data"):
        parse_spec(GOOD, config)
    # A run figure needs none; `eval/` is taken off the name.
    assert parse_spec({**GOOD, "objective": "train_seconds"}, config).objective == "train_seconds"
    assert parse_spec(GOOD, config.replace(eval_fraction=0.1)).objective == "accuracy"


def _fake_train(calls: list, accuracy: dict, kill_at: int | None = None):
    """A stand-in for the training loop: four evaluations whose accuracy is set by the learning rate; the call
    numbered `kill_at` dies mid-run (as a killed process would: nothing after it runs)."""

    def train(c, *, stop, callbacks):
        calls.append(c)
        Path(c.output_dir).mkdir(parents=True, exist_ok=True)
        for step in range(1, 5):
            if len(calls) - 1 == kill_at and step == 2:
                raise KeyboardInterrupt
            value = accuracy[c.learning_rate] * step / 4
            for callback in callbacks:
                callback(Eval(step=step, epoch=step / 4, metrics={"loss": 1 - value, "accuracy": value}))
            if stop.requested:
                return SimpleNamespace(status="stopped", run_dir=Path(c.output_dir), step=step, metrics={})
        return SimpleNamespace(status="done", run_dir=Path(c.output_dir), step=4, metrics={"accuracy": value})

    return train


def test_median_pruning_and_a_sweep_killed_mid_trial_resumes_without_rerunning_finished_trials(tmp_path):
    rates = [1e-5, 1e-4, 1e-3, 1e-2, 1e-1]
    accuracy = dict(zip(rates, [0.6, 0.8, 0.9, 0.2, 0.1], strict=True))
    path = _write(tmp_path, {"objective": "accuracy", "direction": "maximize", "trials": 5, "sampler": "grid",
                             "seed": 0, "space": {"learning_rate": rates}})
    config, spec = load_sweep(path)
    folder = Path(config.output_dir)
    said, first = [], []
    with pytest.raises(KeyboardInterrupt):
        run_sweep(config, spec, folder, train=_fake_train(first, accuracy, kill_at=2), stop=SimpleNamespace(
            requested=False), say=said.append)
    assert len(first) == 3
    killed = first[2].learning_rate
    # As a SIGKILL leaves it: the lock names a process that is gone (trial 2 is still "running" in the journal).
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (folder / LOCK_FILE).write_text(str(gone.pid))

    second = []
    result = run_sweep(config, spec, folder, train=_fake_train(second, accuracy), stop=SimpleNamespace(
        requested=False), say=said.append)
    assert result.status == "done"
    # Trials 0 and 1 finished before the kill and are not trained again; the killed one's rate is tried again first.
    assert [c.learning_rate for c in second][0] == killed
    assert len(second) == 3 and {c.learning_rate for c in first[:2] + second} == set(rates)
    assert "trial 2: cut short when the sweep was stopped; its parameters are tried again" in said
    assert json.loads((trial_folder(folder, 2) / "sweep.json").read_text())["state"] == "retried"
    assert "resuming: 2 of 5 trial(s) already finished" in said
    summary = json.loads((folder / "summary.json").read_text())
    states = {t["number"]: t["state"] for t in summary["trials"]}
    assert states[2] == "retried" and len(states) == 6
    # The grid's seeded order starts 1e-3, 1e-5, 1e-4 (killed, then again); the two bad rates come after two trials
    # have completed, and the median of the earlier trials' curves at step 1 prunes them there, and only them.
    order = [c.learning_rate for c in first[:2] + second]
    assert order[:3] == [1e-3, 1e-5, 1e-4] and set(order[3:]) == {1e-2, 1e-1}
    pruned = {t["params"]["learning_rate"] for t in summary["trials"] if t["state"] == "pruned"}
    assert pruned == {1e-2, 1e-1}
    for t in summary["trials"]:
        if t["state"] == "pruned":
            assert t["reason"].startswith("pruned at step 1: accuracy") and t["last_reported"]["step"] == 1
    best = summary["best"]
    assert best["params"] == {"learning_rate": 1e-3} and math.isclose(best["value"], 0.9)
    assert (folder / "sweep.png").stat().st_size > 5000 and (folder / STUDY_FILE).is_file()
    assert not (folder / LOCK_FILE).exists()


def test_slow_a_sweep_of_runs_prunes_the_trials_that_cannot_fit_and_groups_its_runs(tmp_path, tiny_bert, cls_csv,
                                                                                    capsys):
    """Through the CLI, on a real model: a grid over LoRA and the learning rate whose full fine-tunes cannot fit
    the budget (the planner's refusal: the weights and their gradients need 0.0075 GiB with SGD)."""
    path = _write(tmp_path, {"objective": "loss", "direction": "minimize", "trials": 4, "sampler": "grid",
                             "space": {"lora": ["true", "false"], "learning_rate": [0.05, 0.5]}},
                  model=tiny_bert, dataset=cls_csv, max_steps=2, eval_every=1, effective_batch_size=8,
                  max_length=32, memory_budget_gb=0.006, optimizer="sgd", precision="fp32")
    assert main(["sweep", str(path), "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["counts"] == {"complete": 2, "pruned": 2}
    folder = Path(out["sweep_dir"])
    for t in out["trials"]:
        run = trial_folder(folder, t["number"])
        if t["state"] == "pruned":
            assert t["params"]["lora"] == "false" and "Nothing fits memory_budget_gb=0.006" in t["reason"]
            assert not run.exists()  # never started
            continue
        record = json.loads((run / "sweep.json").read_text())
        assert record["sweep"] == folder.name and record["trial"] == t["number"] and record["state"] == "complete"
        assert record["params"] == t["params"] and t["params"]["lora"] == "true"
        assert math.isclose(json.loads((run / "metrics.json").read_text())["loss"], t["value"])
    assert out["best"]["value"] == min(t["value"] for t in out["trials"] if t["value"] is not None)
    # Again: every trial has finished, so nothing trains.
    assert main(["sweep", str(path), "-q"]) == 0
    assert "resuming: 4 of 4 trial(s) already finished" in capsys.readouterr().err


def test_a_resumed_tpe_search_draws_new_values(tmp_path):
    """TPE's first trials are random: a resumed sweep's sampler must not start again from the seed that drew them."""
    path = _write(tmp_path, {"objective": "accuracy", "direction": "maximize", "trials": 3, "pruning": "none",
                             "space": {"learning_rate": {"low": 1.0e-5, "high": 1.0e-1, "log": True}}})
    config, spec = load_sweep(path)
    folder, calls, accuracy = Path(config.output_dir), [], _AnyRate()
    with pytest.raises(KeyboardInterrupt):
        run_sweep(config, spec, folder, train=_fake_train(calls, accuracy, kill_at=1), stop=SimpleNamespace(
            requested=False), say=lambda _: None)
    run_sweep(config, spec, folder, train=_fake_train(calls, accuracy), stop=SimpleNamespace(requested=False),
              say=lambda _: None)
    rates = [c.learning_rate for c in calls]
    assert len(rates) == 4 and rates[2] == rates[1]  # the killed trial's rate again, then a new one
    assert len(set(rates)) == 3


class _AnyRate(dict):
    """Accuracy 0.5 at any learning rate."""

    def __missing__(self, key: float) -> float:
        return 0.5
