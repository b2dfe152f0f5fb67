"""The app's runs on Slurm (app/remote/), against the stand-in Slurm of tests/fakeslurm.py.

The Run on list is the registry's: Slurm is offered while `sbatch` is on the PATH, with its own fields shown only
while it is chosen; a Space never offers it and a shared server only when its owner lists it. Start runs the CLI
(`finetune train … --backend slurm …`) as the run's child; a run whose launcher went away is followed again, and
Stop then cancels its job (`scancel`); the Runs tab says where each run trained. The fast tests use a stand-in for
the child that records its arguments; the slow one trains a tiny model through the real launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakeslurm import install

from app.door.access import Access, AccessError
from app.local.training import JobManager
from app.mapping import config_to_values
from app.remote import jobs as remote
from app.remote.choice import LOCAL, backend_fields, backend_of, launch_arguments, run_on_choices
from app.runs.listing import list_runs, status_title
from app.tabs import handlers
from app.train.run import backend_form_shown
from finetune.config.schema import ConfigError, from_dict
from finetune.remote import backend
from finetune.remote.backend import FormField

SLURM_ENTRY = ("Slurm: a job on this machine's cluster (sbatch), on the nodes and GPUs below", "slurm")
# A stand-in for `python -m finetune train CONFIG … -q` and `python -m finetune jobs follow RUN -q`: it records its
# arguments in the run folder, then waits for SIGINT (a Stop), when it exits as a stopped run does.
FAKE_CHILD = """
import json, os, signal, sys, time
args = sys.argv[1:]
train = args[2] == "train"
run = os.path.dirname(args[3]) if train else args[4]
with open(os.path.join(run, "child-train.json" if train else "child-follow.json"), "w") as f:
    json.dump({"argv": args}, f)
signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
time.sleep(120)
"""


def _wait_for(predicate, seconds: float = 120):
    deadline = time.time() + seconds
    while not (found := predicate()):
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.1)
    return found


def _job_state(tmp_path: Path, job_id: str = "1000") -> str:
    return json.loads((tmp_path / "slurm-state" / "jobs" / f"{job_id}.json").read_text())["state"]


def _controller(runs: Path, python: str):
    ctl = handlers(runs, JobManager(runs, python=python), access=Access())
    ctl.plan.plans = []  # what Start planned here: (budget, device)

    def planned(config, user, device="here"):  # the planner child is tested elsewhere
        ctl.plan.plans.append((config.memory_budget_gb, device))
        return {}

    ctl.plan.planned = planned
    return ctl


def _kill(runs: Path) -> None:
    current = runs / "current.json"
    if current.is_file():
        try:
            os.killpg(json.loads(current.read_text())["pid"], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Stub:
    """A third backend, registered by one line in `REGISTRY` for a test: nothing else is told of it."""

    name, title, options, on_host = "stub", "Stub cluster", ("racks",), True
    form = (FormField("racks", "Racks", int, "How many."),)

    def run_on(self) -> list[tuple[str, str]]:
        return [("Stub cluster: racks below", "stub")]

    def arguments(self, value: str, fields: dict) -> list[str]:
        return [a for f in self.form for a in f.argument(fields.get(f.option))]


STUB = Stub()


def test_run_on_lists_the_registrys_backends_slurm_while_sbatch_is_on_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert SLURM_ENTRY not in run_on_choices() and run_on_choices()[0] == ("This machine", LOCAL)
    with pytest.raises(ConfigError, match=r"^Slurm cannot be reached from this machine: choose one of local, "):
        backend_of("slurm")
    for key, value in install(tmp_path / "bin", tmp_path / "state").items():
        monkeypatch.setenv(key, value)
    assert run_on_choices()[-1] == SLURM_ENTRY and backend_of("slurm").name == "slurm"
    # Its own fields, shown only while it is chosen (the page's inputs of Start, in this order).
    assert [f.option for _, f in backend_fields()] == ["nodes", "gpus_per_node", "partition", "time"]
    assert [backend_form_shown(c)["slurm"]["visible"] for c in ("slurm", "t4-small", LOCAL, "z9")] == \
        [True, False, False, False]
    assert launch_arguments("slurm", {"nodes": 2.0, "gpus_per_node": 0, "partition": " ", "time": "1:00:00"}) == \
        ["--backend", "slurm", "--nodes", "2", "--gpus-per-node", "0", "--time", "1:00:00"]
    assert launch_arguments("t4-small", {"nodes": 2}) == ["--backend", "hf-jobs", "--flavor", "t4-small"]
    with pytest.raises(ConfigError, match=r"^Nodes is 'two': give a whole number\.$"):
        launch_arguments("slurm", {"nodes": "two"})
    # A third backend is one line in the registry: listed, with its fields, and its options at Start.
    monkeypatch.setitem(backend.REGISTRY, "stub", f"{__name__}:STUB")
    assert run_on_choices()[-1] == ("Stub cluster: racks below", "stub")
    assert list(backend_form_shown("stub").items()) == [("slurm", {"__type__": "update", "visible": False}),
                                                        ("stub", {"__type__": "update", "visible": True})]
    assert launch_arguments("stub", {"racks": 3, "nodes": 9}) == ["--backend", "stub", "--racks", "3"]


def test_a_space_never_offers_slurm_and_a_shared_server_only_when_its_owner_lists_it(slurm):
    slurm_backend = backend.get("slurm")
    accounts = Access("password", accounts=(("alice", "pw"),))
    listed = {"FINETUNE_BACKENDS": "slurm"}
    for access, env, refusal in (
            (Access("space", "owner"), listed, "Slurm is not offered on a Space: its jobs would run on the Space's "
                                               "own machine and account. Run on this machine, or use the app on the "
                                               "cluster's login node."),
            (accounts, {}, "Slurm is not offered on this server: its jobs run with the server's own account. Its "
                           "owner can offer it with FINETUNE_BACKENDS=slurm."),
            (Access("open"), {"FINETUNE_BACKENDS": "hf-jobs"}, None),
            (accounts, listed, ""), (Access(), {}, "")):
        runs = remote.RemoteRuns(access, env)
        said = runs.refusal(slurm_backend)
        assert said == refusal if refusal is not None else said.startswith("Slurm is not offered on this server")
        offered = [value for _, value in runs.choices()]
        assert ("slurm" in offered) == (said == "") and "t4-small" in offered  # Jobs: refused per user, at the pick
        if said:
            with pytest.raises(AccessError, match="^Slurm is not offered"):
                runs.launch("slurm", {"nodes": 1}, "alice", None)
        else:
            launch = runs.launch("slurm", {"nodes": 1}, "alice", None)
            assert (launch.args, launch.env, launch.title) == (["--backend", "slurm", "--nodes", "1"], None, "Slurm")
    assert remote.RemoteRuns(Access(), {}).launch(LOCAL, {}, None, None) is None


def test_a_slurm_run_starts_is_followed_again_after_a_restart_and_stop_cancels_its_job(slurm, tmp_path, monkeypatch,
                                                                                       cls_csv):
    """Start → `finetune train … --backend slurm` with the form's Slurm fields; the launcher goes away, a new app
    re-attaches (`finetune jobs follow`) in its own environment; Stop then cancels the job with `scancel`."""
    monkeypatch.chdir(tmp_path)
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_CHILD}")
    fake.chmod(0o755)
    runs = Path("runs")
    ctl = _controller(runs, str(fake))
    values = config_to_values(from_dict({"dataset": cls_csv, "effective_batch_size": 8, "eval_fraction": 0.0,
                                         "memory_budget_gb": 4}))
    try:
        refused = ctl.run.start_on("slurm", *values, "two", 0, "", "")
        assert not refused.started and refused.message == "Nodes is 'two': give a whole number."
        started = ctl.run.start_on("slurm", *values, 2, 0, "gpu", "1:00:00")
        assert started.started, started.message
        assert started.message.startswith("Started on Slurm. Reproduce from a terminal with `finetune train ")
        run_dir = Path(started.run_dir)
        argv = _wait_for(lambda: (run_dir / "child-train.json").is_file() and
                         json.loads((run_dir / "child-train.json").read_text() or "null"))["argv"]
        assert argv == ["-m", "finetune", "train", str(run_dir / "launch.yaml"), "--backend", "slurm", "--nodes", "2",
                        "--gpus-per-node", "0", "--partition", "gpu", "--time", "1:00:00", "-q"]
        assert started.command.endswith("--backend slurm --nodes 2 --gpus-per-node 0 --partition gpu --time 1:00:00")
        # Planned by the launcher for one GPU of the partition, not here for this machine.
        assert ctl.plan.plans == []
        # What the launcher does next: submit a job and record it in job.json.
        script = tmp_path / "job.sbatch"
        script.write_text("#!/bin/bash\nsleep 120\n")
        assert subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True).stdout == "1000\n"
        (run_dir / "job.json").write_text(json.dumps({"backend": "slurm", "job_id": "1000", "nodes": 2,
                                                      "partition": "gpu", "created": time.time(), "outcome": None}))
        assert "On Slurm (job 1000, 2 node(s) of gpu)" in ctl.follow.poll(None).status
        (info,) = list_runs(runs, ctl.state.jobs.status())
        assert status_title(info) == "Starting on Slurm"  # no event yet
        _kill(runs)  # the app, and its launcher with it, go away; the job runs on
        _wait_for(lambda: ctl.state.jobs.status().state == "failed")
        again = _controller(runs, str(fake))
        again.follow.poll(None)
        follow = _wait_for(lambda: (run_dir / "child-follow.json").is_file() and
                           json.loads((run_dir / "child-follow.json").read_text() or "null"))["argv"]
        assert follow == ["-m", "finetune", "jobs", "follow", str(run_dir), "-q"]
        assert _job_state(tmp_path) == "RUNNING"
        said = again.run.stop()
        assert said.endswith("The job on Slurm is cancelled (cancelled Slurm job 1000).")
        _wait_for(lambda: _job_state(tmp_path) == "CANCELLED")
        _wait_for(lambda: again.state.jobs.status().state == "stopped")
        assert status_title(list_runs(runs, again.state.jobs.status())[0]).startswith("Stopped on Slurm")
    finally:
        _kill(runs)
        subprocess.run(["scancel", "1000"], capture_output=True)


@pytest.mark.slow
def test_a_run_started_on_slurm_from_the_app_trains_there_and_stop_cancels_it(slurm, tmp_path, monkeypatch,
                                                                              tiny_bert, cls_csv):
    """The real launcher on the stand-in: the Run panel says where the job runs, the Runs tab lists the run on
    Slurm, and Stop (SIGINT to the launcher) cancels the job; job.json records the backend and how it ended."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runs = Path("runs")
    ctl = _controller(runs, sys.executable)
    values = config_to_values(from_dict({"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 8,
                                         "eval_fraction": 0.0, "epochs": 1000, "optimizer": "sgd"}))
    try:
        started = ctl.run.start_on("slurm", *values, None, 0, "", "")
        assert started.started, started.message
        run_dir = Path(started.run_dir).resolve()
        status = _wait_for(lambda: (s := ctl.state.jobs.status()).progress and s.progress[0] > 0 and s)
        assert "On Slurm (job 1000, 1 node(s) of debug)" in status.message
        assert [status_title(r) for r in list_runs(runs, status)] == ["Training on Slurm"]
        assert ctl.run.stop().startswith("Stopping after the current optimizer step")
        _wait_for(lambda: ctl.state.jobs.status().state == "stopped")
        assert _job_state(tmp_path) == "CANCELLED"
        job = json.loads((run_dir / "job.json").read_text())
        assert (job["backend"], job["outcome"]["status"]) == ("slurm", "stopped")
        assert status_title(list_runs(runs, ctl.state.jobs.status())[0]).startswith("Stopped on Slurm")
    finally:
        _kill(runs)
        subprocess.run(["scancel", "1000"], capture_output=True)
