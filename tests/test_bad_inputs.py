"""Bad input gets one clear sentence, exit code 2, no traceback, and nothing of the user's is overwritten."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
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
    # loss.png comes from a process of its own: the folder is complete once it is there (it is renamed into place).
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "loss.png").exists():
        assert time.monotonic() < deadline, "loss.png was not drawn within 120 s"
        time.sleep(0.1)
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


# --- Issue 28: what a new user or an attacker gave, each one sentence with exit 2 before training starts

def _cli(tmp_path, *argv: str) -> tuple[int, str, float]:
    """`python -m finetune train …` in a child (as a user runs it): exit code, stderr, seconds."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "finetune", "train", *argv, f"output_dir={tmp_path / 'run'}", "-q"],
                          capture_output=True, text=True, cwd=tmp_path)
    return proc.returncode, proc.stderr, time.perf_counter() - start


def _one_sentence(code: int, err: str, tmp_path: Path) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_text_column_of_numbers_or_ids_is_refused_as_the_app_refuses_it(capsys, tmp_path, base):
    numbers = tmp_path / "scores.csv"
    numbers.write_text("id,score\n" + "".join(f"{i},{i % 2}\n" for i in range(40)))
    code, err = _run(capsys, *base, f"dataset={numbers}", "label_column=score")
    assert code == 2 and err == ("error: Column 'id', the `text_column` (guessed: no `text_column` was given), holds "
                                 "numbers, not text: set text_column= to the column with the text, or add one to the "
                                 "file.\n")
    codes = tmp_path / "codes.csv"
    codes.write_text("code,sentence,label\n" + "".join(f"A-{i},fine film {i},{i % 2}\n" for i in range(40)))
    code, err = _run(capsys, *base, f"dataset={codes}", "text_column=code")
    assert code == 2 and err.startswith("error: Column 'code', the `text_column`, looks like ids (one distinct code "
                                        "per row), not text: set text_column= to the column with the text (the "
                                        "others are: sentence)")
    assert _run(capsys, *base, f"dataset={codes}", "text_column=sentence")[0] == 0  # its text column trains


def test_a_json_record_with_200000_fields_is_refused_at_once(tmp_path, tiny_bert):
    """The second record of a 2.7 MB JSON Lines file has 200,000 keys: `datasets` took 97.8 s to fail on it."""
    data = tmp_path / "wide.jsonl"
    rows = [{"text": "good film", "label": "pos"}, {f"k{i}": 0 for i in range(200_000)},
            *({"text": f"film {i}", "label": ["pos", "neg"][i % 2]} for i in range(20))]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err, seconds = _cli(tmp_path, f"model={tiny_bert}", f"dataset={data}")
    _one_sentence(code, err, tmp_path)
    assert err == ("error: Dataset file '" + str(data) + "': its records have more than 1,000 distinct fields "
                   "together by line 2 (nested ones counted), and a file may have at most 1,000: keep only the "
                   "fields you train on.\n")
    assert seconds < 30  # about 12 s here, nearly all of it the start of a Python that imports torch


def test_many_json_records_each_with_new_keys_are_refused_like_one_wide_record(tmp_path):
    """Each record under the bound, the file over it: 600 records of 2 new keys each make a table of 1,200 columns."""
    from finetune.data.load import check_json_width
    from finetune.errors import DataError

    for name, text in (("many.jsonl", "".join(json.dumps({f"a{i}": 1, f"b{i}": "x"}) + "\n" for i in range(600))),
                       ("many.json", json.dumps([{f"a{i}": 1, f"b{i}": "x"} for i in range(600)]))):
        data = tmp_path / name
        data.write_text(text)
        with pytest.raises(DataError, match="more than 1,000 distinct fields together by (line|record) 501 "):
            check_json_width(data, str(data))
    same = tmp_path / "same.jsonl"  # the same keys on every line: as wide as one record
    same.write_text("".join(json.dumps({"text": f"film {i}", "label": i % 2, "meta": {"a": i}}) + "\n"
                            for i in range(5_000)))
    check_json_width(same, str(same))


def test_a_json_array_is_read_record_by_record_as_json_reads_it_whole(tmp_path):
    """The width check reads a .json array a chunk at a time (not as one document in memory): the same records as
    `json.load`, with records, numbers and strings cut at every place by a chunk of a few characters."""
    import io

    from finetune.data.load import _MALFORMED, _array_records

    records = [{"text": "a \"quoted\" film, [not] the end]", "n": 12345678901234567890, "x": [1.5e-3, True, None]},
               {"messages": [{"role": "user", "content": "hi" * 50}]}, 7, "ok", [], {}]
    text = json.dumps(records, indent=1)
    for chunk in (1, 3, 7, 64, 1 << 20):
        assert [r for _, r in _array_records(io.StringIO(text), chunk)] == records, chunk
    assert [r for _, r in _array_records(io.StringIO("[]"))] == []
    assert [r for _, r in _array_records(io.StringIO('[{"a": 1}, {"b": '), 4)] == [{"a": 1}, _MALFORMED]


