"""Runs survive crashes: a checkpoint half-written when the process is killed is never resumed from, the loop's
state is stored without pickle, a cut-off events.jsonl line does not swallow the next record, and `overwrite`
only ever replaces folders the tool marked as its own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch
import yaml
from conftest import assert_same_weights, load_weights

from finetune.cli import main
from finetune.config.schema import from_dict
from finetune.run import rundir
from finetune.run.events import Error, EventLog, Step, read_events
from finetune.train.loop import StopFlag, train

# Dies as the OOM killer would kill it (SIGKILL, no clean-up) in the middle of its second checkpoint: every file of
# that checkpoint is written but one, and the rename that would make it visible never happens.
KILL_MID_CHECKPOINT = textwrap.dedent("""
    import os, signal, sys
    from finetune import cli
    from finetune.run import rundir

    commit, calls = rundir.commit_checkpoint, []

    def crash(partial, path):
        calls.append(path)
        if len(calls) == 2:
            for f in partial.glob("*.safetensors"):
                f.unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        commit(partial, path)

    rundir.commit_checkpoint = crash
    sys.exit(cli.main(sys.argv[1:]))
""")


def _values(tmp_path, model, dataset, name):
    return {"model": model, "dataset": dataset, "output_dir": str(tmp_path / name), "epochs": 3,
            "effective_batch_size": 16, "micro_batch_size": 4, "learning_rate": 1e-3, "eval_fraction": 0.0,
            "save_every": 2}


def test_kill_mid_checkpoint_then_resume_equals_uninterrupted(tmp_path, tiny_bert_dropout, cls_csv, capsys):
    full = train(from_dict(_values(tmp_path, tiny_bert_dropout, cls_csv, "full")))
    assert full.status == "done" and full.step == 9

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(_values(tmp_path, tiny_bert_dropout, cls_csv, "cut")))
    script = tmp_path / "killed_mid_checkpoint.py"
    script.write_text(KILL_MID_CHECKPOINT)
    killed = subprocess.run([sys.executable, str(script), "train", str(cfg), "-q"], capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stderr
    run_dir = tmp_path / "cut"
    assert [p.name for p in rundir.checkpoints(run_dir)] == ["step-0000002"]
    assert (run_dir / "checkpoints" / "step-0000004.partial").is_dir()  # the half-written one is still there

    # The resume is an ordinary `finetune train`: the CLI's main() in this process, without a child's start-up.
    capsys.readouterr()
    code = main(["train", str(cfg), "resume=true", "-q"])
    resumed = capsys.readouterr()
    assert code == 0, resumed.err
    assert "Traceback" not in resumed.err
    assert_same_weights(load_weights(run_dir), load_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)
    assert not list((run_dir / "checkpoints").glob("*.partial"))
    starts = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "start"]
    assert [(e["resumed"], e["step"]) for e in starts] == [(False, 0), (True, 2)]


def test_checkpoint_state_is_json_and_resume_unpickles_nothing(tmp_path, tiny_bert_dropout, cls_csv, monkeypatch):
    values = {**_values(tmp_path, tiny_bert_dropout, cls_csv, "run"), "max_steps": 4}
    stop = StopFlag()
    train(from_dict(values), stop=stop, callbacks=[lambda e: stop.request() if isinstance(e, Step) else None])
    checkpoint = rundir.checkpoints(tmp_path / "run")[-1]
    state = json.loads((checkpoint / rundir.TRAINER_STATE).read_text())
    assert state["progress"]["step"] == 1 and state["scheduler"]["last_epoch"] == 1
    assert not list(checkpoint.glob("custom_checkpoint_*"))  # what accelerate pickles for registered objects

    loads = []
    real_load = torch.load

    def recording_load(*args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    result = train(from_dict({**values, "resume": True}))
    assert result.status == "done" and result.step == 4
    assert loads and all(w is True for w in loads), loads  # optimizer, RNG states: tensors only, never code


def test_a_cut_off_event_line_does_not_swallow_the_next(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "start", "time": 1}\n{"event": "step", "ti')  # killed mid-write
    EventLog(path).emit(Error(message="boom"))
    EventLog(path).emit(Error(message="again"))
    records = read_events(path)
    assert [r["event"] for r in records] == ["start", "error", "error"]
    assert path.read_text().endswith("}\n")


def test_overwrite_refuses_a_folder_without_the_marker(tmp_path, tiny_bert, cls_csv):
    # Someone's folder that happens to look like a run: a config.yaml and a model/ with their work in it.
    theirs = tmp_path / "important"
    (theirs / "model").mkdir(parents=True)
    (theirs / "model" / "weights.bin").write_bytes(b"precious")
    (theirs / "config.yaml").write_text("mine: true\n")
    proc = subprocess.run([sys.executable, "-m", "finetune", "train", f"model={tiny_bert}", f"dataset={cls_csv}",
                           f"output_dir={theirs}", "overwrite=true", "max_steps=1"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert "finetune did not write" in proc.stderr and "overwrite=true" not in proc.stderr
    assert (theirs / "model" / "weights.bin").read_bytes() == b"precious"
    assert (theirs / "config.yaml").read_text() == "mine: true\n"


def test_overwrite_replaces_a_marked_run(tmp_path, tiny_bert, cls_csv):
    values = {"model": tiny_bert, "dataset": cls_csv, "output_dir": str(tmp_path / "run"), "max_steps": 1,
              "eval_fraction": 0.0}
    train(from_dict(values))
    assert (tmp_path / "run" / rundir.MARKER).is_file()
    again = train(from_dict({**values, "overwrite": True}))
    assert again.status == "done"
    assert [e["event"] for e in read_events(tmp_path / "run" / "events.jsonl")].count("start") == 1
