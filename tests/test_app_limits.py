"""Issue #7's attacks on a public app, each now refused at once with one sentence: absurd batch and step values, huge
or broken configs, a hub preview that never answers, a long Try-it text, a full disk; and the app's clean-up,
atomic writes, killed children and the model zip. No model is trained here (the children are stand-in scripts)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from app.api import ScriptApi
from app.door import cleanup, limits
from app.downloads import zip_model
from app.local import current
from app.local import training as jobs
from app.local.training import KILLED, JobManager
from app.mapping import FIELD_NAMES, config_to_values, problems_text
from app.tabs import Handlers, handlers
from app.train import preview
from finetune.config.batch import resolve_batch
from finetune.config.schema import Config, ConfigError, from_dict
from finetune.run.rundir import MARKER

ABSURD = {"effective_batch_size": 10**12, "micro_batch_size": 7}


def _values(**changes) -> list:
    """The page's widget values for the default config with `changes` typed into the form."""
    values = config_to_values(Config())
    for name, value in changes.items():
        values[FIELD_NAMES.index(name)] = value
    return values


def _controller(tmp_path: Path, **server_limits) -> Handlers:
    runs = tmp_path / "runs"
    return handlers(runs, JobManager(runs), server_limits=limits.Limits(**server_limits))


# --- limits


def test_absurd_batch_and_steps_are_refused_by_the_schema_at_once():
    started = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        from_dict(ABSURD)
    assert time.perf_counter() - started < 0.5
    assert e.value.problems == ["`effective_batch_size` must be at most 1,048,576, not 1000000000000."]
    for key, value in {"epochs": 1e6, "max_steps": 10**12, "micro_batch_size": 10**6, "grad_accum_steps": 10**7,
                       "eval_every": 10**12, "save_every": 10**12, "logging_every": 10**12}.items():
        with pytest.raises(ConfigError, match=f"`{key}` must be at most"):
            from_dict({key: value})
    # The largest effective batch the schema allows still resolves (or is refused) in well under a second.
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="does not divide"):
        resolve_batch(from_dict({"effective_batch_size": 1_048_576, "micro_batch_size": 7}))
    assert time.perf_counter() - started < 1.0


def test_plan_with_absurd_values_answers_at_once_on_the_page_and_the_api(tmp_path):
    ctl = _controller(tmp_path, max_effective_batch=1024, max_steps=1000, max_epochs=20)
    started = time.perf_counter()
    shown = ctl.plan.plan(*_values(effective_batch_size="1000000000000", micro_batch_size="7"))
    assert shown.error.startswith("⚠️ **Effective batch size** must be at most")
    assert ScriptApi(ctl).plan(ABSURD, None)["error"].startswith("`effective_batch_size` must be at most")
    # Within the schema but above this server's limits: refused before any planner process starts.
    over = ScriptApi(ctl).plan({"effective_batch_size": 4096, "max_steps": 5000}, None)
    assert over == {"error": "`max_steps` = 5,000 is above this server's limit of 1,000 optimizer steps: lower it. "
                             "The effective batch of 4,096 samples is above this server's limit of 1,024: lower "
                             "`effective_batch_size`."}
    assert time.perf_counter() - started < 1.0


def test_server_limits_check_is_pure_and_quiet_within_them():
    space = limits.SPACE
    assert limits.check(Config(), space) == [] and limits.check(Config(epochs=10_000), limits.LOCAL) == []
    assert limits.check(Config(epochs=50), space) == [
        "`epochs` = 50 is above this server's limit of 20: lower it, or set `max_steps`."]
    assert limits.check(Config(epochs=50, max_steps=100), space) == []  # max_steps decides the length
    assert limits.check(Config(micro_batch_size=64, grad_accum_steps=64), space)[0].startswith(
        "The effective batch of 4,096 samples")


