"""The run queue on a shared server with two users, through the scripting API and the page's handlers: a Start while
a run trains is queued (its position, and nobody else's run beyond that), the per-user cap's sentence, Cancel, the
next run starting by itself after the one before ends done, stopped or failed, and the queue surviving a new app
process. The training child is a stand-in that writes a run's events and ends when the test says how."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.api import ScriptApi
from app.door.access import Access
from app.door.limits import Limits
from app.local.training import JobManager
from app.mapping import COLUMN_FIELDS
from app.tabs import Handlers, handlers

ALICE, BOB = SimpleNamespace(username="alice"), SimpleNamespace(username="bob")
PASSWORDS = Access("password", accounts=(("alice", "a-secret"), ("bob", "b-secret")))
# A stand-in for `python -m finetune train CONFIG [resume=true] -q`: a run at step 3 of 10 that ends as the file
# `end` in its folder says ("done" or "error"), or stops on SIGINT as the real loop does.
FAKE_CHILD = """
import json, os, signal, sys, time, yaml
run = yaml.safe_load(open(sys.argv[4]))["output_dir"]
def event(**e):
    with open(os.path.join(run, "events.jsonl"), "a") as f:
        f.write(json.dumps({"time": time.time(), **e}) + "\\n")
def stop(*_):
    event(event="stopped", step=3, checkpoint="c")
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
event(event="start", step=0, total_steps=10, micro_batch_size=8, grad_accum_steps=1, num_processes=1,
      effective_batch_size=8, precision="fp32", device="cpu", resumed=False)
event(event="step", step=3, loss=0.5, lr=1e-4, grad_norm=1.0, samples_per_s=9.0, skipped=0, epoch=1.5)
end = os.path.join(run, "end")
while not os.path.exists(end):
    time.sleep(0.05)
if open(end).read() == "done":
    event(event="done", metrics={"loss": 0.25, "steps": 10})
    sys.exit(0)
