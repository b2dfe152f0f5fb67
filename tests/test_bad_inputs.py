"""Bad input gets one clear sentence, exit code 2, no traceback, and nothing of the user's is overwritten."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.cli import main


def _run(capsys, *argv) -> tuple[int, str]:
    code = main(["train", *argv, "-q"])
    return code, capsys.readouterr().err


@pytest.fixture
def base(tmp_path, tiny_bert, cls_csv) -> list[str]:
    return [f"model={tiny_bert}", f"dataset={cls_csv}", f"output_dir={tmp_path / 'run'}", "eval_fraction=0",
            "epochs=1", "effective_batch_size=16"]


@pytest.mark.parametrize("args, expected", [
    (["learning_rte=0.1"], "Did you mean `learning_rate`?"),
    (["epochs=-1", "optimizer=lion"], "2 problems in the config"),
    (["effective_batch_size=32", "micro_batch_size=5"], "use one of 1, 2, 4, 8, 16, 32"),
    (["micro_batch_size=4", "grad_accum_steps=3"], "not effective_batch_size=16"),
    (["text_column=review"], "Text column 'review' is not in the data; its columns are: sentence, label"),
    (["dataset=/nope/data.csv"], "does not exist"),
    (["model=/nope/model"], "has no config.json"),
    (["precision=fp16"], "fp16 needs a CUDA GPU"),
    (["task=causal_lm", "label_column=label"], "for task=classification"),
    (["shuffle=maybe"], "`shuffle` must be true or false"),
])
def test_bad_values_exit_2_with_one_clear_message(capsys, base, args, expected):
    code, err = _run(capsys, *base, *args)
    assert code == 2
    assert expected in err
    assert err.startswith("error: ") and "Traceback" not in err


def test_several_problems_are_reported_at_once(capsys, base):
    code, err = _run(capsys, *base, "epochs=-1", "optimizer=lion", "warmup_ratio=2")
    assert code == 2
    assert "3 problems" in err and "epochs" in err and "optimizer" in err and "warmup_ratio" in err


def test_bad_files(capsys, tmp_path, base):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    err = _run(capsys, *base, f"dataset={broken}")[1]
    assert err.count("could not be read as .parquet") == 1 and "Traceback" not in err
    odd = tmp_path / "data.xlsx"
    odd.write_text("x")
    assert "unknown type" in _run(capsys, *base, f"dataset={odd}")[1]
    one_class = tmp_path / "one.csv"
    one_class.write_text("text,label\na,x\nb,x\n")
    assert "only one class" in _run(capsys, *base, f"dataset={one_class}")[1]
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\na,1\n,0\n")
    assert "empty value(s) (first at row 2)" in _run(capsys, *base, f"dataset={empty}")[1]
    bad_yaml = tmp_path / "c.yaml"
    bad_yaml.write_text("epochs: [1\n")
    assert main(["train", str(bad_yaml)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_finished_run_is_never_overwritten(capsys, tmp_path, base):
    assert _run(capsys, *base)[0] == 0
    before = _digest(tmp_path / "run")
    code, err = _run(capsys, *base)
    assert code == 2 and "holds a finished run" in err and "overwrite=true" in err
    code, err = _run(capsys, *base, "resume=true")
    assert code == 2 and "already finished" in err
    code, err = _run(capsys, *base, "learning_rate=0.5")
    assert code == 2
    assert _digest(tmp_path / "run") == before
    assert _run(capsys, *base, "overwrite=true")[0] == 0


def test_foreign_files_are_never_deleted(capsys, tmp_path, base):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "thesis.tex").write_text("years of work")
    code, err = _run(capsys, *base, "overwrite=true")
    assert code == 2 and "thesis.tex" in err
    assert (tmp_path / "run" / "thesis.tex").read_text() == "years of work"


def test_nothing_to_resume(capsys, base):
    code, err = _run(capsys, *base, "resume=true")
    assert code == 2 and "Nothing to resume" in err


def test_real_process_exit_code_and_no_traceback(tmp_path, base):
    proc = subprocess.run([sys.executable, "-m", "finetune", "train", *base, "micro_batch_size=3"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "micro_batch_size=3 does not divide effective_batch_size=16" in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_overwrite_replaces_every_file_a_run_writes(capsys, tmp_path, base):
    assert _run(capsys, *base, "lora=true", "merge_lora=true")[0] == 0
    assert (tmp_path / "run" / "adapter").is_dir()
    assert _run(capsys, *base, "overwrite=true")[0] == 0  # adapter/ is the run's own, not a foreign file
    assert not (tmp_path / "run" / "adapter").exists()


def test_a_failure_after_the_start_is_the_runs_last_event(capsys, monkeypatch, tmp_path, base):
    from finetune.errors import TrainingError
    from finetune.run.events import read_events

    def broken(model, batch, kind):
        raise RuntimeError("boom")

    monkeypatch.setattr("finetune.engine.step.loss_sum", broken)
    with pytest.raises(RuntimeError, match="boom"):  # an internal error keeps its traceback
        _run(capsys, *base)
    last = read_events(tmp_path / "run" / "events.jsonl")[-1]
    assert (last["event"], last["exit_code"], last["message"]) == ("error", 1, "RuntimeError: boom")

    def diverged(model, batch, kind):
        raise TrainingError("training diverged")

    monkeypatch.setattr("finetune.engine.step.loss_sum", diverged)
    code, err = _run(capsys, *base, "overwrite=true")
    # What the run said when it started (the data's segmentation), then the failure in one line.
    assert code == 1 and err.endswith("\nerror: training diverged\n") and err.count("error:") == 1
    assert "Traceback" not in err
    last = read_events(tmp_path / "run" / "events.jsonl")[-1]
    assert (last["event"], last["exit_code"], last["message"]) == ("error", 1, "training diverged")
