"""The app's runs on Hugging Face Jobs (app/remote/) and its runs folder on a Space (app/door/persist.py).

Through the handlers and the API, with fake requests: the form's "Run on" choice reaches the training child as
`--backend hf-jobs --flavor F`; on a Space the signed-in user's OAuth token reaches it in its environment only, and
without one Jobs is refused in one sentence; Stop stops the child, which cancels the job; a job whose launcher went
away is followed again. The fast tests use a stand-in for the child that records its arguments and environment; the
slow one runs the real `finetune train … --backend hf-jobs` against the local stand-in of the Hub's Jobs API
(tests/fakehub.py, tests/fakejobs.py) and checks that Stop cancels the job there."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import constants as hf_constants

from app.api import ScriptApi
from app.door import persist
from app.door.access import Access
from app.local.training import JobManager
from app.mapping import COLUMN_FIELDS, config_to_values
from app.remote import jobs as remote
from app.remote.choice import LOCAL, flavor_of, run_on_choices
from app.tabs import handlers
from finetune.config.schema import ConfigError, from_dict
from finetune.remote.jobfile import JobHandle, write_handle

OWNER_SECRET = "hf_space_owner_secret"  # the Space's own HF_TOKEN: it must never reach a child or a job
ALICE_TOKEN = "hf_alice_oauth_token"
SPACE = {"SPACE_ID": "owner/finetune", "SYSTEM": "spaces", "SPACE_AUTHOR_NAME": "owner",
         "FINETUNE_ALLOWED_USERS": "alice"}
# A stand-in for `python -m finetune train CONFIG … -q` and `python -m finetune jobs follow RUN -q`: it records its
# arguments and environment in the run folder, then waits for SIGINT (a Stop), when it exits as a stopped run does.
FAKE_CHILD = """
import json, os, signal, sys, time
args = sys.argv[1:]
train = args[2] == "train"
run = os.path.dirname(args[3]) if train else args[4]
with open(os.path.join(run, "child-train.json" if train else "child-follow.json"), "w") as f:
    json.dump({"argv": args, "env": dict(os.environ)}, f)
signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
time.sleep(120)
"""


def _signed_in(name: str | None, token: str | None = ALICE_TOKEN, scope: str = "openid profile jobs"):
    """A request as Gradio's OAuth leaves it: the user, and their access token with its scopes."""
    if name is None:
        return SimpleNamespace(session={})
    info = {"userinfo": {"preferred_username": name}, "expires_at": time.time() + 3600, "scope": scope}
    if token:
        info["access_token"] = token
    return SimpleNamespace(session={"oauth_info": info})


ALICE = _signed_in("alice")


def _wait_for(predicate, seconds: float = 60):
    deadline = time.time() + seconds
    while not (found := predicate()):
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.1)
    return found


def _fake_python(tmp_path: Path) -> str:
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_CHILD}")
    fake.chmod(0o755)
    return str(fake)


