"""Two processes (`accelerate launch --multi_gpu --num_processes 2`: two gloo CPU processes here), and two machines
(`--num_machines 2`, both on 127.0.0.1), train exactly like one process with the same effective batch, and only the
main process writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import assert_same_weights, load_weights, run_train, step_losses

from finetune.run.events import read_events

# Real launches: tens of seconds each on two cores. The fast lane checks every kind's reduction in one process
# instead (tests/test_contract.py).
pytestmark = pytest.mark.slow

COMMON = {"optimizer": "sgd", "learning_rate": 0.5, "warmup_ratio": 0.0, "weight_decay": 0.0, "eval_fraction": 0.0,
          "precision": "fp32", "epochs": 2, "logging_every": 1, "max_grad_norm": 1.0}


def launch_two(tmp_path, values: dict, mode: tuple[str, ...] = ("--multi_gpu",)):
    cfg = tmp_path / "two.yaml"
    cfg.write_text(yaml.safe_dump({**COMMON, **values, "output_dir": str(tmp_path / "two")}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *mode, "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           "-m", "finetune", "train", str(cfg), "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, tmp_path / "two"


# One real launch per way of counting a window's targets; every kind's reduction is also checked in one process
# (tests/test_contract.py: two ranks in threads).
LAUNCHES = ["per-sample", "per-token", "per-pair", "per-group"]


def _launch_case(request, case: str) -> tuple[dict, int, int]:
    """The config keys of a launch, the micro-batch of each of the two processes, and that of the one process."""
    if case == "per-sample":
        # Classification: 37 samples in windows of 16: the tail of 5 splits 3 + 2 over the processes.
        return {"model": request.getfixturevalue("tiny_bert"), "dataset": request.getfixturevalue("cls_csv"),
                "effective_batch_size": 16, "shuffle": True, "group_by_length": True, "eval_fraction": 0.2}, 4, 16
    if case == "per-token":
        # Causal LM: 13 texts split into 49 blocks of at most 32 tokens, each repeating 8 of context: windows of 8
        # blocks, the tail a single block (one process joins with a stand-in); targets are counted after the
        # split, over both processes.
        return {"model": request.getfixturevalue("tiny_llama"), "dataset": request.getfixturevalue("long_csv"),
                "task": "causal_lm", "effective_batch_size": 8, "max_length": 32, "long_documents": "sliding_window",
                "stride": 8, "shuffle": True, "group_by_length": True}, 2, 8
    if case == "per-group":
        # GRPO: each process generates its own prompts' groups (seeded per prompt and step, so the same completions
        # as one process), the advantages and DAPO's token count are the window's, and each window trains twice
        # (num_iterations 2) on its completions with the KL term: 10 prompts × 4 completions in windows of 16, the
        # tail of 8 split 4 + 4.
        return {"model": request.getfixturevalue("tiny_gpt2"), "dataset": request.getfixturevalue("arithmetic_csv"),
                "task": "grpo", "max_length": 32, "rewards": "regex:^[a-m]", "num_generations": 4,
                "max_completion_length": 6, "loss_type": "dapo", "num_iterations": 2, "beta": 0.1, "epochs": 1,
                "effective_batch_size": 16, "learning_rate": 0.05}, 4, 16
    # Preference pairs with ORPO: pairs stay whole, and both counts (chosen tokens and pairs) are global.
    return {"model": request.getfixturevalue("tiny_gpt2"), "dataset": request.getfixturevalue("pairs_csv"),
            "task": "preference", "preference_loss": "orpo", "max_length": 32, "epochs": 1,
            "effective_batch_size": 10, "learning_rate": 0.1}, 1, 10


@pytest.mark.parametrize("case", LAUNCHES)
def test_two_processes_equal_one(tmp_path, request, case):
    values, two_micro, one_micro = _launch_case(request, case)
    proc, two_dir = launch_two(tmp_path, {**values, "micro_batch_size": two_micro})
    one, one_events, _ = run_train(tmp_path / "one", **{**COMMON, **values, "micro_batch_size": one_micro})
    two_events = read_events(two_dir / "events.jsonl")
    start = two_events[0]
    accum = values["effective_batch_size"] // (2 * two_micro)
    assert (start["num_processes"], start["micro_batch_size"], start["grad_accum_steps"]) == (2, two_micro, accum)
    assert_same_weights(load_weights(two_dir), one)
    torch.testing.assert_close(step_losses(two_events), step_losses(one_events), rtol=1e-5, atol=1e-6)
    steps = [[e.get("metrics") for e in events if e["event"] == "step"] for events in (two_events, one_events)]
    for x, y in zip(*steps, strict=True):  # a kind's step metrics, summed over both processes
        assert x == (None if y is None else pytest.approx(y, rel=1e-5, abs=1e-6))
    evals = [[e["metrics"] for e in events if e["event"] == "eval"] for events in (two_events, one_events)]
    for x, y in zip(*evals, strict=True):  # the evaluation's sums and gathered predictions, over both processes
        assert x == pytest.approx(y, rel=1e-5, abs=1e-6)
    if case == "per-token":
        assert start["segmentation"] == one_events[0]["segmentation"] and start["segmentation"]["samples"] == 49
    # Only the main process writes: one start record, one done record, one result printed.
    assert [e["event"] for e in two_events].count("start") == 1
    assert [e["event"] for e in two_events].count("done") == 1
    assert proc.stdout.count('"run_dir"') == 1


def test_fsdp_asked_for_on_cpu_says_it_runs_ddp(tmp_path, tiny_bert, cls_csv):
    """`accelerate launch --use_fsdp --fsdp_version 2` on a machine without CUDA: accelerate silently runs DDP; the
    run says so (stderr, the start event's note, plan.json), reports `distributed: ddp`, and still trains like one
    process. (FSDP itself is tested with torch's fully_shard in test_fsdp.py: accelerate does not shard on CPU.)"""
    values = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 8, "max_steps": 2}
    proc, two_dir = launch_two(tmp_path, {**values, "micro_batch_size": 4}, mode=("--use_fsdp", "--fsdp_version", "2"))
    one, one_events, _ = run_train(tmp_path / "one", **{**COMMON, **values, "micro_batch_size": 8})
    start = read_events(two_dir / "events.jsonl")[0]
    plan = json.loads((two_dir / "plan.json").read_text())
    assert (start["distributed"], plan["distributed"], start["num_processes"]) == ("ddp", "ddp", 2)
    assert start["note"].startswith("FSDP was asked for, but accelerate ") and "plain DDP over 2 CPU processes" in \
        start["note"]
    assert plan["notes"][0] == start["note"]
    assert proc.stderr.count(f"note: {start['note']}") == 1  # printed once, by the main process
    assert one_events[0]["distributed"] == "single" and one_events[0]["note"] is None
    assert_same_weights(load_weights(two_dir), one)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_equal_one_process(tmp_path, tiny_bert, cls_csv):
    """`accelerate launch --num_machines 2`, machine ranks 0 and 1 on 127.0.0.1 (one gloo CPU process each, the
    run folder shared as a bucket or NFS mount would share it) trains to the weights of one process with the same
    effective batch; only the first machine's main process writes the run's files."""
    values = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 16, "max_steps": 3, "shuffle": True,
              "group_by_length": True}
    cfg = tmp_path / "machines.yaml"
    cfg.write_text(yaml.safe_dump({**COMMON, **values, "micro_batch_size": 4, "output_dir": str(tmp_path / "two")}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    port = _free_port()
    machines = [subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
         "--machine_rank", str(rank), "--num_processes", "2", "--main_process_ip", "127.0.0.1",
         "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
         "-m", "finetune", "train", str(cfg), "-q"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    outputs = [m.communicate(timeout=300) for m in machines]
    for machine, (_, err) in zip(machines, outputs, strict=True):
        assert machine.returncode == 0, err[-3000:]
    one, one_events, _ = run_train(tmp_path / "one", **{**COMMON, **values, "micro_batch_size": 8})
    two_events = read_events(tmp_path / "two" / "events.jsonl")
    start = two_events[0]
    assert (start["num_processes"], start["micro_batch_size"], start["grad_accum_steps"]) == (2, 4, 2)
    assert start["distributed"] == "ddp"
    assert_same_weights(load_weights(tmp_path / "two"), one)
    torch.testing.assert_close(step_losses(two_events), step_losses(one_events), rtol=1e-5, atol=1e-6)
    assert [e["event"] for e in two_events].count("done") == 1
    assert [out.count('"run_dir"') for out, _ in outputs] == [1, 0]  # the result printed by machine 0 only
