"""A shared server (a Space, a public host, or accounts): each way a stranger could misuse the app now fails with its
sentence. The policy is tested as a pure object; the handlers and the API with fake requests and a stand-in for the
training child that writes a few events and its environment; the served files over HTTP."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from app.api import ScriptApi
from app.door.access import ANYONE, NO_REMOTE_CODE, Access, AccessError, resolve_output_dir
from app.local.training import JobManager
from app.mapping import COLUMN_FIELDS
from app.tabs import handlers
from finetune.config.schema import from_dict

ALICE, BOB, ANON = (SimpleNamespace(username=name) for name in ("alice", "bob", None))
PASSWORDS = Access("password", accounts=(("alice", "a-secret"), ("bob", "b-secret")))
# A stand-in for `python -m finetune train CONFIG -q`: it writes the events of a run at step 120 of 400 and its own
# environment, then trains until SIGINT, when it stops like the real loop does.
FAKE_CHILD = """
import json, os, signal, sys, time, yaml
run = yaml.safe_load(open(sys.argv[4]))["output_dir"]
json.dump(dict(os.environ), open(os.path.join(run, "env.json"), "w"))
now = time.time()
start = {"event": "start", "time": now, "step": 0, "total_steps": 400, "micro_batch_size": 8, "grad_accum_steps": 1,
         "num_processes": 1, "effective_batch_size": 8, "precision": "fp32", "device": "cpu", "resumed": False}
step = {"event": "step", "time": now, "step": 120, "loss": 0.5, "lr": 1e-4, "grad_norm": 1.0, "samples_per_s": 9.0,
        "skipped": 0, "epoch": 1.5}
def stop(*_):
    with open(os.path.join(run, "events.jsonl"), "a") as f:
        f.write(json.dumps({"event": "stopped", "time": time.time(), "step": 120, "checkpoint": "c"}) + "\\n")
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
with open(os.path.join(run, "events.jsonl"), "a") as f:
    f.write(json.dumps(start) + "\\n" + json.dumps(step) + "\\n")
time.sleep(120)
"""


def _space(env: dict[str, str] | None = None) -> Access:
    return Access.from_env({"SPACE_ID": "owner/finetune", "SYSTEM": "spaces", "SPACE_AUTHOR_NAME": "owner",
                            "FINETUNE_ALLOWED_USERS": "alice, @bob", **(env or {})}, "0.0.0.0")


def _signed_in(name: str, expires_at: float | None = None) -> SimpleNamespace:
    """A request as Gradio's OAuth session middleware leaves it."""
    return SimpleNamespace(session={"oauth_info": {"userinfo": {"preferred_username": name},
                                                   "expires_at": expires_at or time.time() + 3600}})


# --- the policy
def test_the_mode_follows_the_host_the_space_and_the_accounts():
    assert Access.from_env({}, "127.0.0.1") == Access() and not Access().shared
    assert Access.from_env({}, "localhost").mode == "local" and Access.from_env({}, "::1").mode == "local"
    with pytest.raises(AccessError, match="^Listening on 0.0.0.0 lets anyone who can reach it train on this "
                                          "machine: set FINETUNE_USERS=name:password"):
        Access.from_env({}, "0.0.0.0")
    assert Access.from_env({}, "0.0.0.0", no_auth=True).mode == "open"
    # Accounts turn the shared mode on even on loopback (that is how one machine gets two users).
    users = Access.from_env({"FINETUNE_USERS": "alice:a-secret,bob:b:c", "FINETUNE_PASSWORD": "p"}, "127.0.0.1")
    assert users.mode == "password" and users.shared
    assert users.accounts == (("alice", "a-secret"), ("bob", "b:c"), ("admin", "p"))
    assert users.check_password("bob", "b:c") and not users.check_password("bob", "b") \
        and not users.check_password("eve", "b:c")
    with pytest.raises(AccessError, match="name:password pairs"):
        Access.from_env({"FINETUNE_USERS": "alice"}, "0.0.0.0")
    with pytest.raises(AccessError, match="'../x' cannot be used"):
        Access.from_env({"FINETUNE_USERS": "../x:pw"}, "0.0.0.0")
    assert Access.from_env({"SPACE_ID": "owner/finetune"}, "127.0.0.1").mode == "local"  # not on a Space
    space = _space({"FINETUNE_USERS": "alice:a"})
    assert space.mode == "space" and space.owner == "owner" and space.allowed == {"alice", "bob"}


