"""The app's Export block and `/export` endpoints (app/export/inference.py): `finetune export` of the caller's own
finished run as a child process, through the access policy: another user's run, a path outside one's runs folder, an
unfinished run and a second export at once are refused in one sentence; the caller's run exports, with its progress,
files and (for a push) the same checks as Push to the Hub."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_train

from app.api import ScriptApi
from app.door.access import Access
from app.export.inference import InferenceExport
from app.local.queue import RunQueue
from app.local.training import JobStatus
from app.tabs import handlers
from finetune.config.schema import from_dict
from finetune.run.events import read_events


def _space() -> Access:
    return Access.from_env({"SPACE_ID": "owner/finetune", "SYSTEM": "spaces", "SPACE_AUTHOR_NAME": "owner",
                            "FINETUNE_ALLOWED_USERS": "alice,bob"}, "0.0.0.0")


def _signed_in(name: str | None) -> SimpleNamespace:
    info = {"userinfo": {"preferred_username": name}, "expires_at": time.time() + 3600} if name else {}
    return SimpleNamespace(session={"oauth_info": info} if name else {})


class _Jobs:
    """A job manager whose last job is `run`, in state `state`, started by `owner`."""

    def __init__(self, run: Path, owner: str | None, state: str = "done"):
        self.run, self.owner, self.state = run, owner, state
        self.queue = RunQueue(run.parents[1])  # nothing waits

    def status(self) -> JobStatus:
        return JobStatus(state=self.state, run_dir=self.run, events=read_events(self.run / "events.jsonl"),
                         owner=self.owner)


@pytest.fixture(scope="module")
def alices_run(tmp_path_factory, tiny_bert, cls_csv) -> Path:
    """A finished classification run in alice's runs folder of a shared server."""
    runs = tmp_path_factory.mktemp("app_export") / "runs"
    run_train(runs / "alice" / "run", model=tiny_bert, dataset=cls_csv, max_steps=1, effective_batch_size=8)
    return runs / "alice" / "run"


def _wait(exporter: InferenceExport, request, limit_s: float = 240) -> dict:
    deadline = time.time() + limit_s
    while (shown := exporter.status(request=request))["state"] == "running":
        assert time.time() < deadline, shown
        time.sleep(0.5)
    return shown


