"""`streaming: true`: a local file read as a stream keeps (B, k) ≡ (k·B, 1) and exact stop/resume, reads its rows in
the stream's order, and is refused without `max_steps`."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import assert_same_weights, load_weights, run_train, step_losses

from finetune.config.schema import from_dict
from finetune.run.events import Step, read_events
from finetune.train.loop import StopFlag, train

# cls_csv has 37 rows: windows of 16 are 16, 16, 5 | 16, 16, ... so 5 steps cross the end of the first pass.
STREAM = {"streaming": True, "max_steps": 5, "effective_batch_size": 16, "max_grad_norm": 0.0}


def test_stream_accumulation_equals_big_batch(tmp_path, tiny_bert, cls_csv):
    common = {"model": tiny_bert, "dataset": cls_csv, "shuffle": True, **STREAM}
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=16, **common)
    acc, acc_events, result = run_train(tmp_path / "acc", micro_batch_size=4, **common)
    assert result.step == 5
    assert [e["samples"] for e in acc_events if e["event"] == "step"] == [16, 32, 37, 53, 69]
    assert_same_weights(big, acc)
    torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)


def test_an_unshuffled_stream_trains_like_the_same_rows_in_order(tmp_path, tiny_bert, cls_csv):
    common = {"model": tiny_bert, "dataset": cls_csv, "shuffle": False, "group_by_length": False,
              "effective_batch_size": 16, "micro_batch_size": 4}
    streamed, _, _ = run_train(tmp_path / "stream", streaming=True, max_steps=3, **common)
    in_memory, _, _ = run_train(tmp_path / "arrow", epochs=1, **common)
    assert_same_weights(streamed, in_memory)


def test_stream_stop_then_resume_equals_uninterrupted(tmp_path, tiny_bert_dropout, cls_csv):
    def config(name: str, **extra):
        return from_dict({"model": tiny_bert_dropout, "dataset": cls_csv, "output_dir": str(tmp_path / name),
                          "micro_batch_size": 4, "learning_rate": 1e-3, "eval_fraction": 0.0, "save_every": 2,
                          "logging_every": 1, **STREAM, "max_steps": 6, **extra})

    full = train(config("full"))
    stop = StopFlag()
    stopped = train(config("cut"), stop=stop,
                    callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 4 else None])
    assert (full.step, stopped.status, stopped.step) == (6, "stopped", 4)  # stopped in the stream's second pass
    resumed = train(config("cut", resume=True))
    assert resumed.status == "done" and resumed.step == 6
    assert_same_weights(load_weights(tmp_path / "cut"), load_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)
    assert step_losses(read_events(tmp_path / "cut" / "events.jsonl")) == \
        step_losses(read_events(tmp_path / "full" / "events.jsonl"))


def test_streaming_without_max_steps_is_refused_in_one_sentence(tmp_path, cls_csv):
    proc = subprocess.run([sys.executable, "-m", "finetune", "train", f"dataset={cls_csv}", "streaming=true",
                           "eval_fraction=0", f"output_dir={tmp_path / 'run'}", "-q"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "`streaming=true` needs `max_steps`: a stream's length is unknown, so epochs cannot be counted." \
        in proc.stderr
    assert not (tmp_path / "run").exists()
