"""Stop at an optimizer-step boundary, checkpoint, resume: the final weights equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import assert_same_weights, load_weights, step_losses

from finetune.cli import main
from finetune.config.schema import from_dict
from finetune.run.events import Step, read_events
from finetune.run.rundir import checkpoints
from finetune.train.loop import StopFlag, train


def _config(tmp_path, model, dataset, name, **extra):
    # AdamW, a warm-up schedule, shuffling, length grouping and dropout: every piece of state must be restored.
    return from_dict({"model": model, "dataset": dataset, "output_dir": str(tmp_path / name), "epochs": 3,
                      "effective_batch_size": 16, "micro_batch_size": 4, "learning_rate": 1e-3, "eval_fraction": 0.0,
                      "save_every": 2, "logging_every": 1, **extra})


# classification: 37 samples, 3 windows of 16 per epoch. long_documents: 13 texts split into 41 blocks of at most
# 32 tokens (chunk), also 3 windows per epoch; the order of blocks must come back the same after a resume.
CASES = {"classification": ("tiny_bert_dropout", "cls_csv", {}),
         "long_documents": ("tiny_llama", "long_csv", {"task": "causal_lm", "max_length": 32,
                                                       "long_documents": "chunk"})}


@pytest.mark.parametrize("case", CASES)
def test_stop_then_resume_equals_uninterrupted(tmp_path, request, case):
    model_fixture, data_fixture, extra = CASES[case]
    model, dataset = request.getfixturevalue(model_fixture), request.getfixturevalue(data_fixture)
    full = train(_config(tmp_path, model, dataset, "full", **extra))
    assert full.status == "done" and full.step == 9

    stop = StopFlag()
    stopped = train(_config(tmp_path, model, dataset, "cut", **extra), stop=stop,
                    callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 4 else None])
    assert stopped.status == "stopped" and stopped.step == 4  # mid-epoch: epoch 1, window 1 of 3
    events = read_events(tmp_path / "cut" / "events.jsonl")
    assert events[-1]["event"] == "stopped" and events[-1]["step"] == 4
    assert not (tmp_path / "cut" / "model").exists()
    assert checkpoints(tmp_path / "cut")[-1].name == "step-0000004"

    resumed = train(_config(tmp_path, model, dataset, "cut", resume=True, **extra))
    assert resumed.status == "done" and resumed.step == 9
    assert_same_weights(load_weights(tmp_path / "cut"), load_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)
    cut_events = read_events(tmp_path / "cut" / "events.jsonl")
    assert step_losses(cut_events) == step_losses(read_events(tmp_path / "full" / "events.jsonl"))
    assert [e["resumed"] for e in cut_events if e["event"] == "start"] == [False, True]
    assert len(checkpoints(tmp_path / "cut")) <= 3  # only the last few are kept
    if case == "long_documents":
        starts = [e for e in cut_events if e["event"] == "start"]
        assert starts[0]["segmentation"] == starts[1]["segmentation"] and starts[0]["segmentation"]["samples"] == 41


@pytest.mark.slow  # 34-210 s in the fast lane (load 3)
def test_sigint_stops_cleanly_and_resume_finishes(tmp_path, tiny_bert, cls_csv, capsys):
    cfg = tmp_path / "run.yaml"
    run_dir = tmp_path / "run"
    values = {"model": tiny_bert, "dataset": cls_csv, "output_dir": str(run_dir), "epochs": 60,
              "effective_batch_size": 16, "micro_batch_size": 4, "eval_fraction": 0.0}
    cfg.write_text(yaml.safe_dump(values))
    proc = subprocess.Popen([sys.executable, "-m", "finetune", "train", str(cfg), "-q"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(e["event"] == "step" for e in read_events(run_dir / "events.jsonl")):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "resume=true" in err
    last = read_events(run_dir / "events.jsonl")[-1]
    assert last["event"] == "stopped" and last["step"] < 60 * 3
    assert os.path.isdir(last["checkpoint"])

    # A stopped run is protected: a plain re-run refuses, resume=true continues it to the end. These are ordinary
    # `finetune train` commands: the CLI's main() in this process, without a child's start-up each.
    capsys.readouterr()
    assert main(["train", str(cfg), "-q"]) == 2 and "resume=true" in capsys.readouterr().err
    code = main(["train", str(cfg), "resume=true", f"max_steps={last['step'] + 2}", "-q"])
    assert code == 2 and "max_steps" in capsys.readouterr().err  # changing the schedule on resume is refused
    code = main(["train", str(run_dir / "config.yaml"), "resume=true", "-q"])
    done = capsys.readouterr()
    assert code == 0, done.err
    assert json.loads(done.out)["steps"] == 60 * 3
    uninterrupted = train(from_dict({**values, "output_dir": str(tmp_path / "full")}))
    assert uninterrupted.step == 60 * 3
    assert_same_weights(load_weights(run_dir), load_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)


# Sends the process a SIGINT as numpy starts to load, within the engine's import, then runs the CLI.
SIGINT_AS_NUMPY_LOADS = """
import importlib.abc, os, runpy, signal, sys

class SigintAt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, SigintAt())
sys.argv = ["finetune", *sys.argv[1:]]
runpy.run_module("finetune", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_a_stop_while_the_engine_imports_ends_the_command_before_it_loads_anything(tmp_path, tiny_bert, cls_csv,
                                                                                   command):
    # A Stop in a run's first second landed while torch's C extension loaded numpy: the KeyboardInterrupt never came
    # out (the run trained to its end), or numpy was left half-made (a RecursionError failed the run). The handlers
    # are now set before the engine's import.
    cfg = tmp_path / "run.yaml"
    values = {"model": tiny_bert, "dataset": cls_csv, "output_dir": str(tmp_path / "run"), "max_steps": 4,
              "effective_batch_size": 16, "micro_batch_size": 4, "eval_fraction": 0.2}
    if command == "sweep":
        values["sweep"] = {"objective": "eval/accuracy", "direction": "maximize", "trials": 2,
                           "space": {"learning_rate": [1e-4, 1e-3]}}
    cfg.write_text(yaml.safe_dump(values))
    assert "numpy" not in subprocess.run([sys.executable, "-c", "import sys, finetune.cli; print(*sys.modules)"],
                                         capture_output=True, text=True, check=True).stdout.split()
    proc = subprocess.run([sys.executable, "-c", SIGINT_AS_NUMPY_LOADS, command, str(cfg), "-q"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Stopped before training started; nothing was saved." in proc.stderr
    assert not (tmp_path / "run").exists()