def test_limit_flags_fall_back_to_variables_and_space_defaults(monkeypatch):
    from app.door.server import build_parser

    for key in ("SPACE_ID", "FINETUNE_MAX_EPOCHS", "FINETUNE_MAX_RUN_MINUTES", "FINETUNE_KEEP_DAYS"):
        monkeypatch.delenv(key, raising=False)
    assert limits.from_args(build_parser().parse_args([])) == limits.LOCAL
    assert limits.from_args(build_parser().parse_args(["--max-epochs", "5", "--keep-days", "0"])).max_epochs == 5
    monkeypatch.setenv("FINETUNE_MAX_RUN_MINUTES", "30")
    assert limits.from_args(build_parser().parse_args([])).max_run_s == 1800
    monkeypatch.setenv("SPACE_ID", "someone/finetune")
    on_space = limits.from_args(build_parser().parse_args([]))
    assert on_space.max_file_size == "200mb" and on_space.keep_days == 7 and on_space.max_run_minutes == 30
    assert limits.from_args(build_parser().parse_args(["--max-epochs", "0"])).max_epochs is None  # 0: no limit


def test_a_huge_imported_config_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("".join(f"key_{i}: {'x' * 40}\n" for i in range(110_000)))  # about 5 MB
    ctl = _controller(tmp_path)
    started = time.perf_counter()
    shown = ctl.reproduce.import_config(str(big))
    assert time.perf_counter() - started < 0.5
    assert shown.note.startswith("⚠️ The config is 5,") and "a config is at most 64 KB" in shown.note
    assert len(shown.note) < 200
    answer = ScriptApi(ctl).start(big.read_text(), None)  # the same text through the API
    assert not answer["started"] and answer["message"].startswith("The config is 5,")


def test_a_config_with_500_bad_keys_gets_a_short_message(tmp_path):
    bad = {f"option_{i}_{'y' * 300}": i for i in range(500)}
    started = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        from_dict(bad)
    text = problems_text(e.value)
    assert time.perf_counter() - started < 5
    lines = text.splitlines()
    assert lines[0] == "Fix these first:" and len(lines) == 7 and lines[-1] == "- … and 495 more."
    assert all(len(line) <= limits.MAX_PROBLEM_CHARS + 2 for line in lines) and len(text) < 1200


# --- previews


def test_a_hub_preview_that_hangs_times_out_without_blocking_a_local_preview(monkeypatch, cls_csv):
    def never_answers(source, config_name, split):
        time.sleep(10)

    monkeypatch.setattr(preview, "_hub_sample", never_answers)
    monkeypatch.setattr(preview, "HUB_TIMEOUT_S", 3.0)
    preview.inspect(cls_csv, None, "train", "classification", {})  # warm the readers' imports, then forget it
    preview._hub.cache_clear()
    preview._local.cache_clear()
    answers: dict[str, tuple[float, preview.DatasetView]] = {}
    begin = time.perf_counter()

    def look(name: str, source: str) -> None:
        view = preview.inspect(source, None, "train", "classification", {})
        answers[name] = (time.perf_counter() - begin, view)

    hub = threading.Thread(target=look, args=("hub", "someone/slow-dataset"))
    hub.start()
    look("local", cls_csv)
    hub.join()
    local_s, local = answers["local"]
    hub_s, hung = answers["hub"]
    assert local.error == "" and local.rows == 37 and local_s < 3.0  # answered while the hub was still silent
    assert hung.error == ("Dataset 'someone/slow-dataset': the hub did not answer within 3 s; check the id, or try "
                          "again later.")
    assert 3.0 <= hub_s < 4.5
    # Cancelled, not abandoned: no child (or thread) goes on with the hung request.
    assert not [c for c in multiprocessing.active_children() if c.name == "finetune-bounded"]
    assert not [t for t in threading.enumerate() if t.name == "hub-preview"]


def test_a_hub_preview_is_streamed_and_says_it_counted_only_the_first_rows(monkeypatch, tmp_path):
    import datasets

    seen = tmp_path / "streaming"  # the preview runs in a child process: it leaves its word in a file

    def streamed(source, config_name, split, streaming=False):
        seen.write_text(str(streaming))
        texts = [f"sentence number {i}" for i in range(3000)]  # words, not ids: the preview refuses an id column
        return datasets.Dataset.from_dict({"text": texts, "label": [i % 2 for i in
                                                                                            range(3000)]}
                                          ).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", streamed)
    preview._hub.cache_clear()
    view = preview.inspect("someone/big-dataset", None, "train", "classification", {})
    preview._hub.cache_clear()
    assert seen.read_text() == "True" and view.error == "" and view.rows == preview.HUB_SAMPLE_ROWS
    assert preview.labels_markdown(view).startswith("the first 1000 rows (streamed) · 2 labels")