def test_who_asks_and_who_may_train():
    space = _space()
    assert space.identify(_signed_in("alice")) == "alice"
    assert space.identify(_signed_in("alice", expires_at=time.time() - 1)) is None  # an expired sign-in
    assert space.identify(SimpleNamespace()) is None and space.identify(None) is None
    assert [space.may_run(u) for u in ("owner", "alice", "bob", "eve", None)] == [True, True, True, False, False]
    assert space.refusal(None) == "Sign in with Hugging Face to train."
    assert space.refusal("eve") == ("@eve is not allowed to train on this Space (ask its owner to add you to "
                                    "FINETUNE_ALLOWED_USERS).")
    assert PASSWORDS.identify(ALICE) == "alice" and PASSWORDS.identify(ANON) is None
    assert PASSWORDS.may_run("bob") and not PASSWORDS.may_run("eve") and not PASSWORDS.may_run(None)
    assert PASSWORDS.owns("alice", "alice") and not PASSWORDS.owns("bob", "alice")
    assert Access().identify(ANON) is None and Access().may_run(None) and Access().owns(None, None)
    assert Access("open").identify(ANON) == ANYONE and Access("open").owns(ANYONE, ANYONE)


def test_files_resolve_inside_the_users_runs_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    assert PASSWORDS.home(runs, "alice") == runs / "alice" and Access().home(runs, None) == runs
    assert PASSWORDS.uploads(runs, "alice") == runs / "uploads" / "alice"
    home = runs / "alice"
    assert resolve_output_dir("first", home) == home / "first"
    assert resolve_output_dir("runs/alice/first", home) == home / "first"  # already inside: kept
    assert resolve_output_dir("  ", home) is None
    with pytest.raises(AccessError, match=r"^output_dir '/etc/x' is outside the app's runs folder"):
        resolve_output_dir("/etc/x", home)
    with pytest.raises(AccessError, match=r"^output_dir '\.\./x' may not contain '\.\.'"):
        resolve_output_dir("../x", home)


def test_the_child_gets_no_secrets_on_a_shared_server():
    env = {"PATH": "/bin", "HOME": "/h", "HF_HOME": "/hf", "LC_ALL": "C", "HF_TOKEN": "hf_x", "AWS_SECRET": "s",
           "OAUTH_CLIENT_SECRET": "o", "CUDA_VISIBLE_DEVICES": "0"}
    assert PASSWORDS.child_env(env) == {"PATH": "/bin", "HOME": "/h", "HF_HOME": "/hf", "LC_ALL": "C",
                                        "CUDA_VISIBLE_DEVICES": "0", "USE_HUB_KERNELS": "NO"}
    assert Access().child_env(env) == env  # locally: the user's own environment, as on the command line