@pytest.mark.slow  # exports for three callers (36 s at load 9)
def test_only_the_callers_own_finished_run_exports(alices_run, tmp_path):
    runs = alices_run.parents[1]
    alice, bob = _signed_in("alice"), _signed_in("bob")
    controller = handlers(runs, _Jobs(alices_run, "alice"), access=_space())
    exporter = controller.inference
    api = ScriptApi(controller)
    assert api.handlers.inference is exporter  # the page and the API share it (one export at a time)
    # Bob sees no run of his, and cannot name alice's: not by its path, not through `..`.
    assert api.export(request=bob)["message"] == "Nothing to export yet: train a run to the end first."
    outside = api.export(run=str(alices_run), request=bob)
    assert not outside["started"] and "is outside the app's runs folder" in outside["message"]
    assert "may not contain '..'" in api.export(run="../alice/run", request=bob)["message"]
    assert api.export(request=_signed_in(None))["message"] == "Sign in with Hugging Face to train."
    assert api.export(format="onnx", request=alice)["message"] == "The format must be one of merged, gguf."
    # An unfinished run of alice's own: its config, no final model.
    unfinished = runs / "alice" / "half"
    unfinished.mkdir()
    shutil.copy(alices_run / "config.yaml", unfinished / "config.yaml")
    assert "has not finished (it stopped before the end)" in api.export(run="half", request=alice)["message"]
    running = handlers(runs, _Jobs(alices_run, "alice", "running"), access=_space())
    assert ScriptApi(running).export(request=alice)["message"] == ("The run has not finished: export it once it is "
                                                                   "done.")
    assert api.export_status(request=bob)["state"] == "idle"

    # Alice's finished run: a child `finetune export`, followed to the end.
    started = api.export(request=alice)
    assert started["started"] and started["command"] == f"finetune export {alices_run} --format merged"
    again = api.export(request=alice)
    assert again["message"] == "An export is in progress on this server: wait for it to finish."
    # Nor does a run start beside it on a shared server (one job at a time, either way).
    blocked = controller.run.start_run(from_dict({"model": "x", "dataset": "y"}), request=bob)
    assert not blocked.started and blocked.message == ("An export is in progress on this server: start the run "
                                                       "when it is done (one job at a time).")
    assert api.export_status(request=bob)["state"] == "idle"  # not his to follow
    shown = _wait(exporter, alice)
    assert shown["state"] == "done", shown
    assert shown["files"] == ["merged"] and shown["check"] is None
    assert shown["message"].startswith("✅ Exported merged weights (a transformers folder) in ")
    assert (alices_run / "export" / "merged" / "model.safetensors").is_file()
    assert str(runs) not in shown["message"]
    [zipped] = exporter.files(shown)
    assert zipped.endswith(".zip") and Path(zipped).stat().st_size > 0
    # The page: the block shows the result, enables Push the export; Bob's page stays empty.
    page = exporter.poll(None, request=alice)
    assert page["status"] == shown["message"] and page["push"]["interactive"]
    # (Bob has no finished run of his own: the block says so, and nothing of Alice's.)
    assert exporter.poll(None, request=bob)["status"] == "Nothing to export yet: train a run to the end first." \
        and not exporter.poll(None, request=bob)["push"]["interactive"]
    # A push of the export passes Push to the Hub's checks: alice may train but not push with the server's token.
    assert "Pushing uses the Space's owner's Hugging Face token" in exporter.push("alice/m", True,
                                                                                  request=alice)["message"]
    assert "Only the one who started the run" in exporter.push("bob/m", True, request=bob)["message"]


def test_a_refused_export_says_the_clis_sentence(alices_run, tmp_path):
    """GGUF of a classifier: the child's own refusal (exit 2), shown as the failure, nothing written."""
    run = tmp_path / "runs" / "run"
    shutil.copytree(alices_run, run, ignore=shutil.ignore_patterns("export", "export.log"))
    exporter = handlers(tmp_path / "runs", _Jobs(run, None), access=Access()).inference
    assert exporter.start("gguf", "q8_0", True)["started"]
    shown = _wait(exporter, None)
    assert shown["state"] == "failed"
    # In the Export block's words (issue 42): the kind's label, not its id; the Format choice, not a CLI flag.
    assert shown["message"] == ("GGUF is for models that generate text, and this run trained a text classification "
                                "model: export it with **Format** merged (a transformers folder) instead.")
    assert not (run / "export").exists()


def test_a_finished_run_that_can_become_a_gguf_fetches_the_converter_ahead_once(alices_run, tmp_path, monkeypatch):
    """Issue 42 row 10: the Export block fetches llama.cpp's converter in the background once it shows a finished
    run of a kind that exports GGUF (a classifier's cannot), so that the first export does not wait for it."""
    from finetune.use import llamacpp

    asked = []
    monkeypatch.setattr(llamacpp, "fetch_ahead", lambda: asked.append(1) or SimpleNamespace())
    run = tmp_path / "runs" / "run"
    shutil.copytree(alices_run, run, ignore=shutil.ignore_patterns("export", "export.log"))
    exporter = handlers(tmp_path / "runs", _Jobs(run, None), access=Access()).inference
    exporter.status()
    assert asked == []  # a classifier: nothing to fetch for
    causal = tmp_path / "runs" / "causal"
    shutil.copytree(run, causal)
    config = [line for line in (run / "config.yaml").read_text().splitlines() if not line.startswith("task:")]
    (causal / "config.yaml").write_text("\n".join([*config, "task: causal_lm", ""]))
    exporter = handlers(tmp_path / "runs", _Jobs(causal, None), access=Access()).inference
    for _ in range(3):
        exporter.status()
    assert asked == [1]  # once per app, however often the block asks