def test_a_local_preview_writes_nothing_into_the_datasets_cache(tmp_path, monkeypatch, cls_csv):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")  # not the test's cache
    frame = pd.read_csv(cls_csv)
    frame.to_json(tmp_path / "data.jsonl", orient="records", lines=True)
    frame.to_parquet(tmp_path / "data.parquet")
    for path in (Path(cls_csv), tmp_path / "data.jsonl", tmp_path / "data.parquet"):
        view = preview.inspect(str(path), None, "train", "classification", {})
        assert view.error == "" and view.rows == 37 and sum(view.labels.values()) == 37, path
    assert not (tmp_path / "datasets-cache").exists()


# --- Try it


def test_try_it_truncates_a_long_text_and_says_so(tmp_path, monkeypatch):
    import finetune.use.predict

    seen = {}

    def fake_predict(target, texts, max_new_tokens=40, prompt=None, **settings):
        seen.update(texts=texts, max_new_tokens=max_new_tokens)
        return [{"label": "pos", "probabilities": {"pos": 0.9, "neg": 0.1}}]

    monkeypatch.setattr(finetune.use.predict, "predict", fake_predict)
    ctl = _controller(tmp_path)
    run = tmp_path / "runs" / "r"
    (run / "model").mkdir(parents=True)
    (run / "events.jsonl").write_text(json.dumps({"event": "done", "time": time.time() + 10}) + "\n")
    ctl.state.jobs.training._job = jobs._Job(run_dir=run, config_path=run / "config.yaml", log_path=run / "launch.log",
                                             command=["python"], pid=-1, proc=None, launched=time.time())
    shown = ctl.tryit.try_it("word " * 10_000, max_new_tokens=10_000)
    assert len(seen["texts"][0]) == limits.MAX_TRY_CHARS and seen["max_new_tokens"] == limits.MAX_NEW_TOKENS
    assert shown.message == "Only the first 2,000 characters of the text were used."
    assert ctl.tryit.try_it("short").message == ""


# --- disk and clean-up


def test_a_run_does_not_start_on_a_nearly_full_disk(tmp_path, monkeypatch, cls_csv):
    monkeypatch.setattr(cleanup, "free_bytes", lambda path: 1.2e9)
    ctl = _controller(tmp_path, min_free_gb=5)
    started = ctl.run.start_run(from_dict({"dataset": cls_csv}))
    assert not started.started and started.message == (
        "Only 1.2 GB free on the disk of the runs folder (runs): at least 5 GB is needed to start a run; delete old "
        "runs, or free space on that disk.")
    assert cleanup.disk_problem(tmp_path, 0, lambda path: 0) is None  # 0: no check


def _aged(path: Path, days: float) -> Path:
    stamp = time.time() - days * 86400
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (stamp, stamp))
    return path


def _run(runs: Path, name: str, days: float, marked: bool = True, dataset: str = "") -> Path:
    run = runs / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "events.jsonl").write_text('{"event": "done"}\n')
    (run / "config.yaml").write_text(f"dataset: {dataset}\n")
    if marked:
        (run / MARKER).write_text("{}")
    (runs / f"{name}.yaml").write_text(f"dataset: {dataset}\n")
    (runs / f"{name}.log").write_text("$ finetune train\n")
    for p in (runs / f"{name}.yaml", runs / f"{name}.log"):
        _aged(p, days)
    return _aged(run, days)


def test_cleanup_deletes_only_old_marked_runs_other_than_the_current_and_unused_uploads(tmp_path):
    runs = tmp_path / "runs"
    (runs / "uploads").mkdir(parents=True)
    used = runs / "uploads" / "used-1234abcd.csv"
    used.write_text("a")
    _aged(used, 30)
    unused_old = runs / "uploads" / "old-1234abcd.csv"
    unused_old.write_text("b")
    _aged(unused_old, 30)
    fresh_upload = runs / "uploads" / "new-1234abcd.csv"
    fresh_upload.write_text("c")
    old = _run(runs, "old", 30, dataset=str(runs / "uploads" / "old-1234abcd.csv"))
    current = _run(runs, "current", 30)
    kept_ref = _run(runs, "recent", 1, dataset=str(used))
    foreign = _run(runs, "notmine", 30, marked=False)

    assert cleanup.tidy(runs, None, keep=current) == []  # locally: runs are kept
    deleted = cleanup.tidy(runs, 7, keep=current)
    assert set(deleted) == {old, runs / "old.yaml", runs / "old.log", unused_old}
    assert current.is_dir() and kept_ref.is_dir() and foreign.is_dir() and used.is_file() and fresh_upload.is_file()


