"""The first round's two crash gaps (issue #18, item 9): `overwrite=true` deletes only the files the run's manifest
lists and keeps (and names) what a person put into its folders; a disk that fills at a write ends the run with one
sentence naming the path and the space needed, exit 1, the half-written checkpoint removed and nothing marked done."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from finetune.cli import main
from finetune.config.schema import from_dict
from finetune.run import rundir
from finetune.run.events import read_events
from finetune.train.loop import train

# `finetune train …` whose N-th write of `target` fails as a full disk fails (ENOSPC, or torch's wording).
FULL_DISK = textwrap.dedent("""
    import errno, sys
    from finetune import cli
    from finetune.run import rundir
    import finetune.train.variants as variants

    target, nth = sys.argv[1], int(sys.argv[2])
    calls = []
    if target == "checkpoint":
        write = rundir.write_json

        def full(path, data):
            if path.name == rundir.TRAINER_STATE:
                calls.append(path)
                if len(calls) == nth:
                    raise OSError(errno.ENOSPC, "No space left on device", str(path))
            write(path, data)

        rundir.write_json = full
    elif target == "config":
        write_text = rundir.write_text

        def full(path, text):
            if path.name == "config.yaml":
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            write_text(path, text)

        rundir.write_text = full
    else:
        def full(*args, **kwargs):
            raise RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file "
                               "data/0: file write failed")

        variants.save_model = full
    sys.exit(cli.main(sys.argv[3:]))
""")


def _train_with_full_disk(tmp_path, target: str, nth: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", FULL_DISK, target, str(nth), "train", *args], capture_output=True,
                          text=True, timeout=300)


def test_overwrite_keeps_the_files_a_person_put_into_the_run(tmp_path, tiny_bert, cls_csv, capsys):
    run = tmp_path / "run"
    values = {"model": tiny_bert, "dataset": cls_csv, "output_dir": str(run), "max_steps": 1, "eval_fraction": 0.0}
    train(from_dict(values))
    mine = run / "model" / "NOTES.md"
    mine.write_text("my notes on this model")
    written = sorted(p.name for p in (run / "model").iterdir() if p != mine)
    assert written and all(f"model/{name}" in (run / rundir.MANIFEST).read_text() for name in written)
    capsys.readouterr()
    again = train(from_dict({**values, "overwrite": True}))
    assert again.status == "done" and mine.read_text() == "my notes on this model"
    assert sorted(p.name for p in (run / "model").iterdir() if p != mine) == written
    assert "note: overwrite kept 1 file(s) that finetune did not write: model/NOTES.md" in capsys.readouterr().err


@pytest.mark.slow  # a training child filling the disk (186 s at load 9)
def test_a_full_disk_while_a_checkpoint_is_written_ends_the_run_in_one_sentence(tmp_path, tiny_bert, cls_csv,
                                                                               capsys):
    run = tmp_path / "run"
    args = [f"model={tiny_bert}", f"dataset={cls_csv}", f"output_dir={run}", "max_steps=3", "save_every=1",
            "eval_fraction=0", "-q"]
    proc = _train_with_full_disk(tmp_path, "checkpoint", 2, *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[-1].startswith(f"error: The disk is full: writing {run}/checkpoints/step-0000002.partial/"
                                "trainer_state.json failed with ") and lines[-1].endswith(
        f"GB (about one checkpoint) there, then resume with `finetune train {run}/config.yaml resume=true`.")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-0000001"]  # no half checkpoint left
    assert not rundir.is_finished(run) and read_events(run / "events.jsonl")[-1]["message"] == lines[-1][7:]
    # The resume is an ordinary `finetune train`: in this process, without a second child's start-up.
    assert main(["train", str(run / "config.yaml"), "resume=true", "-q"]) == 0, capsys.readouterr().err
    assert rundir.is_finished(run)


@pytest.mark.slow  # a training child filling the disk (102 s at load 9)
def test_a_full_disk_while_the_model_is_saved_leaves_no_finished_run(tmp_path, tiny_bert, cls_csv):
    run = tmp_path / "run"
    args = [f"model={tiny_bert}", f"dataset={cls_csv}", f"output_dir={run}", "max_steps=1", "eval_fraction=0", "-q"]
    proc = _train_with_full_disk(tmp_path, "model", 1, *args)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: The disk is full: writing {run} failed with ")
    assert not (run / "metrics.json").exists() and not rundir.is_finished(run)


@pytest.mark.slow  # a training child filling the disk (232 s at load 9)
def test_a_full_disk_before_the_run_begins_is_one_sentence_and_leaves_nothing_half_written(tmp_path, tiny_bert,
                                                                                        cls_csv, capsys):
    run = tmp_path / "run"
    args = [f"model={tiny_bert}", f"dataset={cls_csv}", f"output_dir={run}", "max_steps=1", "eval_fraction=0", "-q"]
    proc = _train_with_full_disk(tmp_path, "config", 1, *args)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: The disk is full: writing {run}/config.yaml "
                                                           "failed with ")
    assert proc.stderr.strip().endswith("then start the run again.")
    assert not run.exists()  # the folder it made is taken back: starting again is not refused as an earlier run
    # Started again as an ordinary `finetune train`: in this process, without a second child's start-up.
    assert main(["train", *args]) == 0 and rundir.is_finished(run), capsys.readouterr().err
