"""`finetune train --backend hf-jobs` and `finetune jobs …` (finetune.remote) against a local stand-in of the Hub's
Jobs, bucket and upload API (tests/fakehub.py, tests/fakejobs.py) that huggingface_hub's real client talks to. A
stand-in job does not train: it replays a recorded run's events as its logs and its files into the bucket. Nothing
leaves 127.0.0.1: a guard refuses any other connection, here and in the processes the tests start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_train
from fakehub import fake_hub, loopback_only, loopback_site
from fakejobs import JobScript
from huggingface_hub import HfApi
from huggingface_hub import constants as hf_constants

from finetune.config.schema import ConfigError, from_dict, read_yaml
from finetune.errors import EXIT_STOPPED
from finetune.remote import flavors, hfjobs
from finetune.remote.follow import follow
from finetune.remote.jobfile import JobHandle, read_handle, write_handle
from finetune.remote.mirror import Mirror, from_record
from finetune.remote.preflight import plan_for, preflight
from finetune.remote.timelimit import TimeLimit, parse_duration
from finetune.run.events import LOG_PREFIX, read_events

TOKEN = "hf_write"
IMAGE = "hf.co/spaces/alice/finetune"


@pytest.fixture
def hub(monkeypatch):
    """The stand-in Hub; this process may reach nothing but it, and huggingface_hub is online (for it)."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    with loopback_only(), fake_hub() as hub:
        yield hub


def _env(hub, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN", "SPACE_ID")}
    env.update(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_TOKEN_PATH=str(tmp_path / "no-stored-token"),
               PYTHONPATH=os.pathsep.join([loopback_site(tmp_path / "guard"), str(ROOT)]))
    return env


def _finetune(*args: str, env: dict[str, str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "finetune", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _run(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = _finetune(*args, env=env)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _records(out: str, records: list[dict]) -> list[dict]:
    """A recorded run's records as a job on a GPU whose run folder is `out` prints them."""
    def move(key, value):
        if key == "device":
            return "cuda:0"
        return value.replace(RECORDED_DIR[0], out) if isinstance(value, str) else value

    return [{k: move(k, v) for k, v in r.items()} for r in records]


RECORDED_DIR: list[str] = []


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_bert, cls_csv) -> Path:
    """A real run of the tiny BERT: 3 steps, a checkpoint at step 2, an evaluation, a model."""
    out = tmp_path_factory.mktemp("recorded") / "run"
    run_train(out, model=tiny_bert, dataset=cls_csv, max_steps=3, save_every=2, eval_fraction=0.2,
              effective_batch_size=8)
    RECORDED_DIR[:] = [str(out)]
    return out


def replay(run: Path, *, stage: str = "COMPLETED", hold_after: int | None = None, delay: float = 0.01):
    """A job that prints `run`'s records (with a note and a warning among them) and leaves `run`'s files in its
    bucket folder, its config naming what the job's own config named."""
    def script(job, config: dict) -> JobScript:
        out = config["output_dir"]
        lines = [LOG_PREFIX + json.dumps(r) for r in _records(out, read_events(run / "events.jsonl"))]
        lines[1:1] = ["note: training data: 30 samples", "warning: a line that is not an event"]
        files = {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}
        saved = read_yaml(run / "config.yaml")
        saved.update({k: config[k] for k in ("model", "dataset", "output_dir")})
        files["config.yaml"] = yaml.safe_dump(saved).encode()
        files["events.jsonl"] = "".join(json.dumps(r) + "\n" for r in
                                        _records(out, read_events(run / "events.jsonl"))).encode()
        return JobScript(lines=lines, stage=stage, files=files, delay=delay, hold_after=hold_after)

    return script


def _wait_for(predicate, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not predicate():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.05)


def _config_file(tmp_path: Path, tiny_bert: str, cls_csv: str) -> Path:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"model": tiny_bert, "dataset": cls_csv, "output_dir": str(tmp_path / "run"),
                                   "max_steps": 3, "save_every": 2, "eval_fraction": 0.2,
                                   "effective_batch_size": 8}))
    return cfg


