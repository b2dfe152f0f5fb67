"""The Runs tab's handlers on real runs: the list (the user's own runs only), the comparison of two runs (their
curves, metrics and the one config key that differs), the whole log, delete (only what finetune wrote, after a
confirmation), resume; and Try it's labels (the run's names, not ids) and entities, and the download named after
the run."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_train

from app.door.access import Access
from app.local import training as jobs
from app.local.training import JobManager
from app.runs.listing import config_diff, list_runs
from app.tabs import Handlers, handlers
from app.tryit.renderers import entity_pieces

STEPS = 14  # more log lines than the Run panel's 12


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_bert, cls_csv) -> Path:
    """A runs folder with two finished classification runs that differ only in their learning rate."""
    runs = tmp_path_factory.mktemp("runs_tab") / "runs"
    for name, lr in (("run-a", 0.5), ("run-b", 0.1)):
        run_train(runs / name, model=tiny_bert, dataset=cls_csv, text_column="sentence", label_column="label",
                  max_length=32, effective_batch_size=8, max_steps=STEPS, eval_fraction=0.25, eval_every=7,
                  learning_rate=lr)
        time.sleep(0.01)
    return runs


def _attach(ctl: Handlers, run: Path) -> None:
    """The job manager follows `run` as its last (finished) run, as after an app restart."""
    ctl.state.jobs.training._job = jobs._Job(run_dir=run, config_path=run / "config.yaml", log_path=run / "launch.log",
                                             command=["python"], pid=-1, proc=None, launched=time.time() - 3600)


def test_the_runs_are_listed_compared_and_diffed(two_runs, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(two_runs, runs)
    (runs / "uploads").mkdir()
    (runs / "not-a-run").mkdir()  # no marker: not a run of the tool's
    ctl = handlers(runs, JobManager(runs)).runs
    shown = ctl.refresh(None)
    assert sorted(shown.table.Run) == ["run-a", "run-b"]
    assert set(shown.table.Status) == {"Done"} and all(s == f"{STEPS}/{STEPS}" for s in shown.table.Steps)
    assert all(re.search(r"accuracy \d\.\d{4}", m) for m in shown.table.Metrics)
    assert sorted(shown.choices["choices"]) == ["run-a", "run-b"] and "value" not in shown.choices

    # One run: its config (what it was launched with), command and whole log; Resume off for a finished run.
    one = ctl.select(["run-a"])
    assert "learning_rate: 0.5" in one.config and one.command.endswith("run-a/config.yaml")
    log = Path(one.log["value"])
    assert log.name == "run-a.log" and one.log["interactive"]
    steps = [line for line in log.read_text().splitlines() if re.search(rf" step \d+/{STEPS} loss", line)]
    assert len(steps) == STEPS
    assert not one.resume["interactive"] and one.delete["interactive"]

    # Two runs: both curves (train and eval, per run), their final metrics, and only the key that differs.
    both = ctl.select(["run-a", "run-b"])
    for split in ("train/run-a", "eval/run-a", "train/run-b", "eval/run-b"):
        assert f'<path data-split="{split}"' in both.chart
    assert both.chart.count('<circle data-split="eval/run-a"') == 2  # eval at steps 7 and 14
    assert list(both.metrics["value"].Run) == ["run-a", "run-b"] and "accuracy" in both.metrics["value"]
    diff = both.diff["value"]
    assert list(diff.Option) == ["learning_rate"] and list(diff.iloc[0][1:]) == ["0.5", "0.1"]
    assert not both.log["interactive"] and not both.delete["interactive"]

    # A name the page sends that is not one of the user's runs shows nothing.
    assert ctl.select(["../runs/run-a", "not-a-run", "uploads"]).command == ""


def test_a_shared_server_lists_only_the_users_own_runs(two_runs, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(two_runs / "run-a", runs / "alice" / "run-a")
    shutil.copytree(two_runs / "run-b", runs / "bob" / "run-b")
    access = Access("password", accounts=(("alice", "a"), ("bob", "b")))
    ctl = handlers(runs, JobManager(runs), access=access).runs
    alice, bob, nobody = (SimpleNamespace(username=u) for u in ("alice", "bob", None))
    assert list(ctl.refresh(None, request=alice).table.Run) == ["run-a"]
    assert list(ctl.refresh(None, request=bob).table.Run) == ["run-b"]
    assert list(ctl.refresh(None, request=nobody).table.Run) == []
    assert ctl.select(["run-b"], request=alice).command == ""  # bob's run, by its name
    assert "Select one run" in ctl.ask_delete(["run-b"], request=alice)["message"]
    ctl.delete(["run-b"], request=alice)
    assert (runs / "bob" / "run-b" / "model").is_dir()
    # A run of bob's named as alice's: each gets their own log file.
    shutil.copytree(two_runs / "run-b", runs / "bob" / "run-a")
    logs = [Path(ctl.select(["run-a"], request=who).log["value"]) for who in (alice, bob)]
    assert logs[0] != logs[1] and logs[0].name == logs[1].name == "run-a.log"
    assert logs[0].read_text() != logs[1].read_text()


def test_delete_asks_first_and_removes_only_what_finetune_wrote(two_runs, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(two_runs, runs)
    (runs / "run-b" / "model" / "NOTES.md").write_text("mine")
    ctl = handlers(runs, JobManager(runs)).runs
    asked = ctl.ask_delete(["run-a"])
    assert "Delete run `run-a`?" in asked["message"] and asked["confirm"]["visible"]
    assert ctl.cancel_delete()["message"] == "Nothing was deleted." and (runs / "run-a").is_dir()
    done = ctl.delete(["run-a"])
    assert not (runs / "run-a").exists() and list(done.table.Run) == ["run-b"]
    assert ctl.refresh(["run-a", "run-b"]).choices["value"] == ["run-b"]  # a deleted run is no longer selected
    kept = ctl.delete(["run-b"])
    assert "Kept 1 file(s)" in kept.message
    assert [p.relative_to(runs) for p in (runs / "run-b").rglob("*") if p.is_file()] == [
        Path("run-b/model/NOTES.md")]
    assert list(kept.table.Run) == []  # the marker went with the rest: no longer a run


def test_a_stopped_run_with_a_checkpoint_is_resumed_from_the_runs_tab(two_runs, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    run = runs / "stopped"
    shutil.copytree(two_runs / "run-a", run)
    # As a stop leaves it: no model, no final metrics, a `stopped` event after the last checkpoint.
    shutil.rmtree(run / "model")
    (run / "metrics.json").unlink()
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    events = [e for e in events if e["event"] != "done"] + [
        {"event": "stopped", "time": time.time(), "step": STEPS, "checkpoint": "checkpoints/step-0000014"}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "checkpoints" / "step-0000014").mkdir(parents=True, exist_ok=True)
    (info,) = list_runs(runs)
    assert info.state == "stopped" and info.resumable
    ctl = handlers(runs, JobManager(runs)).runs
    assert ctl.select(["stopped"]).resume["interactive"]
    assert ctl.select(["stopped"]).command.endswith("stopped/config.yaml resume=true")
    started = []
    monkeypatch.setattr(ctl.state.jobs, "resume", lambda path, owner=None: started.append(path))
    assert ctl.resume(["stopped"]).startswith("Resuming `stopped`") and started == [run]
    assert "Nothing to resume" in ctl.resume([]) or "Select one run" in ctl.resume([])


def test_try_it_shows_the_runs_label_names_and_the_download_is_named_after_the_run(two_runs, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(two_runs / "run-a", runs / "run-a")
    ctl = handlers(runs, JobManager(runs))
    _attach(ctl, runs / "run-a")
    shown = ctl.tryit.try_it("a good great film")
    assert shown.label["visible"] and set(shown.label["value"]) == {"pos", "neg"}  # the data's names, not 0/1
    assert not shown.entities["visible"]
    download = ctl.publish.model("run-a")["download"]  # picked in the Export tab
    assert Path(download["value"]).name == "run-a.zip" and download["interactive"]


def test_try_it_highlights_the_entities_of_a_token_classification_run(tmp_path, tiny_bert_tagger, ner_jsonl):
    run = tmp_path / "runs" / "ner"
    run_train(run, model=tiny_bert_tagger, dataset=ner_jsonl, task="token_classification", max_steps=2,
              effective_batch_size=8, max_length=32)
    ctl = handlers(tmp_path / "runs", JobManager(tmp_path / "runs"))
    _attach(ctl, run)
    text = "Clara went to Paris and Berlin"
    shown = ctl.tryit.try_it(text)
    assert shown.message == "" and shown.entities["visible"]
    assert not shown.label["visible"] and not shown.generated["visible"]
    pieces = shown.entities["value"]
    assert "".join(p for p, _ in pieces).split() == text.split()
    # Entities are one piece each, with their type; the other words carry none.
    out = {"words": text.split(), "tags": ["B-PER", "O", "O", "B-LOC", "O", "B-LOC"],
           "entities": [{"type": "PER", "start": 0, "end": 1}, {"type": "LOC", "start": 3, "end": 4},
                        {"type": "LOC", "start": 5, "end": 6}]}
    assert [p for p in entity_pieces(out) if p[1]] == [("Clara", "PER"), ("Paris", "LOC"), ("Berlin", "LOC")]


def test_the_config_diff_compares_a_default_with_a_key_set(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for path, text in ((a, "dataset: x.csv\nlearning_rate: 0.1\n"), (b, "dataset: x.csv\nepochs: 5\n")):
        path.mkdir()
        (path / "launch.yaml").write_text(text)
    fake = [SimpleNamespace(name=p.name, path=p) for p in (a, b)]
    diff = config_diff(fake)
    assert sorted(diff.Option) == ["epochs", "learning_rate"]