def _kill(runs: Path) -> None:
    current = runs / "current.json"
    if current.is_file():
        try:
            os.killpg(json.loads(current.read_text())["pid"], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _controller(runs: Path, python: str, access: Access):
    jobs = JobManager(runs, python=python, env=access.child_env(os.environ) if access.shared else None)
    ctl = handlers(runs, jobs, access=access)
    plans = []

    def planned(config, user, device="here"):  # the planner child is tested elsewhere
        plans.append((config.memory_budget_gb, device))
        return {}

    ctl.plan.planned = planned
    return ctl, plans


@pytest.fixture
def space(tmp_path, monkeypatch, cls_csv):
    """A Space's controller (its owner's HF_TOKEN secret in the app's environment) with alice's upload; the
    training child is FAKE_CHILD."""
    monkeypatch.chdir(tmp_path)
    for key, value in {**SPACE, "HF_TOKEN": OWNER_SECRET}.items():
        monkeypatch.setenv(key, value)
    for key in ("FINETUNE_JOBS_IMAGE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    runs = Path("runs")
    ctl, plans = _controller(runs, _fake_python(tmp_path), Access.from_env(os.environ, "0.0.0.0"))
    gradio_copy = tmp_path / "gradio" / "cls.csv"
    gradio_copy.parent.mkdir()
    shutil.copyfile(cls_csv, gradio_copy)
    upload = ctl.dataset.on_upload(str(gradio_copy), "", "train", "classification", *[""] * len(COLUMN_FIELDS),
                                   request=ALICE).dataset
    yield ctl, plans, upload
    _kill(runs)


def _values(dataset: str, **values) -> list:
    return config_to_values(from_dict({"dataset": dataset, "effective_batch_size": 8, "eval_fraction": 0.0,
                                       **values}))


def _child(run_dir: Path, which: str = "train") -> dict:
    path = run_dir / f"child-{which}.json"
    _wait_for(path.is_file)
    return _wait_for(lambda: json.loads(path.read_text() or "null"))


def test_run_on_lists_this_machine_then_each_gpu_flavor_with_its_memory_and_price():
    choices = run_on_choices()
    assert choices[0] == ("This machine", LOCAL)
    labels = dict((value, label) for label, value in choices)
    assert labels["t4-small"] == "Hugging Face Jobs: t4-small — 1 × T4, 16 GB GPU memory, $0.40/h"
    assert labels["a10g-largex2"] == "Hugging Face Jobs: a10g-largex2 — 2 × A10G, 48 GB GPU memory, $3.00/h"
    assert "cpu-basic" not in labels and len(labels) == 23  # this machine and the 22 flavors with a GPU
    assert flavor_of(LOCAL) is None and flavor_of("") is None and flavor_of("h200").budget_gib == 131.32
    with pytest.raises(ConfigError, match=r"^Unknown flavor 'z9': choose one of t4-small, "):
        flavor_of("z9")


def test_a_start_on_jobs_runs_the_cli_with_the_flavor_and_the_users_token_only_in_its_environment(space):
    ctl, plans, upload = space
    started = ctl.run.start_on("t4-small", *_values(upload), request=ALICE)
    assert started.started, started.message
    run_dir = Path(started.run_dir)
    image = "hf.co/spaces/owner/finetune"
    jobs_args = ["--backend", "hf-jobs", "--flavor", "t4-small", "--image", image, "--namespace", "alice"]
    assert started.command == " ".join(["finetune", "train", f"{run_dir}/launch.yaml", *jobs_args])
    assert started.message.startswith("Started on Hugging Face Jobs (t4-small: 1 × T4 (16 GB), $0.40/h, billed "
                                      "to your account).")
    child = _child(run_dir)
    # The same child as a local run, with the Jobs options; the user's token in its environment and nowhere else.
    assert child["argv"] == ["-m", "finetune", "train", str(run_dir / "launch.yaml"), *jobs_args, "-q"]
    assert child["env"]["HF_TOKEN"] == ALICE_TOKEN and OWNER_SECRET not in json.dumps(child["env"])
    assert set(child["env"]) - {"HF_TOKEN", "PYTHONUNBUFFERED"} <= set(ctl.state.access.child_env(os.environ))
    for path in [*run_dir.rglob("*"), Path("runs/current.json")]:
        if path.is_file() and not path.name.startswith("child-"):
            assert ALICE_TOKEN not in path.read_text(errors="replace"), path
    assert ALICE_TOKEN not in started.message + started.command
    # The plan was checked for one of the flavor's GPUs (its 16 GB as 14.9 GiB), not for this machine.
    assert plans == [(14.9, "cuda")]
    # Stop stops the child (SIGINT: the real one cancels the job, see the slow test below).
    assert ctl.run.stop(request=ALICE).startswith("Stopping after the current optimizer step")
    stopped = _wait_for(lambda: (s := ctl.state.jobs.status()).state == "stopped" and s)
    assert stopped.returncode == 130
    # The API's start takes the same choice.
    api = ScriptApi(ctl)
    answer = api.start({"dataset": upload, "effective_batch_size": 8, "eval_fraction": 0.0}, run_on="l4x1",
                       request=ALICE)
    assert answer["started"] and answer["command"].endswith("--flavor l4x1 --image " + image + " --namespace alice")
    assert _child(Path(answer["run_dir"]))["env"]["HF_TOKEN"] == ALICE_TOKEN
    assert api.start({"dataset": upload}, run_on="z9", request=ALICE)["message"].startswith(
        "Unknown flavor 'z9': choose one of t4-small")


def test_without_the_users_own_token_a_space_refuses_jobs_in_one_sentence(space):
    ctl, plans, upload = space
    for request, sentence in ((_signed_in("alice", token=None), remote.NO_TOKEN),
                              (_signed_in("alice", scope="openid profile"), remote.NO_SCOPE),
                              (_signed_in(None), "Sign in with Hugging Face to train.")):
        refused = ctl.run.start_on("t4-small", *_values(upload), request=request)
        assert not refused.started and refused.message == sentence
        assert ScriptApi(ctl).start({"dataset": upload}, run_on="t4-small", request=request)["message"] == sentence
    assert remote.NO_TOKEN == ("Sign in with Hugging Face to run on Hugging Face Jobs: the job runs in your account, "
                               "with your token, and is billed to you, never to this Space's owner.")
    assert plans == [] and not list(Path("runs/alice").glob("2*")) and ctl.state.jobs.status().state == "idle"
    # This machine needs no token of the user's: the child gets none (and never the Space's own).
    local = ctl.run.start_on(LOCAL, *_values(upload), request=_signed_in("alice", token=None))
    assert local.started and local.command == f"finetune train {local.run_dir}/launch.yaml"
    assert "HF_TOKEN" not in _child(Path(local.run_dir))["env"]


def test_jobs_elsewhere_the_users_own_token_locally_and_nobodys_on_a_server_with_accounts(tmp_path, monkeypatch,
                                                                                         cls_csv):
    monkeypatch.chdir(tmp_path)
    for key in ("HF_TOKEN", "FINETUNE_JOBS_IMAGE", "SPACE_ID", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    runs = Path("runs")
    ctl, plans = _controller(runs, _fake_python(tmp_path), Access())
    values = _values(cls_csv)
    try:
        assert ctl.run.start_on("t4-small", *values).message == remote.NO_LOCAL_TOKEN
        monkeypatch.setenv("HF_TOKEN", "hf_mine")
        assert ctl.run.start_on("t4-small", *values).message == remote.NO_IMAGE
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert ctl.run.start_on("t4-small", *values).message == remote.OFFLINE
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.setenv("FINETUNE_JOBS_IMAGE", "hf.co/spaces/me/finetune")
        started = ctl.run.start_on("a10g-large", *values)
        assert started.started, started.message
        child = _child(Path(started.run_dir))
        # The one user's own environment, as a command typed in a terminal; no namespace: the token's user.
        assert child["argv"][4:-1] == ["--backend", "hf-jobs", "--flavor", "a10g-large", "--image",
                                       "hf.co/spaces/me/finetune"]
        assert child["env"]["HF_TOKEN"] == "hf_mine" and plans == [(22.35, "cuda")]
    finally:
        _kill(runs)
    accounts = Access("password", accounts=(("alice", "pw"),))
    ctl, _ = _controller(tmp_path / "shared", _fake_python(tmp_path), accounts)
    refused = ctl.run.start_on("t4-small", *values, request=SimpleNamespace(username="alice"))
    assert refused.message == remote.NOT_HERE


def _job_json(run_dir: Path, **extra) -> JobHandle:
    handle = JobHandle(run_dir=run_dir, job_id="0" * 23 + "1", namespace="alice", url="https://hf.co/jobs/alice/1",
                       endpoint="http://127.0.0.1:9", flavor="t4-small", gpus=1, image="hf.co/spaces/owner/finetune",
                       command=("timeout",), timeout_s=1800, stop_after_s=1500, bucket="alice/finetune-runs",
                       remote_dir="run-1", inputs_repo="alice/finetune-inputs", inputs_path="run-1/t",
                       inputs_revision=None, created=time.time())
    write_handle(handle, **extra)
    return handle


def test_a_job_is_followed_again_after_the_app_restarted_once_its_owner_has_a_token(space, tmp_path):
    ctl, _, upload = space
    started = ctl.run.start_on("t4-small", *_values(upload), request=ALICE)
    run_dir = Path(started.run_dir)
    _child(run_dir)
    handle = _job_json(run_dir)  # what the launcher writes once the job started
    shown = ctl.follow.poll(None, request=ALICE)
    assert "On Hugging Face Jobs (t4-small): https://hf.co/jobs/alice/1" in shown.status
    # The app (and with it the launcher) goes away; a new app process adopts the run.
    _kill(Path("runs"))
    _wait_for(lambda: ctl.state.jobs.status().state == "failed")
    again, _ = _controller(Path("runs"), _fake_python(tmp_path), ctl.state.access)
    again.follow.poll(None, request=_signed_in("alice", token=None))  # no token to follow it with: nothing yet
    again.follow.poll(None, request=_signed_in("bob"))  # not bob's
    assert not (run_dir / "child-follow.json").exists()
    again.follow.poll(None, request=ALICE)
    follower = _child(run_dir, "follow")
    assert follower["argv"] == ["-m", "finetune", "jobs", "follow", str(run_dir), "-q"]
    assert follower["env"]["HF_TOKEN"] == ALICE_TOKEN and OWNER_SECRET not in json.dumps(follower["env"])
    status = again.state.jobs.status()
    assert status.active and status.owner == "alice" and "On Hugging Face Jobs" in status.message
    # Once per app process: a follower that went away too is not started again and again by every poll.
    _kill(Path("runs"))
    _wait_for(lambda: not again.state.jobs.status().active)
    (run_dir / "child-follow.json").unlink()
    again.follow.poll(None, request=ALICE)
    time.sleep(1)
    assert not (run_dir / "child-follow.json").exists()
    # A job whose end the launcher recorded is not followed again, and the Run panel tells its end.
    write_handle(handle, outcome={"status": "stopped", "exit_code": 130,
                                  "message": "The job was cancelled; it had not written a checkpoint yet, so start "
                                             "it again."})
    third, _ = _controller(Path("runs"), _fake_python(tmp_path), ctl.state.access)
    shown = third.follow.poll(None, request=ALICE)
    assert "Stopped" in shown.status and "The job was cancelled" in shown.status
    assert not (run_dir / "child-follow.json").exists()


def test_stop_after_a_re_attach_cancels_the_job_from_the_app_or_says_it_cannot(space, tmp_path, monkeypatch):
    from finetune.remote import hfjobs

    ctl, _, upload = space
    run_dir = Path(ctl.run.start_on("t4-small", *_values(upload), request=ALICE).run_dir)
    _child(run_dir)
    handle = _job_json(run_dir)
    _kill(Path("runs"))  # the app and its launcher go away; a new app process follows the job again
    _wait_for(lambda: ctl.state.jobs.status().state == "failed")
    again, _ = _controller(Path("runs"), _fake_python(tmp_path), ctl.state.access)
    again.follow.poll(None, request=ALICE)
    _child(run_dir, "follow")
    cancelled = []
    monkeypatch.setattr(hfjobs, "cancel", lambda job, token=None: cancelled.append((job.job_id, token)))
    # The follower is stopped by the signal before it can cancel (as one that still starts is): the app cancels.
    said = again.run.stop(request=ALICE)
    assert said.startswith("Stopping after the current optimizer step") and said.endswith(
        "The job on Hugging Face Jobs is cancelled: its billing stops.")
    assert cancelled == [(handle.job_id, ALICE_TOKEN)]  # was none: the job ran on to COMPLETED

    def unreachable(job, token=None):
        raise hfjobs.JobRefused("The Hub refused to cancel job 1 (the token is not valid).")

    monkeypatch.setattr(hfjobs, "cancel", unreachable)
    assert again.state.remote.cancel(again.state.jobs.status(), ALICE) == (
        "⚠️ The app could not cancel the job on Hugging Face Jobs (The Hub refused to cancel job 1 (the token is not "
        "valid)): cancel it on its page, https://hf.co/jobs/alice/1, or it runs on, billed to its account.")


# --- the runs folder on a Space
OVERLAY = "22 1 0:21 / / rw,relatime - overlay overlay rw,lowerdir=/l\n"
BUCKET = "26 22 0:40 / /data rw,nosuid,nodev - fuse hf-mount rw,user_id=1000\n"


def _mounts(tmp_path: Path, monkeypatch, *lines: str) -> None:
    table = tmp_path / "mountinfo"
    table.write_text("".join(lines))
    monkeypatch.setattr(persist, "MOUNTINFO", str(table))


def test_on_a_space_the_runs_go_to_a_mounted_bucket_or_the_page_says_they_are_lost(tmp_path, monkeypatch):
    runs = Path("/home/user/runs")
    _mounts(tmp_path, monkeypatch, OVERLAY, BUCKET)
    assert persist.runs_folder(runs, SPACE) == Path("/data/runs")
    assert persist.restart_notice(Path("/data/runs"), SPACE) == ""
    assert persist.runs_folder(runs, {}) == runs  # not a Space: the folder asked for
    _mounts(tmp_path, monkeypatch, OVERLAY)  # nothing persistent mounted
    assert persist.runs_folder(runs, SPACE) == runs
    assert persist.restart_notice(runs, SPACE) == persist.LOST_ON_RESTART
    assert persist.LOST_ON_RESTART.startswith("⚠️ **Runs on this Space are lost when it restarts**") and \
        "Push to the Hub" in persist.LOST_ON_RESTART
    assert persist.restart_notice(runs, {}) == ""
    _mounts(tmp_path, monkeypatch, OVERLAY, "25 22 8:1 /srv /home/user/runs rw - ext4 /dev/sda1 rw\n")
    assert persist.runs_folder(runs, SPACE) == runs and persist.restart_notice(runs, SPACE) == ""


def test_the_page_of_a_space_without_persistent_storage_says_runs_are_lost(tmp_path, monkeypatch):
    from app.page import build

    monkeypatch.setenv("SPACE_ID", SPACE["SPACE_ID"])  # (the sign-in of a real Space needs its OAuth app)
    _mounts(tmp_path, monkeypatch, OVERLAY)
    app = build(tmp_path / "runs")
    notes = [b for b in app.demo.blocks.values() if getattr(b, "elem_id", None) == "restart-notice"]
    assert [n.value for n in notes] == [persist.LOST_ON_RESTART]
    assert app.handlers.state.restart_notice == persist.LOST_ON_RESTART
    _mounts(tmp_path, monkeypatch, OVERLAY, BUCKET.replace("/data", str(tmp_path)))
    app = build(tmp_path / "runs")
    assert not [b for b in app.demo.blocks.values() if getattr(b, "elem_id", None) == "restart-notice"]


# --- the real launcher against the stand-in of the Hub's Jobs API
@pytest.fixture
def hub(monkeypatch):
    """The stand-in Hub (tests/fakehub.py); this process and its children may reach nothing but it."""
    from fakehub import fake_hub, loopback_only

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    with loopback_only(), fake_hub() as hub:
        yield hub


def _record(event: str, **values) -> str:
    from finetune.run.events import LOG_PREFIX

    return LOG_PREFIX + json.dumps({"event": event, "time": time.time(), **values})


@pytest.mark.slow
def test_stop_cancels_the_signed_in_users_job_which_ran_with_their_token_only(tmp_path, monkeypatch, hub, cls_csv):
    import fakehub
    from conftest import ROOT
    from fakejobs import JobScript

    monkeypatch.chdir(tmp_path)
    # Were the Space owner's token used anywhere, the stand-in would serve it (and the test see it).
    monkeypatch.setitem(fakehub.TOKENS, OWNER_SECRET, ("owner", "write"))
    user_token = "hf_write"  # alice's, as the stand-in knows her
    env = {**SPACE, "HF_TOKEN": OWNER_SECRET, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"),
           "PYTHONPATH": os.pathsep.join([fakehub.loopback_site(tmp_path / "guard"), str(ROOT)])}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    access = Access.from_env(os.environ, "0.0.0.0")
    runs = Path("runs")
    ctl = handlers(runs, JobManager(runs, env=access.child_env(os.environ)), access=access)
    ctl.plan.planned = lambda config, user, device="here": {}  # the launcher plans for the flavor itself
    alice = _signed_in("alice", token=user_token)
    gradio_copy = tmp_path / "gradio" / "cls.csv"
    gradio_copy.parent.mkdir()
    shutil.copyfile(cls_csv, gradio_copy)
    upload = ctl.dataset.on_upload(str(gradio_copy), "", "train", "classification", *[""] * len(COLUMN_FIELDS),
                                   request=alice).dataset

    def script(job, config):  # a job that has started training, until it is cancelled
        out = config["output_dir"]
        return JobScript(lines=[_record("start", step=0, resumed=False, total_steps=3, steps_per_epoch=3,
                                        num_train_samples=30, num_eval_samples=0, micro_batch_size=8,
                                        grad_accum_steps=1, num_processes=1, effective_batch_size=8, precision="bf16",
                                        device="cuda:0", run_dir=out),
                                _record("step", step=1, epoch=0.3, loss=0.7, grad_norm=1.0, lr=1e-4, samples=8,
                                        tokens=80, skipped=0, samples_per_s=50.0),
                                "note: held here until cancelled"], hold_after=2)

    hub.jobs.script = script
    try:
        started = ctl.run.start_on("t4-small", *_values(upload, max_steps=3), request=alice)
        assert started.started, started.message
        run_dir = Path(started.run_dir)
        running = _wait_for(lambda: (s := ctl.state.jobs.status()).last("step") and s, seconds=240)
        assert running.state == "running", running.output_tail
        job = hub.jobs.only()
        assert (job.namespace, job.spec["flavor"], job.spec.get("spaceId")) == ("alice", "t4-small",
                                                                                "owner/finetune")
        assert job.spec["secrets"] == {"HF_TOKEN": user_token}
        assert user_token not in json.dumps({k: v for k, v in job.spec.items() if k != "secrets"})
        shown = ctl.follow.poll(None, request=alice)
        assert f"On Hugging Face Jobs (t4-small): {hub.url}/jobs/alice/{job.id}" in shown.status
        assert ctl.run.stop(request=alice).startswith("Stopping after the current optimizer step")
        stopped = _wait_for(lambda: (s := ctl.state.jobs.status()).state != "stopping" and not s.active and s,
                            seconds=120)
    finally:
        _kill(runs)
    assert stopped.state == "stopped", stopped.output_tail
    assert stopped.message == "The job was cancelled; it had not written a checkpoint yet, so start it again."
    assert ("POST", f"/api/jobs/alice/{job.id}/cancel", user_token) in hub.requests and job.stage == "CANCELED"
    assert {token for _, _, token in hub.requests if token} == {user_token}  # never the Space's own token
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert user_token.encode() not in path.read_bytes() and OWNER_SECRET.encode() not in path.read_bytes()


def test_plan_follows_run_on_and_a_flavor_says_what_it_lacks_when_it_is_picked(tmp_path, monkeypatch, cls_csv):
    """Issue 42 row 5. Before: Plan planned for this machine's RAM ("3 % of the 23.50 GiB budget") with a Jobs
    flavor under Run on, and offline or no token was said only at Start."""
    monkeypatch.chdir(tmp_path)
    for key in ("HF_TOKEN", "FINETUNE_JOBS_IMAGE", "SPACE_ID", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    runs = Path("runs")
    ctl, plans = _controller(runs, _fake_python(tmp_path), Access())
    values = _values(cls_csv)
    shown = ctl.plan.plan_for("here", "a10g-large", *values)
    assert shown.error == "" and plans == [(22.35, "cuda")]  # one A10G's memory, planned as a CUDA GPU
    assert shown.text.startswith("Planned for one GPU of Hugging Face Jobs' a10g-large: 1 × A10G (24 GB), $1.50/h "
                                 "(22.35 GiB), the Run on choice.")
    ctl.plan.plan_for("here", LOCAL, *values)
    assert plans[-1] == (None, "here")  # this machine: as the Plan for choice says
    ctl.plan.plan_for("here", "a10g-large", *_values(cls_csv, memory_budget_gb=8))
    assert plans[-1] == (8, "cuda")  # a smaller budget of the user's is kept, as Start keeps it
    # What the flavor lacks here is said when it is picked, not at Start.
    assert ctl.run.run_on_note("t4-small") == f"⚠️ {remote.NO_LOCAL_TOKEN}"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert ctl.run.run_on_note("t4-small") == f"⚠️ {remote.OFFLINE}"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_TOKEN", "hf_mine")
    monkeypatch.setenv("FINETUNE_JOBS_IMAGE", "hf.co/spaces/me/finetune")
    assert ctl.run.run_on_note("t4-small").startswith("Runs on Hugging Face Jobs' t4-small: 1 × T4")
    assert ctl.run.run_on_note(LOCAL) == ""
    assert ctl.run.run_on_note("no-such-flavor").startswith("⚠️ ")