def test_gradios_copies_go_a_day_after_they_were_made_not_a_day_after_their_source_changed(tmp_path):
    """Gradio copies a file it serves with its modification time (`shutil.copy2`), and a hand-out is a hard link:
    a copy of a week-old model zip made a minute ago must last the day, or the Download button's link breaks at the
    next sweep, ten minutes later."""
    import shutil

    gradio, runs = tmp_path / "gradio", tmp_path / "runs"
    source = tmp_path / "week-old-model.zip"
    source.write_text("PK")
    _aged(source, 7)
    copy = gradio / ("a" * 64) / "model.zip"
    copy.parent.mkdir(parents=True)
    shutil.copy2(source, copy)
    linked = gradio / f"{cleanup.DOWNLOADS_PREFIX}x" / ("b" * 16) / "model.zip"
    linked.parent.mkdir(parents=True)
    os.link(source, linked)
    other = gradio / "not-a-hash" / "keep.txt"
    other.parent.mkdir(parents=True)
    other.write_text("z")
    assert copy.stat().st_mtime == source.stat().st_mtime  # as old as its source, by its modification time
    assert cleanup.tidy(runs, None, gradio_dir=gradio) == []
    assert cleanup.tidy(runs, None, gradio_dir=gradio, now=time.time() + 0.9 * cleanup.DAY_S) == []
    later = time.time() + 1.1 * cleanup.DAY_S
    assert cleanup.tidy(runs, None, gradio_dir=gradio, now=later) == sorted([copy, linked])
    assert not copy.parent.exists() and not linked.parent.parent.exists() and other.is_file() and source.is_file()



def test_handed_out_files_go_beside_gradios_cache_and_are_swept_with_it(tmp_path, monkeypatch):
    """A hand-out is a hard link to a run's file: it would keep a deleted run's bytes on the disk for as long as the
    server lives (and, before, in /tmp for good). It goes under GRADIO_TEMP_DIR, where the sweep deletes it once
    a day old, with the folders it leaves empty; the next hand-out makes them again."""
    from app.downloads import Downloads

    gradio = tmp_path / "gradio"
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(gradio))
    log = tmp_path / "runs" / "r1" / "train.log"
    log.parent.mkdir(parents=True)
    log.write_text("step 1")
    downloads = Downloads()
    handed = Path(downloads.handout(log, "r1.log"))
    assert handed.read_text() == "step 1" and handed.name == "r1.log"
    folder = handed.parent.parent
    assert folder.parent == gradio and folder.name.startswith(cleanup.DOWNLOADS_PREFIX)
    assert cleanup.tidy(tmp_path / "runs", None, gradio_dir=gradio) == []  # not yet a day old
    later = time.time() + 2 * cleanup.DAY_S
    assert cleanup.tidy(tmp_path / "runs", None, gradio_dir=gradio, now=later) == [handed]
    assert not folder.exists() and log.read_text() == "step 1"
    again = Path(downloads.handout(log, "r1.log"))
    assert again == handed and again.read_text() == "step 1"


def test_an_app_that_exits_deletes_its_handed_out_files(tmp_path):
    import subprocess

    gradio = tmp_path / "gradio"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.zip").write_bytes(b"PK")
    script = ("import sys; from pathlib import Path; from app.downloads import Downloads; "
              "print(Downloads().handout(Path(sys.argv[1]), 'run-model.zip'))")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run" / "model.zip")], capture_output=True,
                          text=True, env={**os.environ, "GRADIO_TEMP_DIR": str(gradio)}, check=True)
    handed = Path(done.stdout.strip())
    assert handed.is_relative_to(gradio) and handed.name == "run-model.zip"
    assert not handed.exists() and list(gradio.iterdir()) == []
    assert (tmp_path / "run" / "model.zip").read_bytes() == b"PK"


