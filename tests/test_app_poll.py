"""What an open page and an idle app ask of the machine. The page's poll (`app.follow`, and the Export block's own)
ticks each second while the caller's run trains or waits in the queue and every five seconds otherwise, so that an
idle page costs its browser and the server less; a press that may start a run is followed by a poll at once, so
that the run shows without waiting for a slow tick. The served app's Gradio queue looks for work every 50 ms, not
every millisecond, while nothing is queued. (The figures: bench/page_cost.py.)"""

from __future__ import annotations

import os
import signal
import socket
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from app import serve
from app.door import server
from app.door.access import Access
from app.door.policy import RequestPolicy
from app.export.inference import InferenceExport
from app.follow import IDLE_POLL_S, POLL_S, Follow
from app.local.training import JobStatus
from app.page import build
from app.tabs import REFRESHES

START = {"event": "start", "time": 0.0, "step": 0, "total_steps": 40, "micro_batch_size": 8, "grad_accum_steps": 1,
         "num_processes": 1, "effective_batch_size": 8, "precision": "fp32", "device": "cpu", "resumed": False}
STEP = {"event": "step", "time": 1.0, "step": 1, "loss": 0.5, "lr": 1e-4, "grad_norm": 1.0, "samples_per_s": 9.0,
        "skipped": 0, "epoch": 0.1}
ALICE, BOB = (SimpleNamespace(session={"oauth_info": {"userinfo": {"preferred_username": name},
                                                      "expires_at": 4e9}}) for name in ("alice", "bob"))


def _follow(runs: Path, job: dict, queued: dict) -> Follow:
    """The poll over a shared server's policy, with `job["status"]` as the current run and `queued[user]` as each
    user's queue (both changed by the test between ticks)."""
    access = Access.from_env({"SPACE_ID": "owner/finetune", "SYSTEM": "spaces", "SPACE_AUTHOR_NAME": "owner",
                              "FINETUNE_ALLOWED_USERS": "alice, bob"}, "0.0.0.0")
    policy = RequestPolicy(access, runs)
    jobs = SimpleNamespace(status=lambda: job["status"], training=None,
                           queued=lambda user: [(SimpleNamespace(run_dir=p), n)
                                                for n, p in enumerate(queued.get(user, []), 1)])
    state = SimpleNamespace(policy=policy, access=access, runs_dir=runs, restart_notice="", jobs=jobs,
                            remote=SimpleNamespace(reattach=lambda *args: False))
    return Follow(state, REFRESHES)


def _interval(shown) -> float | None:
    """The tick the poll set (None: it left the timer as it was)."""
    timer = shown.timer
    return None if timer == gr.skip() else timer.value