event(event="error", message="The data ran out (a test's failure).")
sys.exit(1)
"""


def _fake_python(folder: Path) -> str:
    fake = folder / "fake-python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_CHILD}")
    fake.chmod(0o755)
    return str(fake)


@pytest.fixture
def queue(tmp_path, monkeypatch, cls_csv):
    """A password-mode app (at most one queued run a user) whose training child is FAKE_CHILD, with an upload each
    of alice and bob; its API; their uploads."""
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    jobs = JobManager(runs, python=_fake_python(tmp_path))
    ctl = handlers(runs, jobs, access=PASSWORDS, server_limits=Limits(max_queued=1))
    uploads = {}
    for who, req in (("alice", ALICE), ("bob", BOB)):
        gradio_copy = tmp_path / f"gradio-{who}" / "cls.csv"
        gradio_copy.parent.mkdir()
        shutil.copyfile(cls_csv, gradio_copy)
        uploads[who] = ctl.dataset.on_upload(str(gradio_copy), "", "train", "classification",
                                             *[""] * len(COLUMN_FIELDS), request=req).dataset
    yield ctl, ScriptApi(ctl), uploads
    jobs._closing = True  # nothing more starts once the test is over
    for q in jobs.queue.entries():
        jobs.cancel(q.run_dir)
    if jobs.status().active:
        os.killpg(json.loads((runs / "current.json").read_text())["pid"], 9)


def _config(dataset: str, name: str) -> str:
    return json.dumps({"dataset": dataset, "output_dir": name, "effective_batch_size": 8, "eval_fraction": 0.0})


def _wait_for(what, timeout: float = 30.0):
    deadline = time.time() + timeout
    while not (got := what()):
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)
    return got


def _training(ctl: Handlers, run_dir: str) -> None:
    """Wait until `run_dir` is the run in progress, past its first step."""
    _wait_for(lambda: str(ctl.state.jobs.status().run_dir) == run_dir and ctl.state.jobs.status().progress)


def _end(run_dir: str, how: str) -> None:
    """Tell FAKE_CHILD how to end. Written aside and renamed: the child reads the file once it exists, and a file
    created but not yet written read as "" (an error) on a loaded machine, so a run told "done" failed."""
    aside = Path(run_dir, "end.tmp")
    aside.write_text(how)
    aside.replace(Path(run_dir, "end"))


def test_a_start_while_a_run_trains_is_queued_and_starts_by_itself(queue):
    ctl, api, uploads = queue
    first = api.start(_config(uploads["alice"], "a1"), ALICE)
    assert first["started"] and not first["queued"] and first["position"] is None, first
    _training(ctl, "runs/alice/a1")

    # bob's Start while alice trains: queued, position 1, his folder written, nothing of hers said.
    bobs = api.start(_config(uploads["bob"], "b1"), BOB)
    assert bobs == {"started": False, "queued": True, "position": 1, "run_dir": "runs/bob/b1",
                    "command": "finetune train runs/bob/b1/launch.yaml",
                    "message": "Queued, position 1: it starts by itself when the run in progress ends; Cancel takes "
                               "it off the queue. Reproduce from a terminal with "
                               "`finetune train runs/bob/b1/launch.yaml`."}
    assert Path("runs/bob/b1/launch.yaml").is_file() and "alice" not in json.dumps(bobs)
    assert api.status(BOB) == {"state": "queued", "queued": True, "position": 1,
                               "queue": [{"run_dir": "runs/bob/b1", "position": 1}], "run_dir": "runs/bob/b1",
                               "step": None, "total_steps": None, "loss": None,
                               "message": "Queued, position 1: it starts by itself when the run in progress ends.",
                               "metrics": {}, "model_dir": None, "command": "finetune train runs/bob/b1/launch.yaml"}

    # alice queues a second run behind bob's: she sees its position, and of bob's run nothing at all.
    seconds = api.start(_config(uploads["alice"], "a2"), ALICE)
    assert seconds["queued"] and seconds["position"] == 2 and seconds["run_dir"] == "runs/alice/a2"
    status = api.status(ALICE)
    assert status["state"] == "running" and status["run_dir"] == "runs/alice/a1" and status["step"] == 3
    assert status["queued"] and status["position"] == 2
    assert status["queue"] == [{"run_dir": "runs/alice/a2", "position": 2}]
    assert "bob" not in json.dumps(status) and "b1" not in json.dumps(status)

    # The cap: one queued run a user here, said in one sentence; nothing is written for the refused Start.
    capped = api.start(_config(uploads["alice"], "a3"), ALICE)
    assert capped == {"started": False, "queued": False, "position": None, "run_dir": None, "command": "",
                      "message": "You already have 1 run waiting in the queue, this server's limit: wait until one "
                                 "of them has started, or cancel one, before queueing another."}
    assert not Path("runs/alice/a3").exists()

    # The page: the Run panel says "Queued, position N" with Cancel; the Runs tab lists the queued run.
    shown = ctl.follow.poll(None, request=BOB)
    assert shown.status == ("**A run is in progress (step 3/10).**\n\n**Queued, position 1** — `runs/bob/b1`: it "
                            "starts by itself when the run in progress ends.")
    assert shown.cancel_button["visible"] and shown.start_button["interactive"] and shown.log == ""
    assert "Queued, position 2" in ctl.follow.poll(None, request=ALICE).status
    table = ctl.runs.refresh(None, request=BOB).table
    assert list(table.Run) == ["b1"] and list(table.Status) == ["Queued (position 1)"]
    picked = ctl.runs.select(["b1"], request=BOB)
    assert picked.cancel["interactive"] and not picked.delete["interactive"]
    assert ctl.runs.delete(["b1"], request=BOB).message == ("⚠️ This run is waiting in the queue: cancel it before "
                                                            "deleting it.")
    # bob cannot take alice's run off the queue: it is not one of his.
    assert ctl.state.jobs.cancel(Path("runs/alice/a2"), "bob") == ""
    assert api.cancel("runs/alice/a2", BOB) == {"message": "'runs/alice/a2' is not one of your runs waiting in the "
                                                           "queue."}
    assert ctl.state.jobs.training.queue.position(Path("runs/alice/a2")) == 2

    # alice's run is done: bob's starts by itself, and alice's second moves up.
    _end("runs/alice/a1", "done")
    _training(ctl, "runs/bob/b1")
    assert api.status(BOB)["state"] == "running" and not api.status(BOB)["queued"]
    assert api.status(ALICE)["state"] == "queued" and api.status(ALICE)["position"] == 1
    assert ctl.runs.refresh(None, request=ALICE).table.Status.tolist() == ["Queued (position 1)", "Done"]

    # bob stops his: alice's second starts by itself.
    assert api.stop(BOB)["message"].startswith("Stopping after the current optimizer step")
    _training(ctl, "runs/alice/a2")
    assert ctl.runs.refresh(None, request=BOB).table.Status.tolist() == ["Stopped"]

    # bob queues again, and alice's run fails: his starts by itself.
    assert api.start(_config(uploads["bob"], "b2"), BOB)["position"] == 1
    _end("runs/alice/a2", "error")
    _training(ctl, "runs/bob/b2")
    assert ctl.runs.refresh(None, request=ALICE).table.Status.tolist() == ["Failed", "Done"]

    # Cancel in the Run panel: alice's queued run goes, with the folder nothing had run in.
    assert api.start(_config(uploads["alice"], "a4"), ALICE)["position"] == 1
    assert ctl.run.cancel(request=ALICE) == ("Cancelled the queued run `runs/alice/a4`; nothing had run, so its "
                                             "folder is removed.")
    assert not Path("runs/alice/a4").exists() and ctl.state.jobs.queued("alice") == []
    assert ctl.run.cancel(request=ALICE) == "Nothing to cancel: you have no run waiting in the queue."
    assert not ctl.follow.poll(None, request=ALICE).cancel_button["visible"]
    # And in the Runs tab: bob's run queued behind his own.
    assert api.start(_config(uploads["bob"], "b3"), BOB)["position"] == 1
    cancelled = ctl.runs.cancel(["b3"], request=BOB)
    assert cancelled.message == "Cancelled the queued run `runs/bob/b3`; nothing had run, so its folder is removed."
    assert "b3" not in list(cancelled.table.Run) and ctl.state.jobs.training.queue.entries() == []
    _end("runs/bob/b2", "done")
    _wait_for(lambda: ctl.state.jobs.status().state == "done")
    assert ctl.state.jobs.status().run_dir == Path("runs/bob/b2")  # nothing else started


def _launch(run_dir: Path) -> Path:
    """A run folder as Start leaves it: the marker and launch.yaml."""
    run_dir.mkdir(parents=True)
    (run_dir / ".finetune-run").touch()
    config = run_dir / "launch.yaml"
    config.write_text(json.dumps({"dataset": "x.csv", "output_dir": str(run_dir)}))
    return config


def test_the_queue_survives_a_new_app_process(tmp_path):
    runs = tmp_path / "runs"
    fake = _fake_python(tmp_path)
    configs = {name: _launch(runs / name) for name in ("r1", "r2", "r3")}
    # The first app process: r1 starts, r2 and r3 wait; then the app is gone (its child trains on).
    script = ("import sys; from pathlib import Path; from app.local.training import JobManager\n"
              f"jobs = JobManager(Path({str(runs)!r}), python={fake!r})\n"
              "print([jobs.submit(Path(c), Path(c).parent) for c in sys.argv[1:]])\n")
    first = subprocess.run([sys.executable, "-c", script, *map(str, configs.values())], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert first.stdout.strip() == "[0, 1, 2]", first.stderr
    assert [Path(q["run_dir"]).name for q in json.loads((runs / "queue.json").read_text())] == ["r2", "r3"]
    _wait_for(lambda: (runs / "r1" / "events.jsonl").is_file())
    # r1 ends while no app runs: the next app process starts r2 at once, and r3 when r2 ends.
    _end(str(runs / "r1"), "done")
    pid = json.loads((runs / "current.json").read_text())["pid"]
    _wait_for(lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2])
    jobs = JobManager(runs, python=fake)
    try:
        assert jobs.status().run_dir == runs / "r2" and jobs.status().active
        assert [(q.run_dir.name, n) for n, q in enumerate(jobs.queue.entries(), 1)] == [("r3", 1)]
        _end(str(runs / "r2"), "error")
        _wait_for(lambda: jobs.status().run_dir == runs / "r3" and jobs.status().progress)
        assert jobs.queue.entries() == [] and json.loads((runs / "queue.json").read_text()) == []
        _end(str(runs / "r3"), "done")
        assert _wait_for(lambda: jobs.status().state == "done")
    finally:
        jobs._closing = True
        if jobs.status().active:
            os.killpg(json.loads((runs / "current.json").read_text())["pid"], 9)
