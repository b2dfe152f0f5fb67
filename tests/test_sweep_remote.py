"""`finetune sweep --backend hf-jobs|slurm --parallel N`: trials several at once as remote runs, against the stand-in
Hub Jobs (tests/fakejobs.py) and the stand-in Slurm (tests/fakeslurm.py), whose jobs play tests/fakesweepjob.py's
records instead of training: never more trials in flight than asked (the stand-ins' own record of their jobs), the
worst trial cancelled by median pruning on its mirrored evaluations, the best chosen from the runs' metrics; a sweep
killed outright re-attaches to the trials still running instead of starting them again; bad input is one sentence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from fakehub import fake_hub, loopback_only, loopback_site
from fakejobs import JobScript
from fakesweepjob import RATES, WORST, holds, records
from huggingface_hub import constants as hf_constants

from finetune.cli import main
from finetune.remote import backend
from finetune.run.events import LOG_PREFIX, read_events
from finetune.sweep.study import trial_folder

pytest.importorskip("optuna")

TOKEN = "hf_write"
IMAGE = "hf.co/spaces/alice/finetune"
TESTS = Path(__file__).resolve().parent


def _config(tmp_path: Path, tiny_bert: str, cls_csv: str, **sweep) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "model": tiny_bert, "dataset": cls_csv, "eval_fraction": 0.2, "max_steps": 2, "eval_every": 1,
        "effective_batch_size": 8, "output_dir": str(tmp_path / "runs" / "s"),
        "sweep": {"objective": "accuracy", "direction": "maximize", "trials": 4, "sampler": "grid",
                  "startup_trials": 1, "space": {"learning_rate": RATES}, **sweep}}), encoding="utf-8")
    return path


def _check_outcome(summary: dict, folder: Path) -> None:
    """Three trials complete with 1000 × their rate, the worst pruned at step 1; the best is the largest rate."""
    by_rate = {t["params"]["learning_rate"]: t for t in summary["trials"]}
    assert set(by_rate) == set(RATES) and len(summary["trials"]) == 4
    assert by_rate[WORST]["state"] == "pruned", by_rate[WORST]
    assert by_rate[WORST]["reason"].startswith("pruned at step 1: accuracy 0.1 trails the median")
    for rate in RATES[1:]:
        assert by_rate[rate]["state"] == "complete" and by_rate[rate]["value"] == pytest.approx(rate * 1000)
    assert summary["best"]["params"] == {"learning_rate": 4e-4} and summary["best"]["value"] == pytest.approx(0.4)
    for t in summary["trials"]:  # each trial a run folder of its own, grouped by its sweep.json
        record = json.loads((trial_folder(folder, t["number"]) / "sweep.json").read_text())
        assert (record["sweep"], record["trial"], record["state"]) == (folder.name, t["number"], t["state"])


# --- Hugging Face Jobs
@pytest.fixture
def hub(monkeypatch):
    """The stand-in Hub; this process may reach nothing but it."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    with loopback_only(), fake_hub() as hub:
        hub.jobs.script = trial_script
        yield hub


def trial_script(job, config: dict, *, hold: bool = True) -> JobScript:
    """A stand-in job playing fakesweepjob's records as its log lines, its model left in the bucket."""
    before, after = records(config, config["output_dir"])
    lines = [LOG_PREFIX + json.dumps(r) for r in before + after]
    return JobScript(lines=lines, delay=0.05, hold_after=len(before) if hold and holds(config) else None,
                     files={"model/config.json": b"{}"})