def _no_token_in(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            assert TOKEN.encode() not in p.read_bytes(), p


@pytest.mark.floors
@pytest.mark.slow
def test_a_run_trains_as_a_job_and_its_folder_mirrors_it_here(tmp_path, hub, recorded, tiny_bert, cls_csv):
    hub.jobs.script = replay(recorded)
    code, out, err = _run("train", str(_config_file(tmp_path, tiny_bert, cls_csv)), "-q", "--backend", "hf-jobs",
                          "--flavor", "t4-small", "--image", IMAGE, env=_env(hub, tmp_path))
    assert code == 0, err
    run = tmp_path / "run"
    handle = read_handle(run)
    job = hub.jobs.only()
    # The job as it was sent: the Space's image, the flavor, the command, the limit, the token as a secret only.
    spec = job.spec
    assert (spec["spaceId"], spec["flavor"], spec["timeoutSeconds"]) == ("alice/finetune", "t4-small", 1800)
    assert spec["command"] == ["timeout", "--signal=TERM", "--preserve-status", "1500s", "python", "-m", "finetune",
                               "train", "/inputs/config.yaml", "-q", "--log-events", "--doctor"]
    assert spec["secrets"] == {"HF_TOKEN": TOKEN}
    assert TOKEN not in json.dumps({k: v for k, v in spec.items() if k != "secrets"})
    assert spec["volumes"] == [
        {"type": "bucket", "source": "alice/finetune-runs", "mountPath": "/runs"},
        {"type": "dataset", "source": "alice/finetune-inputs", "mountPath": "/inputs", "path": handle.inputs_path,
         "revision": handle.inputs_revision}]
    # What was uploaded: the config the job runs (the copies' paths, the flavor's budget) and the local files.
    inputs = hub.repos["alice/finetune-inputs"]
    assert inputs["visibility"] == "private" and hub.jobs.buckets["alice/finetune-runs"]["private"]
    files = {k[len(handle.inputs_path) + 1:]: v for k, v in inputs["files"].items()}
    job_config = yaml.safe_load(files["config.yaml"])
    assert (job_config["dataset"], job_config["model"]) == ("/inputs/dataset/cls.csv", "/inputs/model")
    assert job_config["output_dir"] == f"/runs/{handle.remote_dir}" and job_config["memory_budget_gb"] == 14.9
    assert files["dataset/cls.csv"] == Path(cls_csv).read_bytes()
    assert files["model/model.safetensors"] == (Path(tiny_bert) / "model.safetensors").read_bytes()
    assert TOKEN.encode() not in b"".join(files.values())
    # The job's events, mirrored from its logs once each, in the local run folder's paths.
    assert read_events(run / "events.jsonl") == _records(str(run), read_events(recorded / "events.jsonl"))
    assert "warning: a line that is not an event" in err and f"{hub.url}/jobs/alice/{job.id}" in err
    # The model fetched (the checkpoints left in the bucket), the config local again: eval works as on a local run.
    assert (run / "model" / "model.safetensors").read_bytes() == (recorded / "model" / "model.safetensors").read_bytes()
    assert not (run / "checkpoints").exists()
    local = read_yaml(run / "config.yaml")
    assert (local["dataset"], local["model"], local["output_dir"]) == (cls_csv, tiny_bert, str(run))
    metrics = json.loads((recorded / "metrics.json").read_text())
    assert json.loads(out) == {"run_dir": str(run), **next(r for r in read_events(recorded / "events.jsonl")
                                                          if r["event"] == "done")["metrics"]}
    from finetune.use.evaluate import evaluate_target

    assert evaluate_target(str(run), [])["accuracy"] == pytest.approx(metrics["accuracy"])
    recorded_job = json.loads((run / "job.json").read_text())
    assert (recorded_job["job_id"], recorded_job["url"], recorded_job["flavor"], recorded_job["image"]) == \
        (job.id, f"{hub.url}/jobs/alice/{job.id}", "t4-small", IMAGE)
    assert recorded_job["outcome"]["status"] == "done" and "model/model.safetensors" in recorded_job["fetched"]
    _no_token_in(run)
    assert TOKEN not in out + err


@pytest.mark.slow
def test_ctrl_c_cancels_the_job_and_exits_as_stopped(tmp_path, hub, recorded, tiny_bert, cls_csv):
    hub.jobs.script = replay(recorded, hold_after=4)
    proc = _finetune("train", str(_config_file(tmp_path, tiny_bert, cls_csv)), "-q", "--backend", "hf-jobs",
                     "--flavor", "t4-small", "--image", IMAGE, env=_env(hub, tmp_path))
    run = tmp_path / "run"
    _wait_for(lambda: len(read_events(run / "events.jsonl")) >= 2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err
    job = hub.jobs.only()
    assert ("POST", f"/api/jobs/alice/{job.id}/cancel", TOKEN) in hub.requests and job.stage == "CANCELED"
    assert "Cancelling the job" in err and "The job was cancelled" in err
    assert json.loads((run / "job.json").read_text())["outcome"]["status"] == "stopped"
    assert not (run / "model").exists()


@pytest.mark.slow
def test_a_job_is_followed_again_after_its_launcher_died(tmp_path, hub, recorded, tiny_bert, cls_csv):
    hub.jobs.script = replay(recorded, hold_after=4)
    env = _env(hub, tmp_path)
    launcher = _finetune("train", str(_config_file(tmp_path, tiny_bert, cls_csv)), "-q", "--backend", "hf-jobs",
                         "--flavor", "t4-small", "--image", IMAGE, env=env)
    run = tmp_path / "run"
    _wait_for(lambda: len(read_events(run / "events.jsonl")) >= 2)
    launcher.kill()  # no Ctrl-C, no cancel: the job goes on without it
    launcher.communicate(timeout=60)
    job = hub.jobs.only()
    assert job.stage == "RUNNING" and not any(path.endswith("/cancel") for _, path, _ in hub.requests)
    follower = _finetune("jobs", "follow", str(run), "-q", env=env)
    _wait_for(lambda: sum(1 for _, path, _ in hub.requests if path.endswith("/logs")) == 2)
    job.script.release.set()  # the follower is streaming: let the job go on
    out, err = follower.communicate(timeout=120)
    assert follower.returncode == 0, err
    assert read_events(run / "events.jsonl") == _records(str(run), read_events(recorded / "events.jsonl"))
    assert (run / "model" / "model.safetensors").is_file() and json.loads(out)["run_dir"] == str(run)



# --- in this process: the CLI's `main` against the stand-in (huggingface_hub's endpoint and token pointed at it)


@pytest.fixture
def cli(hub, monkeypatch, tmp_path):
    """`finetune.cli.main` talking to the stand-in."""
    from finetune.cli import main

    monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    monkeypatch.delenv("SPACE_ID", raising=False)
    return main


def _posts(hub) -> list[str]:
    return [path for method, path, _ in hub.requests if method == "POST"]


def test_the_flavors_come_from_the_hub_with_the_gpus_the_pricing_page_lists(hub):
    table = flavors.live_table(HfApi(endpoint=hub.url), TOKEN)
    assert table.source.startswith("Hub's hardware list")
    t4, two, unknown = table.get("t4-small"), table.get("a10g-largex2"), table.get("z100-huge")
    assert (t4.gpus, t4.gpu_memory_gb, t4.budget_gib, t4.usd_per_hour) == (1, 16, 14.9, 0.42)  # the Hub's price
    assert (two.gpus, two.gpu_memory_gb, two.budget_gib) == (2, 48, 22.35)  # one GPU's share is the budget
    assert (unknown.gpus, unknown.gpu_model, unknown.gpu_memory_gb) == (1, "Z100", 200)  # known to the API only
    assert table.names() == ["t4-small", "a10g-largex2", "z100-huge"]  # with a GPU
    assert "t4-small" in table.render() and "$0.42/h" in table.render()
    # The RAM column: what activation offload's copies are checked against.
    header, *rows = flavors.BUILT_IN.render().splitlines()
    assert header.split() == ["flavor", "GPUs", "GPU", "memory", "plan", "budget", "RAM", "price"]
    assert any(r.startswith("a10g-large ") and " 46 GB " in r for r in rows)
    assert flavors.BUILT_IN.get("h200").budget_gib == 131.32  # 141 GB of 10⁹ bytes, below the 139.8 GiB it reports


def test_an_unknown_flavor_is_one_sentence_that_lists_the_known_ones(cli, hub, tmp_path, tiny_bert, cls_csv,
                                                                     capsys):
    code = cli(["train", f"model={tiny_bert}", f"dataset={cls_csv}", f"output_dir={tmp_path / 'run'}",
                "--backend", "hf-jobs", "--flavor", "z9", "--image", IMAGE])
    err = capsys.readouterr().err
    assert code == 2 and err == ("error: Unknown flavor 'z9': choose one of t4-small, a10g-largex2, z100-huge "
                                 "(`finetune jobs flavors` shows their GPUs and prices).\n")
    assert _posts(hub) == [] and not (tmp_path / "run").exists()
    code = cli(["train", f"dataset={cls_csv}", "--backend", "hf-jobs", "--flavor", "cpu-basic", "--image", IMAGE])
    assert code == 2 and "has no GPU" in capsys.readouterr().err


def test_a_flavor_too_small_is_refused_before_any_request(cli, hub, tmp_path, activation_heavy_bert, capsys):
    code = cli(["train", f"model={activation_heavy_bert}", "dataset=hub/some-dataset", "max_length=512",
                "effective_batch_size=4096", "micro_batch_size=4096", "lora=false", "gradient_checkpointing=false",
                "optimizer=sgd", f"output_dir={tmp_path / 'run'}", "--backend", "hf-jobs", "--flavor", "t4-small",
                "--image", IMAGE])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: Not sent to Hugging Face Jobs: on t4-small (1 × T4, 14.9 GiB per "
                                        "GPU) nothing fits memory_budget_gb=14.9: ")
    assert err.count("\n") == 1 and "a budget of at least" in err
    assert hub.requests == [] and not (tmp_path / "run").exists()


def test_refusals_before_anything_is_sent(cli, hub, tmp_path, tiny_bert, cls_csv, capsys, monkeypatch):
    base = ["train", f"model={tiny_bert}", f"dataset={cls_csv}", f"output_dir={tmp_path / 'run'}"]
    assert cli([*base, "--backend", "hf-jobs", "--flavor", "t4-small"]) == 2
    assert "give --image hf.co/spaces/USER/SPACE" in capsys.readouterr().err
    assert cli([*base, "--flavor", "t4-small"]) == 2  # a Jobs option without the backend
    assert "--flavor is an option of --backend hf-jobs" in capsys.readouterr().err
    assert cli([*base, "--backend", "hf-jobs", "--flavor", "t4-small", "--image", IMAGE, "--timeout", "soon"]) == 2
    assert "--timeout 'soon' is not a duration" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a run")
    assert cli([*base[:-1], f"output_dir={tmp_path / 'mine'}", "--backend", "hf-jobs", "--flavor", "t4-small",
                "--image", IMAGE]) == 2  # a folder with files finetune did not write
    assert "already holds files that finetune did not write" in capsys.readouterr().err
    monkeypatch.delenv("HF_TOKEN")
    assert cli([*base, "max_steps=1", "--backend", "hf-jobs", "--flavor", "t4-small", "--image", IMAGE]) == 2
    assert "needs a token" in capsys.readouterr().err
    assert _posts(hub) == [] and not (tmp_path / "run").exists()
    assert hfjobs.resolve_image(None, "alice/finetune") == IMAGE  # inside a Space: its own image


def _start(hub, tmp_path: Path, lines: list[str], *, stage: str = "COMPLETED", flavor: str = "t4-small",
           hold_after: int | None = None, running_s: int | None = None, message: str | None = None) -> JobHandle:
    """A job started straight through huggingface_hub (no plan, no upload), recorded in `tmp_path / 'run'`."""
    remote, folder = "run-1", "run-1/t"
    hub.repos["alice/finetune-inputs"] = {"visibility": "private", "commits": [], "files": {
        f"{folder}/config.yaml": yaml.safe_dump({"output_dir": f"/runs/{remote}"}).encode()}}
    hub.jobs.buckets["alice/finetune-runs"] = {"private": True, "files": {}}
    hub.jobs.script = lambda job, config: JobScript(lines=lines, stage=stage, hold_after=hold_after,
                                                    running_s=running_s, message=message)
    limit, gpus = TimeLimit(1800, "test"), flavors.BUILT_IN.get(flavor).gpus
    command = hfjobs.job_command(limit, gpus)
    spec = hfjobs.job_spec(image=IMAGE, flavor=flavor, command=command, limit=limit, token=TOKEN,
                           bucket="alice/finetune-runs", remote_dir=remote, inputs_repo="alice/finetune-inputs",
                           inputs_path=folder, inputs_revision=None)
    info = HfApi(endpoint=hub.url).run_job(**spec, namespace="alice", token=TOKEN)
    run = tmp_path / "run"
    run.mkdir()
    handle = JobHandle(run_dir=run, job_id=info.id, namespace="alice", url=info.url, endpoint=hub.url,
                       flavor=flavor, gpus=gpus, image=IMAGE, command=tuple(command), timeout_s=limit.seconds,
                       stop_after_s=limit.stop_after_s, bucket="alice/finetune-runs", remote_dir=remote,
                       inputs_repo="alice/finetune-inputs", inputs_path=folder, inputs_revision=None)
    write_handle(handle)
    return handle


def _line(event: str, **values) -> str:
    return LOG_PREFIX + json.dumps({"event": event, "time": 1.0, **values})


START = _line("start", total_steps=4, steps_per_epoch=4, num_train_samples=32, num_eval_samples=0,
              micro_batch_size=8, grad_accum_steps=1, num_processes=1, effective_batch_size=8, precision="bf16",
              device="cuda:0", run_dir="/runs/run-1")
STEP = [_line("step", step=i, epoch=i / 4, loss=1.0 / i, grad_norm=1.0, lr=1e-4, samples=8 * i, tokens=80 * i,
              skipped=0, samples_per_s=50.0) for i in (1, 2, 3)]
CHECKPOINT = _line("checkpoint", step=2, checkpoint="/runs/run-1/checkpoints/step-0000002")
RESUME = "finetune train {run}/config.yaml resume=true --backend hf-jobs --flavor t4-small"

END_STATES = {
    # case: (lines, stage, running_s, exit code, the sentence printed)
    "completed": ([START, *STEP, _line("done", step=3, metrics={"accuracy": 1.0}, model_dir="/runs/run-1/model")],
                  "COMPLETED", None, 0, None),
    "failed, with the run's own error": ([START, STEP[0], _line("error", message="The disk is full: free 2 GB.",
                                                                 exit_code=1)], "ERROR", None, 1,
                                         "error: The disk is full: free 2 GB.\n"),
    "failed before any event": (["error: Dataset file '/inputs/dataset/x.csv' could not be read as .csv (bad)."],
                                "ERROR", None, 1, "error: The job ended with ERROR: Dataset file "
                                "'/inputs/dataset/x.csv' could not be read as .csv (bad)..\n"),
    "stopped before its time limit": ([START, STEP[0], CHECKPOINT, _line("stopped", step=2,
                                       checkpoint="/runs/run-1/checkpoints/step-0000002")], "ERROR", 1500,
                                      EXIT_STOPPED, "The job reached its time limit of 30m and was stopped; "
                                      "continue from its checkpoint (step 2) with `" + RESUME + "` (give a longer "
                                      "--timeout).\n"),
    "ran into its time limit": ([START, STEP[0], CHECKPOINT, STEP[1]], "ERROR", 1800, EXIT_STOPPED,
                                "The job reached its time limit of 30m and was stopped; continue from its "
                                "checkpoint (step 2) with `" + RESUME + "` (give a longer --timeout).\n"),
    "trained without a GPU": ([START.replace("cuda:0", "cpu"), *STEP], "COMPLETED", None, 2,
                              "error: The job trained on cpu, not on the t4-small GPU: the image " + IMAGE +
                              " has torch without CUDA, so the job was cancelled; build the Space with the "
                              "variable TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 (docs/jobs.md).\n"),
}


@pytest.mark.parametrize("case", END_STATES)
def test_each_end_of_a_job_is_the_exit_code_of_a_local_run(cli, hub, tmp_path, capsys, case):
    lines, stage, running_s, code, sentence = END_STATES[case]
    handle = _start(hub, tmp_path, lines, stage=stage, running_s=running_s,
                    hold_after=1 if case == "trained without a GPU" else None)
    assert cli(["jobs", "follow", str(handle.run_dir), "-q", "--no-fetch"]) == code
    out, err = capsys.readouterr()
    outcome = json.loads((handle.run_dir / "job.json").read_text())["outcome"]
    assert outcome["exit_code"] == code
    if sentence:
        assert err.endswith(sentence.replace("{run}", str(handle.run_dir)))
    else:
        assert json.loads(out) == {"run_dir": str(handle.run_dir), "accuracy": 1.0} and outcome["status"] == "done"
    if case == "trained without a GPU":
        assert f"/api/jobs/alice/{handle.job_id}/cancel" in _posts(hub)
    records = read_events(handle.run_dir / "events.jsonl")
    assert len(records) == sum(line.startswith(LOG_PREFIX) for line in lines[:len(records) or None])
    assert all(not str(v).startswith("/runs/") for r in records for v in r.values())  # local paths


def test_a_job_ended_in_error_says_why_on_a_line_of_its_own_under_the_bar(cli, hub, tmp_path, capsys):
    # Killed by the platform mid-run: no final event closes the bar, so its last frame was left open and the
    # sentence was printed after it, on the same line (issue #42, row 13).
    handle = _start(hub, tmp_path, [START, STEP[0], "loading shard 2", STEP[1]], stage="ERROR",
                    message="Job exceeded its memory limit")
    assert cli(["jobs", "follow", str(handle.run_dir), "--no-fetch"]) == 1
    lines = capsys.readouterr().err.split("\n")  # a bar's frames are joined by carriage returns, lines by \n
    assert "2/4" in lines[-3]  # the bar's last frame, ended
    assert lines[-2] == "error: The job ended with ERROR: Job exceeded its memory limit."
    # The job's log line above the bar (its line cleared first), not after a frame.
    assert "loading shard 2" in [line.split("\r")[-1] for line in lines]


def test_a_job_cancelled_elsewhere_is_a_stopped_run(cli, hub, tmp_path, capsys):
    handle = _start(hub, tmp_path, [START, STEP[0], CHECKPOINT, STEP[1]], hold_after=3)

    def cancel_once_followed():
        _wait_for(lambda: len(read_events(handle.run_dir / "events.jsonl")) == 3)
        HfApi(endpoint=hub.url).cancel_job(job_id=handle.job_id, namespace="alice", token=TOKEN)

    import threading

    threading.Thread(target=cancel_once_followed, daemon=True).start()
    assert cli(["jobs", "follow", str(handle.run_dir), "-q"]) == EXIT_STOPPED
    assert capsys.readouterr().err.endswith("The job was cancelled; continue from its checkpoint (step 2) with "
                                            f"`{RESUME.format(run=handle.run_dir)}`.\n")


def test_ctrl_c_while_following_cancels_the_job(cli, hub, tmp_path, capsys):
    handle = _start(hub, tmp_path, [START, STEP[0], STEP[1]], hold_after=2)

    def interrupt_once_followed():
        _wait_for(lambda: len(read_events(handle.run_dir / "events.jsonl")) == 2)
        signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C, to the main thread (the terminal's goes to the process)

    import threading

    main = threading.main_thread().ident
    threading.Thread(target=interrupt_once_followed, daemon=True).start()
    assert cli(["jobs", "follow", str(handle.run_dir), "-q"]) == EXIT_STOPPED
    err = capsys.readouterr().err
    assert "Cancelling the job" in err and err.endswith("The job was cancelled; start it again.\n".replace(
        "start it again", "it had not written a checkpoint yet, so start it again"))
    assert _posts(hub) == ["/api/jobs/alice", f"/api/jobs/alice/{handle.job_id}/cancel"]  # started, cancelled
    assert hub.jobs.only().stage == "CANCELED"
    assert len(read_events(handle.run_dir / "events.jsonl")) == 2  # the replayed stream wrote nothing twice


def test_status_cancel_and_fetch_commands(cli, hub, tmp_path, capsys):
    handle = _start(hub, tmp_path, [START, STEP[0]], hold_after=1)
    _wait_for(lambda: hub.jobs.only().stage == "RUNNING")
    assert cli(["jobs", "status", str(handle.run_dir)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["stage"], status["flavor"], status["url"]) == ("RUNNING", "t4-small", handle.url)
    assert cli(["jobs", "cancel", str(handle.run_dir)]) == 0
    _wait_for(lambda: hub.jobs.only().stage == "CANCELED")
    assert cli(["jobs", "fetch", str(handle.run_dir)]) == 3  # nothing trained: no model in the bucket
    assert "holds no model" in capsys.readouterr().err
    assert cli(["jobs", "status", str(tmp_path)]) == 2  # not a run of a job
    assert "has no job.json" in capsys.readouterr().err


def test_a_stopped_job_resumes_on_a_new_job_in_the_same_bucket_folder(hub, tmp_path, tiny_bert, cls_csv):
    api = HfApi(endpoint=hub.url)
    c = from_dict({"model": tiny_bert, "dataset": cls_csv, "output_dir": str(tmp_path / "run"), "max_steps": 4})
    hub.jobs.script = lambda job, config: JobScript(lines=[START.replace("/runs/run-1", config["output_dir"]),
                                                           STEP[0], CHECKPOINT.replace("/runs/run-1",
                                                                                       config["output_dir"])],
                                                    stage="ERROR", running_s=1800)
    options = hfjobs.JobOptions(flavor="t4-small", image=IMAGE, timeout_s=parse_duration("30m"))
    first = hfjobs.launch(c, options, token=TOKEN, api=api)
    assert follow(first, token=TOKEN).status == "stopped"
    local = read_yaml(first.run_dir / "config.yaml")
    assert (local["dataset"], local["model"], local["memory_budget_gb"]) == (cls_csv, tiny_bert, 14.9)
    hub.jobs.script = lambda job, config: JobScript(lines=[_line("step", step=2, epoch=0.5, loss=0.5, grad_norm=1.0,
                                                                 lr=1e-4, samples=16, tokens=160, skipped=0,
                                                                 samples_per_s=5.0),
                                                           _line("done", step=4, metrics={"accuracy": 1.0},
                                                                 model_dir=config["output_dir"] + "/model")])
    with pytest.raises(ConfigError, match="resume it on the same GPUs"):
        hfjobs.launch(from_dict({**local, "resume": True}), hfjobs.JobOptions(flavor="l4x1", image=IMAGE),
                      token=TOKEN, api=api)
    second = hfjobs.launch(from_dict({**local, "resume": True}), hfjobs.JobOptions(image=IMAGE,
                                                                                  timeout_s=3600),
                           token=TOKEN, api=api)
    assert (second.remote_dir, second.flavor, second.events_before) == (first.remote_dir, "t4-small", 3)
    resumed = yaml.safe_load(hub.repos["alice/finetune-inputs"]["files"][f"{second.inputs_path}/config.yaml"])
    assert resumed["resume"] is True and resumed["output_dir"] == f"/runs/{first.remote_dir}"
    assert resumed["dataset"] == "/inputs/dataset/cls.csv"  # the same path in the job as the first time
    assert follow(second, token=TOKEN).status == "done"
    assert [r["event"] for r in read_events(second.run_dir / "events.jsonl")] == ["start", "step", "checkpoint",
                                                                                   "step", "done"]
    recorded_job = json.loads((second.run_dir / "job.json").read_text())
    assert recorded_job["job_id"] == second.job_id and recorded_job["previous"][0]["job_id"] == first.job_id
    assert recorded_job["previous"][0]["outcome"]["status"] == "stopped"


def test_a_flavor_with_several_gpus_runs_accelerate_launch_with_one_process_each(tiny_bert, cls_csv):
    c = from_dict({"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 32, "max_steps": 10})
    pre = preflight(c, flavors.BUILT_IN.get("a10g-largex2"), timeout_s=3600)
    assert (pre.plan.batch.num_processes, pre.plan.distributed, pre.config.memory_budget_gb) == (2, "ddp", 22.35)
    assert hfjobs.job_command(pre.limit, 2)[4:17] == [
        "accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
        "no", "--dynamo_backend", "no", "-m", "finetune"]
    with pytest.raises(ConfigError, match="effective_batch_size"):  # 3 does not split over 2 GPUs
        plan_for(c.replace(effective_batch_size=3, memory_budget_gb=22.35), flavors.BUILT_IN.get("a10g-largex2"))


def test_the_time_limit_is_arithmetic_you_can_check(tiny_bert, cls_csv):
    from types import SimpleNamespace

    from finetune.remote.timelimit import estimate

    plan = SimpleNamespace(batch=SimpleNamespace(effective_batch_size=32), worst_case_tokens=512,
                           gradient_checkpointing=False)
    c = from_dict({"model": tiny_bert, "dataset": cls_csv, "max_steps": 1000})
    limit = estimate(c, plan, gpus=1, gpu_model="T4", rows=None, params=7_000_000_000)
    # 6 · 7e9 parameters · 1000 steps · 32 samples · 512 tokens / (65 TFLOPS · 20 %) = 52,932 s; + 600 s; × 2.
    assert limit.seconds == 107_400 and limit.grace_s == 1800 and limit.stop_after_s == 105_600
    assert limit.reason.startswith("estimated: 1,000 steps × 32 samples × 512 tokens × 6·7,000M parameters")
    small = estimate(c.replace(max_steps=None, epochs=2.0), plan, gpus=1, gpu_model="T4", rows=40, params=1_000_000)
    assert small.seconds == 1800 and small.grace_s == 300  # the floor: 30 minutes
    with pytest.raises(ConfigError, match="give --timeout"):  # a Hub dataset whose card does not count its rows
        estimate(c.replace(max_steps=None, dataset="someone/data"), plan, gpus=1, gpu_model="T4", rows=None,
                 params=1)
    assert [parse_duration(t) for t in ("90m", "2h", "1h30m", "3600")] == [5400, 7200, 5400, 3600]
    with pytest.raises(ConfigError, match="under 5 minutes"):
        parse_duration("2m")


def test_records_read_back_from_log_lines_are_the_typed_events(recorded):
    records = read_events(recorded / "events.jsonl")
    assert {r["event"] for r in records} >= {"start", "step", "checkpoint", "eval", "done"}
    for record in records:
        event = from_record(record)
        assert event is not None and event.event == record["event"]
        if record["event"] == "start":
            assert event.batch.effective_batch_size == 8 and event.total_steps == 3
    mirror = Mirror(recorded.parent / "mirror", RECORDED_DIR[0])
    lines = [LOG_PREFIX + json.dumps(r) for r in records]
    assert [mirror.feed(line) is not None for line in ["a plain line", *lines]] == [False] + [True] * len(lines)
    mirror.restart()  # the stream opened again: replayed from the start, nothing written twice
    assert [mirror.feed(line) for line in lines] == [None] * len(lines)
    again = Mirror(recorded.parent / "mirror", RECORDED_DIR[0])  # a new process re-attaching
    assert [again.feed(line) for line in lines] == [None] * len(lines)
    assert read_events(recorded.parent / "mirror" / "events.jsonl") == [
        {k: v.replace(RECORDED_DIR[0], str(recorded.parent / "mirror")) if isinstance(v, str) else v
         for k, v in r.items()} for r in records]


def test_a_start_that_fails_leaves_nothing_behind(hub, tmp_path, tiny_bert, cls_csv, monkeypatch):
    api = HfApi(endpoint=hub.url)
    c = from_dict({"model": tiny_bert, "dataset": cls_csv, "output_dir": str(tmp_path / "run"), "max_steps": 2})
    options = hfjobs.JobOptions(flavor="t4-small", image=IMAGE)
    hub.jobs.refuse_runs = 402
    with pytest.raises(hfjobs.JobRefused, match="no credits for Jobs"):
        hfjobs.launch(c, options, token=TOKEN, api=api)
    assert not (tmp_path / "run").exists() and hub.jobs.jobs == {}
    # Interrupted (Ctrl-C) after the Hub made the job, before its answer was read: the job is cancelled.
    hub.jobs.refuse_runs = None
    hub.jobs.script = lambda job, config: JobScript(lines=[START], hold_after=0)
    real = HfApi.run_job

    def interrupted(self, **kwargs):
        real(self, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(HfApi, "run_job", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hfjobs.launch(c, options, token=TOKEN, api=api)
    _wait_for(lambda: hub.jobs.only().stage == "CANCELED")
    assert not (tmp_path / "run").exists()


def test_the_guard_refuses_any_host_but_this_one(hub, tmp_path):
    import socket

    with pytest.raises(OSError, match="loopback only"):
        socket.create_connection(("192.0.2.1", 443), timeout=1)  # TEST-NET-1: never routed
    proc = subprocess.run([sys.executable, "-c", "import socket; socket.create_connection(('192.0.2.1', 443), 1)"],
                          env=_env(hub, tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "loopback only" in proc.stderr
    assert HfApi(endpoint=hub.url).whoami(token=TOKEN)["name"] == "alice"  # the stand-in is reachable