def test_conversations_count_their_turns_fields_once():
    from finetune.data.load import MAX_RECORD_KEYS, _fields

    long_chat = {"messages": [{"role": "user", "content": "hi"}] * 5_000, "id": 3}
    assert _fields(long_chat) == 4  # messages, messages[].role, messages[].content, id
    assert _fields({f"k{i}": {"a": 1} for i in range(MAX_RECORD_KEYS)}) > MAX_RECORD_KEYS


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("digits", "max_steps: " + "6" * 60_000 + "\n", "a number too long to read (more than 4,300 digits)"),
    ("deep_mapping", "epochs: " + "{a: " * 12_000 + "1" + "}" * 12_000 + "\n", "more than 50 levels deep"),
    ("deep_list", "epochs: " + "[" * 20_000 + "]" * 20_000 + "\n", "more than 50 levels deep"),
    ("aliases", "a: &a [1]\n" + "".join(f"a{i}: &a{i} [*{'a' if i == 0 else f'a{i - 1}'}]\n"
                                        for i in range(3_000)), "expands to more than 10,000 values"),
])
def test_yaml_that_cannot_be_built_is_one_sentence(tmp_path, name, text, expected):
    config = tmp_path / f"{name}.yaml"
    config.write_text(text)
    code, err, _ = _cli(tmp_path, str(config))
    _one_sentence(code, err, tmp_path)
    assert err.startswith(f"error: Config file {str(config)!r}: the config's YAML ") and expected in err


def test_a_60000_digit_override_is_one_sentence(capsys, base):
    code, err = _run(capsys, *base, "max_steps=" + "6" * 60_000)
    assert code == 2 and err.startswith("error: Override 'max_steps': the config's YAML holds a number too long")


def test_a_5000_character_reference_model_is_one_sentence(tmp_path, tiny_gpt2, pairs_csv):
    code, err, _ = _cli(tmp_path, "task=preference", f"model={tiny_gpt2}", f"dataset={pairs_csv}",
                        "reference_model=" + "a" * 5_000)
    _one_sentence(code, err, tmp_path)
    assert err == ("error: `reference_model` has 5,000 characters, more than a folder's path (at most 4,096) or a "
                   "Hub id (at most 96) has: give a model folder or a Hub id.\n")
    code, err, _ = _cli(tmp_path, "task=preference", f"model={tiny_gpt2}", f"dataset={pairs_csv}",
                        "reference_model=" + "a" * 300)  # too long for a file name, not for a path
    assert code == 2 and err.startswith("error: Model 'aaaa") and "nor a Hub id (its name has 300 characters" in err


def test_a_regression_target_written_as_python_writes_numbers_is_refused(capsys, tmp_path, base):
    data = tmp_path / "targets.csv"
    data.write_text("sentence,label\ngood film,1_000\n" + "".join(f"film {i},{i}.5\n" for i in range(20)))
    code, err = _run(capsys, *base, f"dataset={data}", "task=regression")
    assert code == 2 and err == (f"error: Target column 'label' of {str(data)!r} at row 1 is '1_000', not a finite "
                                 "number: regression needs a number in every row; fix or remove that row.\n")


def test_integer_and_string_tags_side_by_side_are_refused(tmp_path, tiny_bert):
    data = tmp_path / "tags.jsonl"
    data.write_text("".join(json.dumps({"tokens": ["Ann", "runs"], "tags": [0, "B-PER"] if i == 3 else
                                        ["B-PER", "O"]}) + "\n" for i in range(20)))
    code, err, _ = _cli(tmp_path, "task=token_classification", f"model={tiny_bert}", f"dataset={data}")
    _one_sentence(code, err, tmp_path)
    assert err == (f"error: Tags column 'tags' of {str(data)!r} mixes kinds of values: tags are all strings, or all "
                   "integers.\n")


# --- Issue 42: the data decides what it can be; no pyarrow or `datasets` text reaches a person

DIGITS = Path(__file__).resolve().parents[1] / "assets" / "digits_sample"


@pytest.mark.parametrize("task, kind", [("classification", "text classification"),
                                        ("causal_lm", "causal language modelling")])
def test_an_image_folder_under_a_text_task_names_image_classification(tmp_path, task, kind):
    """Before: the default task cast the images to text (a pyarrow traceback, exit 1); causal_lm said "No text
    column found … columns are: image, label". Neither named the task that reads images."""
    code, err, _ = _cli(tmp_path, f"dataset={DIGITS}", f"task={task}", "max_steps=1")
    _one_sentence(code, err, tmp_path)
    assert err == (f"error: Dataset {str(DIGITS)!r} holds images (column 'image'), which a {kind} model cannot learn "
                   "from: set task=image_classification and an image model (model=google/vit-base-patch16-224-in21k, "
                   "say) to train on them.\n")


def test_an_empty_or_header_only_csv_is_one_sentence_about_the_file(capsys, tmp_path, base):
    """Before: `Instruction "train" corresponds to no data!` (header only) and `An error occurred while generating
    the dataset` (empty), both `datasets`' own words."""
    empty = tmp_path / "empty.csv"
    empty.write_text("\n  \n")
    code, err = _run(capsys, *base, f"dataset={empty}")
    assert code == 2 and err == (f"error: Dataset file {str(empty)!r} is empty: give a file with one example per row "
                                 "(a CSV's first line names its columns).\n")
    header = tmp_path / "header.csv"
    header.write_text("text,label\n\n")
    code, err = _run(capsys, *base, f"dataset={header}")
    assert code == 2 and err == (f"error: Dataset file {str(header)!r} has a header line ('text,label') but no rows: "
                                 "add one example per line under it.\n")