# --- the handlers and the API, as alice, bob and a stranger
@pytest.fixture
def shared(tmp_path, monkeypatch, cls_csv):
    """A password-mode controller whose training child is FAKE_CHILD, with an upload of alice's and of bob's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_planted_secret")
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_CHILD}")
    fake.chmod(0o755)
    runs = Path("runs")
    jobs = JobManager(runs, python=str(fake), env=PASSWORDS.child_env(os.environ))
    ctl = handlers(runs, jobs, access=PASSWORDS)
    uploads = {}
    for who, req in (("alice", ALICE), ("bob", BOB)):
        # Gradio hands each upload over as a temporary copy, which the app moves into the user's uploads.
        gradio_copy = tmp_path / f"gradio-{who}" / "cls.csv"
        gradio_copy.parent.mkdir()
        shutil.copyfile(cls_csv, gradio_copy)
        uploads[who] = ctl.dataset.on_upload(str(gradio_copy), "", "train", "classification",
                                             *[""] * len(COLUMN_FIELDS), request=req).dataset
    yield ctl, uploads
    status = jobs.status()
    if status.active:
        os.killpg(json.loads((runs / "current.json").read_text())["pid"], 9)


def _config(**values):
    return from_dict({"effective_batch_size": 8, "eval_fraction": 0.0, **values})


def test_uploads_are_each_users_own_and_other_files_are_not_read(shared, tmp_path, cls_csv):
    ctl, uploads = shared
    assert uploads["alice"].startswith("runs/uploads/alice/") and uploads["bob"].startswith("runs/uploads/bob/")
    no_columns = [""] * len(COLUMN_FIELDS)
    mine = ctl.dataset.refresh_dataset(uploads["alice"], "", "train", "classification", *no_columns, request=ALICE)
    assert mine.error == "" and len(mine.preview) == 5
    for source in (cls_csv, uploads["bob"], "/etc/passwd.csv"):
        refused = ctl.dataset.refresh_dataset(source, "", "train", "classification", *no_columns, request=ALICE)
        # The page names the form's field (the API's message keeps the config key `dataset`).
        assert refused.error == (f"⚠️ **Dataset** {source!r} is not one of your uploads: upload the file, or give a "
                                 "Hugging Face hub dataset id.") and refused.preview.empty
        started = ctl.run.start_run(_config(dataset=source), request=ALICE)
        assert not started.started and started.dataset_note == refused.error
    assert not ctl.run.start_run(_config(dataset=uploads["alice"], eval_dataset=cls_csv), request=ALICE).started
    model = ctl.run.start_run(_config(model=str(tmp_path), dataset=uploads["alice"]), request=ALICE)
    assert model.message == "Local model folders cannot be used on a shared server: give a Hugging Face hub id."
    assert ctl.state.jobs.status().state == "idle"


def test_remote_code_and_paths_outside_the_runs_folder_are_refused(shared, tmp_path):
    ctl, uploads = shared
    data = uploads["alice"]
    remote = ctl.run.start_run(_config(dataset=data, trust_remote_code=True), request=ALICE)
    assert not remote.started and remote.message == NO_REMOTE_CODE == "trust_remote_code is disabled on a shared " \
        "server."
    with pytest.raises(Exception, match="trust_remote_code is disabled"):
        ctl.plan.make_plan(_config(dataset=data, trust_remote_code=True), request=ALICE)
    elsewhere = tmp_path / "important"
    for typed in (str(elsewhere), "../important", "../../x"):
        refused = ctl.run.start_run(_config(dataset=data, output_dir=typed), request=ALICE)
        assert not refused.started and refused.message.startswith(f"output_dir {typed!r} ")
    assert not elsewhere.exists() and not list(tmp_path.glob("*.yaml")) and not list(tmp_path.glob("*.log"))
    stranger = ctl.run.start_run(_config(dataset=data), request=ANON)
    assert not stranger.started and stranger.message == "Sign in to train."
    assert ctl.state.jobs.status().state == "idle"


def test_a_run_belongs_to_the_one_who_started_it(shared):
    ctl, uploads = shared
    started = ctl.run.start_run(_config(dataset=uploads["alice"], output_dir="mine"), request=ALICE)
    assert started.started, started.message
    run_dir = Path("runs/alice/mine")
    assert started.run_dir == str(run_dir) and started.command == f"finetune train {run_dir}/launch.yaml"
    assert sorted(p.name for p in run_dir.iterdir())[:3] == [".finetune-run", "launch.log", "launch.yaml"]
    deadline = time.time() + 30
    while "step 120" not in (shown := ctl.follow.poll(None, request=BOB)).status:
        assert time.time() < deadline, shown.status
        time.sleep(0.2)

    # The child got the environment it needs, and none of the app's secrets.
    env = json.loads((run_dir / "env.json").read_text())
    assert "HF_TOKEN" not in env and env["PATH"] == os.environ["PATH"] and env["PYTHONUNBUFFERED"] == "1"

    # Bob: that a run is in progress, at which step, and nothing else: no log, config, run dir, download or Stop.
    assert shown.status == "**A run is in progress (step 120/400).**"
    assert shown.log == "" and shown.run_dir == "" and shown.metrics is None and shown.loss_curve is None
    assert "120" not in shown.progress and shown.stats == "" and shown.command == gr.skip()
    assert ctl.publish.model(None, request=BOB)["download"]["value"] is None and not shown.stop_button["interactive"]
    assert ctl.form.running_config(request=BOB).values == {}
    assert ctl.run.stop(request=BOB) == "⚠️ Only the one who started the run in progress can stop it."
    assert ctl.run.resume(request=BOB).startswith("Nothing to resume")
    assert ctl.tryit.try_it("good", request=BOB).message.startswith("No trained model yet")
    # bob's Start waits in the queue (tests/test_app_queue.py), and says nothing of alice's run.
    queued = ctl.run.start_run(_config(dataset=uploads["bob"]), request=BOB)
    assert queued.queued and queued.position == 1 and "alice" not in queued.message
    assert ctl.run.cancel(request=BOB).startswith("Cancelled the queued run `runs/bob/")
    api = ScriptApi(ctl)
    assert api.status(BOB) == {"state": "running", "queued": False, "position": None, "queue": [], "run_dir": None,
                               "step": 120, "total_steps": 400, "loss": None,
                               "message": "A run is in progress (step 120/400).", "metrics": {}, "model_dir": None,
                               "command": ""}
    assert api.stop(BOB) == {"message": "Only the one who started the run in progress can stop it."}
    assert api.status(ANON)["message"] == "A run is in progress (step 120/400). Sign in to train."
    assert ctl.state.jobs.status().state == "running"  # all that left alice's run alone

    # Alice sees her run, and a restarted app still knows it is hers.
    mine = ctl.follow.poll(None, request=ALICE)
    assert str(run_dir) in mine.status and "step 120" in mine.log and mine.run_dir == str(run_dir)
    assert ctl.form.running_config(request=ALICE).values["dataset"] == uploads["alice"]
    assert api.status(ALICE)["run_dir"] == str(run_dir)
    assert json.loads(Path("runs/current.json").read_text())["owner"] == "alice"
    assert JobManager(Path("runs")).status().owner == "alice"
    assert api.stop(ALICE)["message"].startswith("Stopping after the current optimizer step")
    deadline = time.time() + 30
    while ctl.state.jobs.status().active:
        assert time.time() < deadline
        time.sleep(0.2)
    assert ctl.state.jobs.status().state == "stopped"
    # Alice's stopped run is not bob's business.
    assert ctl.follow.poll(None, request=BOB).status.startswith("**Ready.**")


@pytest.mark.slow  # builds the app twice (21 s at load 9)
def test_the_login_button_is_on_the_page_only_on_a_space(tmp_path, monkeypatch):
    from gradio import oauth

    from app.page import build

    # What a Space with `hf_oauth: true` sets (Gradio reads the OAuth variables when it is imported).
    monkeypatch.setenv("SPACE_ID", "owner/finetune")
    monkeypatch.setenv("SYSTEM", "spaces")
    for name in ("OAUTH_CLIENT_ID", "OAUTH_CLIENT_SECRET", "OAUTH_SCOPES", "OPENID_PROVIDER_URL"):
        monkeypatch.setattr(oauth, name, "https://huggingface.co" if name == "OPENID_PROVIDER_URL" else "x")

    def logins(access: Access) -> int:
        app = build(tmp_path / "runs", access=access)
        return sum(isinstance(b, gr.LoginButton) for b in app.demo.blocks.values())

    assert logins(_space()) == 1
    assert logins(PASSWORDS) == 0 and logins(Access()) == 0


# --- served files
@pytest.mark.slow
def test_nothing_under_runs_is_served_by_url(tmp_path):
    from conftest import served_app

    with served_app(tmp_path) as (url, runs):
        upload = runs / "uploads" / "rows-0123abcd.csv"
        run_file = runs / "20250101-000000" / "launch.yaml"
        for path in (upload, run_file):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("secret rows\n")
        for path in (upload, run_file):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{url}gradio_api/file={path.resolve()}", timeout=10)
            assert refused.value.code in (403, 404)


def test_the_space_asks_for_the_hugging_face_sign_in():
    import yaml
    from conftest import ROOT

    meta = yaml.safe_load((ROOT / "README.md").read_text().split("---\n", 2)[1])
    assert meta["hf_oauth"] is True


def test_a_zip_gradio_would_not_take_is_handed_out_from_a_private_temporary_folder(tmp_path, monkeypatch):
    import tempfile

    # As in the Docker image: the runs folder is neither under the working directory nor the temporary one.
    (tmp_path / "cwd").mkdir()
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    runs = tmp_path / "runs"
    zipped = runs / "r1" / "model.zip"
    zipped.parent.mkdir(parents=True)
    zipped.write_bytes(b"PK weights")
    ctl = handlers(runs, JobManager(runs))
    handed = Path(ctl.state.downloads.handout(zipped))
    assert handed.read_bytes() == b"PK weights" and handed.name == "r1-model.zip"
    assert handed.parent.parent == tmp_path / "tmp" and ctl.state.downloads.handout(zipped) == str(handed)


def test_the_run_panel_shows_a_run_folder_by_its_place_in_the_runs_folder(tmp_path):
    """On a shared server the Run directory box shows `runs/<user>/<run>`, as every message does, not where the
    server keeps it (an absolute --runs-dir)."""
    from types import SimpleNamespace

    from app.door.policy import RequestPolicy
    from app.follow import Follow
    from app.local.training import JobStatus
    from app.tabs import REFRESHES

    runs = tmp_path / "srv" / "runs"
    run_dir = runs / "alice" / "20261201-120000-978a2325"
    run_dir.mkdir(parents=True)
    policy = RequestPolicy(_space(), runs)
    status = JobStatus(state="running", run_dir=run_dir, owner="alice")
    state = SimpleNamespace(policy=policy, access=policy.access, runs_dir=runs, restart_notice="",
                            remote=SimpleNamespace(reattach=lambda *args: False),
                            jobs=SimpleNamespace(status=lambda: status, queued=lambda user: [], training=None))
    shown = Follow(state, REFRESHES).poll(None, request=_signed_in("alice"))
    assert shown.run_dir == "runs/alice/20261201-120000-978a2325"
    assert str(tmp_path) not in shown.run_dir