def test_the_poll_ticks_each_second_only_while_the_callers_run_trains_or_waits(tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / "alice" / "20261207-040000-aaaaaaaa"
    run_dir.mkdir(parents=True)
    job = {"status": JobStatus(state="idle")}
    queued: dict[str, list[Path]] = {}
    follow = _follow(runs, job, queued)

    # A new page with nothing to follow: every five seconds.
    idle = follow.poll(None, request=ALICE)
    assert _interval(idle) == IDLE_POLL_S and idle.signature[-1] == IDLE_POLL_S
    assert _interval(follow.poll(idle.signature, request=ALICE)) is None  # nothing changed: nothing sent

    # Alice's run trains: her page ticks each second from the next poll, and is not told so again while it trains.
    job["status"] = JobStatus(state="running", run_dir=run_dir, owner="alice", events=[START])
    training = follow.poll(idle.signature, request=ALICE)
    assert _interval(training) == POLL_S
    job["status"] = JobStatus(state="running", run_dir=run_dir, owner="alice", events=[START, STEP])
    step = follow.poll(training.signature, request=ALICE)
    assert step.views and _interval(step) is None
    # Bob's page shows only that a run is in progress: nothing of his to follow, every five seconds.
    assert _interval(follow.poll(None, request=BOB)) == IDLE_POLL_S

    # The run ends: back to five seconds, on the tick that shows it done.
    job["status"] = JobStatus(state="done", run_dir=run_dir, owner="alice", events=[START])
    done = follow.poll(step.signature, request=ALICE)
    assert _interval(done) == IDLE_POLL_S and "Done" in done.status

    # Bob's run waits in the queue behind another: his page follows it each second.
    queued["bob"] = [runs / "bob" / "20261207-041000-bbbbbbbb"]
    assert _interval(follow.poll(follow.poll(None, request=BOB).signature, request=BOB)) is None
    waiting = follow.poll(None, request=BOB)
    assert _interval(waiting) == POLL_S and "Queued, position 1" in waiting.status


def test_the_export_block_ticks_each_second_only_while_an_export_runs(tmp_path, monkeypatch):
    exporter = InferenceExport(SimpleNamespace(), pushes=None)
    shown = {"state": "idle", "run_dir": str(tmp_path), "message": "Pick a run.", "files": []}
    monkeypatch.setattr(exporter, "status", lambda request=None: shown)
    monkeypatch.setattr(exporter, "files", lambda shown: [])
    first = exporter.poll(None)
    assert first["timer"].value == IDLE_POLL_S
    assert exporter.poll(first["signature"]) == {}  # nothing changed
    shown.update(state="running", message="Exporting: merging (3 s)")
    running = exporter.poll(first["signature"])
    assert running["timer"].value == POLL_S
    shown.update(message="Exporting: merging (4 s)")
    assert "timer" not in exporter.poll(running["signature"])  # still each second: not sent again
    assert not running["button"]["interactive"] and not exporter.poll(None, "older")["button"]["interactive"]
    shown.update(state="done", message="✅ Exported merged weights")
    assert exporter.poll(running["signature"])["timer"].value == IDLE_POLL_S
    # No current run of the caller's: Export model acts on a run picked, and the poll (a page's first tick may come
    # after the pick) leaves it so.
    shown.update(state="idle", run_dir=None, message="Nothing to export yet: train a run to the end first.")
    assert not exporter.poll(None)["button"]["interactive"] and exporter.poll(None, "older")["button"]["interactive"]


def test_every_press_that_may_start_a_run_is_followed_by_a_poll_at_once(tmp_path):
    """Start, Start sweep, the Run panel's Resume and Cancel, and the Runs tab's Resume run, Cancel, Delete and
    Evaluate are each followed by the poll (off Gradio's queue, like its ticks); Export model by the Export block's.
    Both polls also run as the page loads, so that a new page does not wait five seconds for its first tick."""
    app = build(tmp_path / "runs")
    dependencies = {d["id"]: d for d in app.demo.get_config_file()["dependencies"]}

    def handler(i: int) -> str:
        fn = app.demo.fns[i].fn
        return getattr(getattr(fn, "handler", fn), "__qualname__", "")

    polls = {i: dependencies[i] for i in app.demo.fns if handler(i).endswith(".poll")}
    assert all(d["queue"] is False for d in polls.values())
    followed = {handler(d["trigger_after"]) for d in polls.values() if d["trigger_after"] is not None}
    assert followed == {"RunHandlers.start_on", "SweepHandlers.start_on", "RunHandlers.resume", "RunHandlers.cancel",
                        "RunsHandlers.resume", "RunsHandlers.cancel", "RunsHandlers.delete", "RunsHandlers.evaluate",
                        "InferenceExport.export"}
    # Each runs whatever its press answered (`.then`, not `.success`): a refused Start changes nothing to poll
    # for, but a queue that moved does.
    assert not any(d["trigger_only_on_success"] for d in polls.values())
    triggers = sorted(d["targets"][0][1] for d in polls.values() if d["trigger_after"] is None)
    assert triggers == ["load", "load", "tick", "tick"]  # the run's poll and the Export block's


def test_gradios_queue_looks_for_work_every_50_ms_and_an_older_gradio_is_left_alone():
    demo = gr.Blocks().queue()
    assert demo._queue.sleep_when_free < server.QUEUE_IDLE_S  # Gradio's own: every millisecond on Linux
    assert server.quiet_queue(demo) is demo and demo._queue.sleep_when_free == server.QUEUE_IDLE_S
    older = SimpleNamespace(_queue=SimpleNamespace())
    assert server.quiet_queue(older) is older and vars(older._queue) == {}


@pytest.mark.slow
def test_the_served_app_starts_with_the_quiet_queue_and_answers(tmp_path, monkeypatch):
    """`launch` as `python -m app` calls it (here in this process, not blocking): the queue it serves with looks for
    work every 50 ms, and the page is served."""
    monkeypatch.chdir(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ, sigterm = dict(os.environ), signal.getsignal(signal.SIGTERM)
    app = None
    try:
        app = serve.launch(server.build_parser().parse_args(["--port", str(port), "--runs-dir", "runs"]),
                           prevent_thread_lock=True)
        assert app.demo._queue.sleep_when_free == server.QUEUE_IDLE_S
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as answer:
            assert answer.status == 200
    finally:
        if app is not None:
            app.demo.close()
        os.environ.clear()
        os.environ.update(environ)
        signal.signal(signal.SIGTERM, sigterm)