def _env(hub, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN", "SPACE_ID")}
    env.update(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_TOKEN_PATH=str(tmp_path / "no-stored-token"),
               PYTHONPATH=os.pathsep.join([loopback_site(tmp_path / "guard"), str(ROOT)]))
    return env


HF_OPTIONS = ("--backend", "hf-jobs", "--flavor", "t4-small", "--image", IMAGE)


def _here(hub, tmp_path: Path, monkeypatch) -> None:
    """`finetune.cli.main` in this process, talking to the stand-in."""
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    monkeypatch.delenv("SPACE_ID", raising=False)


def _wait_for(predicate, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not predicate():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.05)


@pytest.mark.slow
def test_four_trials_two_at_a_time_on_hugging_face_jobs(tmp_path, hub, tiny_bert, cls_csv, capsys, monkeypatch):
    _here(hub, tmp_path, monkeypatch)
    path = _config(tmp_path, tiny_bert, cls_csv)
    assert main(["sweep", str(path), *HF_OPTIONS, "--parallel", "2"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    folder = Path(summary["sweep_dir"])
    _check_outcome(summary, folder)
    # The Hub saw four jobs, two of them at once at most (and at some moment two).
    assert len(hub.jobs.jobs) == 4 and hub.jobs.most_at_once() == 2
    assert sorted(j.stage for j in hub.jobs.jobs.values()) == ["CANCELED", "COMPLETED", "COMPLETED", "COMPLETED"]
    # Each trial a normal remote run: its job.json, its events mirrored, the finished ones' model fetched.
    for t in summary["trials"]:
        run = trial_folder(folder, t["number"])
        assert json.loads((run / "job.json").read_text())["backend"] == "hf-jobs"
        assert [r["event"] for r in read_events(run / "events.jsonl")][:2] == ["start", "eval"]
        assert (run / "model" / "config.json").is_file() == (t["state"] == "complete")
    assert "cancelling its job" in captured.err


@pytest.mark.slow
def test_a_killed_sweep_re_attaches_to_its_running_trials_instead_of_starting_them_again(
        tmp_path, hub, tiny_bert, cls_csv, capsys, monkeypatch):
    """Every job waits after step 1 until the test lets it go; the sweep's process is killed (SIGKILL) with one
    trial finished and two in flight, one of which ends while no sweep runs; the sweep again (here, in this
    process) follows both to their end and starts only the fourth trial."""
    hub.jobs.script = lambda job, config: JobScript(**{**trial_script(job, config).__dict__, "hold_after": 2})
    path = _config(tmp_path, tiny_bert, cls_csv, pruning="none")
    proc = subprocess.Popen([sys.executable, "-m", "finetune", "sweep", str(path), *HF_OPTIONS, "--parallel", "2"],
                            env=_env(hub, tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    jobs = hub.jobs.jobs
    _wait_for(lambda: len(jobs) == 2 and all(len(j.lines) == 2 for j in jobs.values()))
    first = next(iter(jobs.values()))
    first.script.release.set()
    folder = tmp_path / "runs" / "s"
    _wait_for(lambda: '"complete"' in _text(folder / "summary.json"))
    _wait_for(lambda: len(jobs) == 3 and all(len(j.lines) >= 2 for j in jobs.values()))
    proc.kill()
    proc.wait(timeout=30)
    second, third = list(jobs.values())[1:]
    second.script.release.set()  # it finishes while no sweep follows it
    _wait_for(lambda: second.stage == "COMPLETED")

    hub.jobs.script = lambda job, config: trial_script(job, config, hold=False)  # the last trial's job runs through
    releaser = threading.Thread(target=lambda: (_wait_for(lambda: len(jobs) == 4), third.script.release.set()),
                                daemon=True)
    releaser.start()
    _here(hub, tmp_path, monkeypatch)
    assert main(["sweep", str(path), *HF_OPTIONS, "--parallel", "2"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    # Four jobs in all: the two the killed sweep left were followed again, not started again.
    assert len(jobs) == 4 and all(j.stage == "COMPLETED" for j in jobs.values())
    assert captured.err.count("re-attached to its job on Hugging Face Jobs") == 2
    assert "resuming: 1 of 4 trial(s) already finished" in captured.err
    assert [t["state"] for t in summary["trials"]] == ["complete"] * 4
    assert summary["best"]["params"] == {"learning_rate": 4e-4}


def _text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


# --- Slurm
def _stand_in_script(checked, *, run_dir: Path, name: str, workdir: Path, python: str = sys.executable) -> str:
    """A batch script that plays fakesweepjob's records into the shared run folder instead of training."""
    return "\n".join(["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --chdir={workdir}",
                      f"#SBATCH --output={run_dir / 'slurm.log'}", "#SBATCH --nodes=1",
                      f'exec "{python}" "{TESTS / "fakesweepjob.py"}" "{run_dir}"', ""])


@pytest.mark.slow
def test_four_trials_two_at_a_time_on_slurm(slurm, tmp_path, tiny_bert, cls_csv, capsys, monkeypatch):
    from fakeslurm import most_at_once

    from finetune.remote.slurm import cluster

    monkeypatch.setattr(cluster, "script", _stand_in_script)
    path = _config(tmp_path, tiny_bert, cls_csv)
    assert main(["sweep", str(path), "--backend", "slurm", "--gpus-per-node", "0", "--parallel", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    _check_outcome(summary, Path(summary["sweep_dir"]))
    jobs = [json.loads(p.read_text()) for p in (Path(slurm["FAKE_SLURM_DIR"]) / "jobs").glob("*.json")]
    assert len(jobs) == 4 and most_at_once(jobs) == 2
    assert sorted(j["state"] for j in jobs) == ["CANCELLED", "COMPLETED", "COMPLETED", "COMPLETED"]


# --- bad input
class _NoSweeps:
    """A backend that runs single runs only."""

    name, title, options, form, on_host, sweeps = "elsewhere", "Elsewhere", (), (), False, False

    def add_arguments(self, group) -> None:
        """None of its own."""


NO_SWEEPS = _NoSweeps()


@pytest.mark.parametrize(("extra", "said"), [
    (["--backend", "slurm", "--parallel", "0"], "--parallel is how many trials run at once, at least 1, not 0."),
    (["--parallel", "2"], "--parallel 2 runs trials at once on another backend, but here they train one at a time"),
    (["--backend", "elsewhere", "--parallel", "2"], "Elsewhere (--backend elsewhere) cannot run a sweep's trials"),
    (["--backend", "hf-jobs", "--parallel", "2"], "--backend hf-jobs needs --flavor"),
    (["--backend", "slurm", "--partition", "big"], "Partition 'big' is not on this cluster"),
    (["--backend", "slurm", "--detach"], "--detach starts one job and returns"),
    (["--flavor", "t4-small"], "--flavor is an option of --backend hf-jobs"),
])
def test_bad_input_is_one_sentence_and_exit_2_before_anything_runs(slurm, tmp_path, tiny_bert, cls_csv, capsys,
                                                                   monkeypatch, extra, said):
    monkeypatch.setitem(backend.REGISTRY, "elsewhere", f"{__name__}:NO_SWEEPS")
    path = _config(tmp_path, tiny_bert, cls_csv)
    assert main(["sweep", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert said in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists() and not (Path(slurm["FAKE_SLURM_DIR"]) / "jobs").exists()


@pytest.mark.slow
def test_ctrl_c_cancels_the_trials_in_flight_and_a_resumed_sweep_runs_their_parameters_again(
        slurm, tmp_path, tiny_bert, cls_csv, capsys, monkeypatch):
    from finetune.remote.slurm import cluster

    monkeypatch.setattr(cluster, "script", _stand_in_script)
    monkeypatch.setenv("FAKE_SWEEP_HOLD", "all")  # every job waits after its first evaluation
    state = Path(slurm["FAKE_SLURM_DIR"]) / "jobs"
    folder = tmp_path / "runs" / "s"

    def interrupt_when_both_wait() -> None:
        _wait_for(lambda: all('"eval"' in _text(trial_folder(folder, n) / "events.jsonl") for n in (0, 1)))
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: the sweep's stop handler in the main thread

    path = _config(tmp_path, tiny_bert, cls_csv, pruning="none")
    command = ["sweep", str(path), "--backend", "slurm", "--gpus-per-node", "0", "--parallel", "2"]
    waiter = threading.Thread(target=interrupt_when_both_wait, daemon=True)
    waiter.start()
    assert main(command) == 130
    waiter.join()
    err = capsys.readouterr().err
    jobs = [json.loads(p.read_text()) for p in state.glob("*.json")]
    assert sorted(j["state"] for j in jobs) == ["CANCELLED", "CANCELLED"]
    assert err.count("cancelling its job on Slurm") == 2 and "stopped; continue with: finetune sweep" in err
    stopped = [json.loads((trial_folder(folder, n) / "sweep.json").read_text()) for n in (0, 1)]
    assert [r["state"] for r in stopped] == ["stopped", "stopped"]

    monkeypatch.setenv("FAKE_SWEEP_HOLD", "none")  # this search does not prune: no job may wait for it
    assert main(command) == 0
    summary = json.loads(capsys.readouterr().out)
    ran = [t for t in summary["trials"] if t["state"] != "retried"]
    # The two stopped trials' rates were tried again as new trials, beside the two not tried yet: six jobs in all.
    assert {t["params"]["learning_rate"] for t in ran} == set(RATES) and len(ran) == 4
    assert {r["params"]["learning_rate"] for r in stopped} <= {t["params"]["learning_rate"] for t in ran}
    assert len(list(state.glob("*.json"))) == 6


@pytest.mark.slow
def test_a_trial_that_cannot_fit_the_backends_gpu_is_pruned_before_its_job_starts(slurm, tmp_path, tiny_bert,
                                                                                  cls_csv, capsys):
    """The launcher plans each trial for one GPU of the partition (`--gpu-memory 0.1`: nothing fits): the trial is
    pruned with the planner's sentence and nothing is submitted. (One trial: the planner's search for a plan that
    fits takes seconds each time it finds none.)"""
    path = _config(tmp_path, tiny_bert, cls_csv, trials=1)
    assert main(["sweep", str(path), "--backend", "slurm", "--partition", "gpu", "--gpu-memory", "0.1",
                 "--parallel", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["counts"] == {"pruned": 1} and summary["best"] is None
    for t in summary["trials"]:
        assert t["reason"].startswith("Not sent to Slurm: on partition gpu (1 × H100, 0.09 GiB per GPU) nothing fits")
        assert not trial_folder(Path(summary["sweep_dir"]), t["number"]).exists()
    assert not (Path(slurm["FAKE_SLURM_DIR"]) / "jobs").exists()