# --- crash-safe runs (stand-in children)

FAKE_CHILD = """#!{python}
import json, os, signal, sys, time
run = os.environ["FAKE_RUN_DIR"]
def stop(signum, frame):
    with open(os.path.join(run, "events.jsonl"), "a") as f:
        f.write(json.dumps({{"event": "stopped", "step": 3, "time": time.time()}}) + "\\n")
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
with open(os.path.join(run, "events.jsonl"), "a") as f:
    f.write(json.dumps({{"event": "start", "total_steps": 10, "step": 0, "time": time.time(), "micro_batch_size": 8,
                        "grad_accum_steps": 1, "num_processes": 1, "effective_batch_size": 8, "precision": "fp32",
                        "device": "cpu"}}) + "\\n")
time.sleep(120)
"""


@pytest.fixture
def fake_python(tmp_path, monkeypatch) -> tuple[str, Path]:
    """A stand-in for `python -m finetune train`: it writes a start event, sleeps, and on SIGINT a stopped event."""
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    script = tmp_path / "fake-python"
    script.write_text(FAKE_CHILD.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("FAKE_RUN_DIR", str(run))
    return str(script), run


def _until(manager: JobManager, check, timeout: float = 20):
    deadline = time.time() + timeout
    while not check(status := manager.status()):
        assert time.time() < deadline, status
        time.sleep(0.05)
    return status


def test_current_json_is_written_atomically(tmp_path, monkeypatch, fake_python):
    python, run = fake_python
    written = []
    monkeypatch.setattr(current, "write_json", lambda path, data: written.append(path) or path.write_text(
        json.dumps(data)))
    manager = JobManager(tmp_path / "runs", python=python)
    manager.start(tmp_path / "r.yaml", run)
    manager.stop()
    _until(manager, lambda s: not s.active)
    assert written and set(written) == {tmp_path / "runs" / "current.json"}


def test_a_child_killed_from_outside_is_failed_and_resumable_before_and_after_a_restart(tmp_path, fake_python):
    python, run = fake_python
    runs = tmp_path / "runs"
    manager = JobManager(runs, python=python)
    manager.start(tmp_path / "r.yaml", run)
    _until(manager, lambda s: s.state == "running")
    (run / "checkpoints" / "step-0000002").mkdir(parents=True)
    (run / "checkpoints" / "step-0000004.partial").mkdir()  # half-written: never resumed from
    os.killpg(manager._job.pid, signal.SIGKILL)  # the out-of-memory killer
    killed = _until(manager, lambda s: not s.active)
    assert (killed.state, killed.message, killed.resumable) == ("failed", KILLED, True)
    assert killed.checkpoint == str(run / "checkpoints" / "step-0000002")
    shown = handlers(runs, manager).follow.poll(None)
    assert "Failed" in shown.status and KILLED in shown.status and shown.resume_button["visible"]

    restarted = JobManager(runs, python=python).status()  # a new app process adopts the same record
    assert (restarted.state, restarted.message, restarted.resumable) == ("failed", KILLED, True)


def test_the_server_time_limit_stops_the_run_with_a_checkpoint(tmp_path, fake_python):
    python, run = fake_python
    manager = JobManager(tmp_path / "runs", python=python, max_run_s=1.5)
    manager.start(tmp_path / "r.yaml", run)
    stopped = _until(manager, lambda s: not s.active)
    assert stopped.state == "stopped" and stopped.returncode == 130
    assert stopped.message.startswith("Stopped: reached the server's time limit of 0.025 min")


def test_two_tabs_asking_for_the_zip_at_once_get_one_valid_zip(tmp_path):
    model = tmp_path / "run" / "model"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(os.urandom(8 << 20))
    (model / "config.json").write_text('{"a": 1}')
    out = tmp_path / "run" / "model.zip"
    barrier, results = threading.Barrier(2), []

    def ask() -> None:
        barrier.wait()
        results.append(zip_model(model, out))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [out, out]
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None and sorted(z.namelist()) == ["run-model/config.json", "run-model/model.safetensors"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["model", "model.zip"]  # no temporary file left
