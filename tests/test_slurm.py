"""Slurm as a backend (`--backend slurm`), against the stand-in of tests/fakeslurm.py: every node a local process,
so a 2-node job really trains over gloo and must equal one process; Ctrl-C cancels the job; what Slurm would reject
is refused in one sentence before anything is submitted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, assert_same_weights, load_weights, run_train, step_losses

from finetune.remote.slurm import cluster
from finetune.run.events import read_events

COMMON = {"optimizer": "sgd", "learning_rate": 0.5, "warmup_ratio": 0.0, "weight_decay": 0.0, "eval_fraction": 0.0,
          "precision": "fp32", "epochs": 2, "logging_every": 1, "max_grad_norm": 1.0}


def _jobs(state_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((state_dir / "jobs").glob("*.json"))]


def test_what_slurm_would_reject_is_one_sentence(slurm, tmp_path, tiny_bert, cls_csv, capsys, monkeypatch):
    from finetune.cli import main

    base = ["train", f"model={tiny_bert}", f"dataset={cls_csv}", f"output_dir={tmp_path / 'run'}", "--backend",
            "slurm"]
    cases = [(["--partition", "big"], "Partition 'big' is not on this cluster: choose one of debug, gpu"),
             (["--nodes", "3"], "Partition 'debug' has 2 node(s): --nodes 3 asks for more."),
             (["--partition", "gpu", "--gpus-per-node", "9"],
              "The nodes of partition 'gpu' have 8 GPU(s) each: --gpus-per-node 9 asks for more."),
             (["--partition", "gpu", "--gpu-memory", "-1"], "--gpu-memory is the GB of one of the partition's GPUs"),
             (["--gpus-per-node", "0", "--time", "soon"], "--time 'soon' is not a Slurm time limit")]
    for extra, sentence in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert sentence in err and err.count("\n") == 1, err
    assert main([*base[:-2], "--nodes", "2"]) == 2  # a Slurm option without the backend
    assert "--nodes is an option of --backend slurm" in capsys.readouterr().err
    assert main([*base, "--partition", "gpu", "--gpu-memory", "0.1"]) == 2  # the plan, for one of its GPUs
    err = capsys.readouterr().err
    assert err.startswith("error: Not sent to Slurm: on partition gpu (1 × H100, 0.09 GiB per GPU) nothing fits ")
    assert err.rstrip().endswith("choose a partition with more GPU memory (`sinfo` lists them), or give --gpu-memory "
                                 "its GPUs' GB.") and err.count("\n") == 1
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(base) == 2
    assert "Slurm's sbatch is not on the PATH" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "slurm-state" / "jobs").exists()


def test_the_plan_is_for_one_gpu_of_the_partition_as_sinfo_describes_it(slurm, tiny_bert, cls_csv):
    """Without --gpu-memory, a GPU's memory is read from `sinfo`: a node feature that names the GPU and ends in its
    size (`h100_80gb`), else the size of its GRES type (the smaller of a model sold in two); the launcher plans
    the job for one of them (80 GB: 74.51 GiB)."""
    from finetune.config.schema import from_dict
    from finetune.remote.slurm.run import _planned

    assert [cluster.gpu_memory_gb(f, t) for f, t in (("h100,h100_80gb,ib", "h100"), ("skylake,gpumem_94G", None),
                                                     ("ram512g,a100", "a100"), ("ram512g", "mystery"))] == \
        [80.0, 94.0, 40.0, None]
    (debug, gpu) = cluster.partitions()
    assert (gpu.name, gpu.gpus, gpu.gpu_type, gpu.gpu_memory_gb) == ("gpu", 8, "h100", 80.0)
    assert debug.default and debug.gpu_memory_gb is None
    checked = cluster.check_request(cluster.Request(partition="gpu", gpus_per_node=2))
    assert checked.hardware.gpu_memory_gb == 80.0
    assert cluster.check_request(cluster.Request(partition="gpu", gpu_memory_gb=40)).hardware.gpu_memory_gb == 40
    planned = _planned(from_dict({"model": tiny_bert, "dataset": cls_csv}), checked)
    assert planned.memory_budget_gb == 74.51


def test_time_limits_read_as_slurm_writes_them():
    assert [cluster.time_seconds(t) for t in ("90", "4:00:00", "1-00:00:00", "2-12", "30:15")] == \
        [5400, 14400, 86400, 216000, 1815]
    assert cluster.grace_s(14400) == 600 and cluster.grace_s(600) == 60


def test_batch_script_launches_one_accelerate_per_node(slurm, tmp_path):
    checked = cluster.check_request(cluster.Request(nodes=2, gpus_per_node=8, partition="gpu", time="4:00:00"))
    text = cluster.script(checked, run_dir=tmp_path / "run", name="run", workdir=tmp_path, python="python")
    assert checked.hardware.processes == 16
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --requeue",
                 "#SBATCH --time=4:00:00", "#SBATCH --signal=TERM@600",
                 'MAIN=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'):
        assert line in text.splitlines()
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert srun.startswith("srun --kill-on-bad-exit=1 bash -c ")
    assert ("--num_machines 2 --machine_rank $SLURM_NODEID --num_processes 16 --main_process_ip $MAIN "
            "--main_process_port $PORT") in srun and f"train {tmp_path / 'run' / 'slurm.yaml'} $RESUME -q" in srun


def _finetune(args: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
    full = {**os.environ, **env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "finetune", *args], env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


@pytest.mark.slow
def test_two_nodes_train_like_one_process(slurm, tmp_path, tiny_bert, cls_csv):
    """`--nodes 2 --gpus-per-node 0`: two "nodes", one gloo CPU process each, the first node the main process:
    the same losses (to 1e-6) and weights as one process with the same effective batch; job.json says slurm."""
    values = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 16, "max_steps": 3, "shuffle": True}
    cfg = tmp_path / "two.yaml"
    cfg.write_text(yaml.safe_dump({**COMMON, **values, "micro_batch_size": 4, "output_dir": str(tmp_path / "two")}))
    proc = _finetune(["train", str(cfg), "-q", "--backend", "slurm", "--nodes", "2", "--gpus-per-node", "0"], slurm)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    one, one_events, _ = run_train(tmp_path / "one", **{**COMMON, **values, "micro_batch_size": 8})
    two_events = read_events(tmp_path / "two" / "events.jsonl")
    start = two_events[0]
    assert (start["num_processes"], start["micro_batch_size"], start["grad_accum_steps"]) == (2, 4, 2)
    torch.testing.assert_close(step_losses(two_events), step_losses(one_events), rtol=0, atol=1e-6)
    assert_same_weights(load_weights(tmp_path / "two"), one)
    job = json.loads((tmp_path / "two" / "job.json").read_text())
    assert (job["backend"], job["nodes"], job["outcome"]["status"]) == ("slurm", 2, "done")
    assert json.loads(out)["run_dir"] == str(tmp_path / "two")
    assert "job 1000 start 0 on 127.0.0.1,127.0.0.2, main 127.0.0.1:" in (tmp_path / "two" / "slurm.log").read_text()


def test_ctrl_c_cancels_the_job(slurm, tmp_path, tiny_bert, cls_csv):
    """SIGINT to the launcher: `scancel`, the job ends CANCELLED, the launcher exits 130 and job.json says stopped."""
    cfg = tmp_path / "long.yaml"
    cfg.write_text(yaml.safe_dump({**COMMON, "model": tiny_bert, "dataset": cls_csv, "epochs": 1000,
                                   "effective_batch_size": 8, "output_dir": str(tmp_path / "run")}))
    proc = _finetune(["train", str(cfg), "-q", "--backend", "slurm", "--gpus-per-node", "0"], slurm)
    state = tmp_path / "slurm-state"
    deadline = time.monotonic() + 120
    while not ((tmp_path / "run" / "job.json").is_file() and _jobs(state) and _jobs(state)[0]["state"] == "RUNNING"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Cancelling Slurm job 1000" in err
    assert _jobs(state)[0]["state"] == "CANCELLED"
    outcome = json.loads((tmp_path / "run" / "job.json").read_text())["outcome"]
    assert outcome["status"] == "stopped" and outcome["message"].startswith("The job was cancelled")


@pytest.mark.slow
def test_a_preempted_job_resumes_and_ends_as_an_uninterrupted_run(slurm, tmp_path, tiny_bert, cls_csv):
    """`scontrol requeue` once the first checkpoint is written: the run gets SIGTERM (a checkpoint, exit 130), the
    requeued script resumes from the newest checkpoint, and the run ends with the weights and losses of a run that
    was never interrupted; the launcher follows it through and exits 0."""
    values = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 8, "micro_batch_size": 8,
              "max_steps": 60, "epochs": 100, "save_every": 1}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({**COMMON, **values, "output_dir": str(tmp_path / "run")}))
    proc = _finetune(["train", str(cfg), "-q", "--backend", "slurm", "--gpus-per-node", "0"], slurm)
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "checkpoints").is_dir() or not any((tmp_path / "run" / "checkpoints").iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.02)
    subprocess.run(["scontrol", "requeue", "1000"], check=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    log = (tmp_path / "run" / "slurm.log").read_text()
    assert "job 1000 start 1 on 127.0.0.1, main 127.0.0.1:" in log and "resuming" in log
    one, one_events, _ = run_train(tmp_path / "one", **{**COMMON, **values})
    events = read_events(tmp_path / "run" / "events.jsonl")
    assert [e["event"] for e in events].count("start") == 2 and events[-1]["event"] == "done"
    steps = {e["step"]: e["loss"] for e in events if e["event"] == "step"}  # the resumed run's, by step
    torch.testing.assert_close(list(steps.values()), step_losses(one_events), rtol=0, atol=1e-6)
    assert_same_weights(load_weights(tmp_path / "run"), one)


@pytest.mark.slow
def test_the_signal_before_the_time_limit_saves_a_checkpoint_and_the_requeued_job_resumes_from_it(slurm, tmp_path,
                                                                                                  tiny_bert, cls_csv):
    """`--time 1:00:00` asks Slurm for SIGTERM 360 s before the limit (`--signal=TERM@360`; the stand-in's clock
    sped up 333 times: 9.7 s after each start): the run saves a checkpoint and stops, the batch script requeues the
    job, and its next start resumes from that checkpoint."""
    cfg = tmp_path / "long.yaml"
    cfg.write_text(yaml.safe_dump({**COMMON, "model": tiny_bert, "dataset": cls_csv, "epochs": 1000,
                                   "effective_batch_size": 8, "output_dir": str(tmp_path / "run")}))
    proc = _finetune(["train", str(cfg), "-q", "--backend", "slurm", "--gpus-per-node", "0", "--time", "1:00:00",
                      "--detach"], {**slurm, "FAKE_SLURM_TIME_SCALE": "0.003"})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "#SBATCH --signal=TERM@360" in (tmp_path / "run" / "slurm.sbatch").read_text()

    def resumed() -> list[dict]:
        events = read_events(tmp_path / "run" / "events.jsonl")
        starts = [i for i, e in enumerate(events) if e["event"] == "start"]
        return events if len(starts) > 1 and events[-1]["event"] == "step" and events[-1]["step"] > 0 and \
            starts[-1] < len(events) - 1 else []

    deadline = time.monotonic() + 240
    try:
        while not (events := resumed()):
            assert time.monotonic() < deadline, (tmp_path / "run" / "slurm.log").read_text()[-3000:]
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", "1000"], check=True)
    second = [i for i, e in enumerate(events) if e["event"] == "start"][1]
    stopped = [e for e in events[:second] if e["event"] == "stopped"]
    saved = [e["step"] for e in events[:second] if e["event"] == "checkpoint"]
    assert stopped and saved and saved[-1] == stopped[-1]["step"] > 0
    assert [e["step"] for e in events[second:] if e["event"] == "step"][0] == saved[-1] + 1
    log = (tmp_path / "run" / "slurm.log").read_text()
    assert (f"finetune: job 1000 stopped with a checkpoint before its time limit; requeued to resume from "
            f"step-{saved[-1]:07d}") in log
    assert "finetune: job 1000 start 1 on 127.0.0.1, main 127.0.0.1:" in log and "resuming" in log


def test_the_run_panel_says_where_each_backend_runs(tmp_path):
    """An active run's status names its backend's place, read from job.json's `backend`."""
    from app.local.training import JobStatus
    from app.remote.jobs import job_status

    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"backend": "slurm", "job_id": "1000", "nodes": 2, "partition": "gpu"}))
    status = job_status(JobStatus(state="running", run_dir=run, message="Training."))
    assert status.message == "Training. On Slurm (job 1000, 2 node(s) of gpu)"


def test_a_node_that_cannot_see_the_run_folder_says_so(slurm, tmp_path):
    """The batch script's first check: without the run folder's marker on the node, one `error:` line, exit 2."""
    checked = cluster.check_request(cluster.Request(nodes=1, gpus_per_node=0))
    script = tmp_path / "job.sbatch"
    script.write_text(cluster.script(checked, run_dir=tmp_path / "elsewhere", name="x", workdir=tmp_path))
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "127.0.0.1"})
    assert done.returncode == 2
    assert done.stdout.startswith(f"error: the run folder {tmp_path / 'elsewhere'} is not visible on ")


def test_jobs_commands_reach_the_slurm_job_of_a_run(slurm, tmp_path, tiny_bert, cls_csv, capsys):
    """`--detach`, then `finetune jobs status|cancel|follow RUN`: job.json's backend sends each to Slurm."""
    from finetune.cli import main

    run = tmp_path / "run"
    assert main(["train", f"model={tiny_bert}", f"dataset={cls_csv}", f"output_dir={run}", "epochs=1000",
                 "--backend", "slurm", "--gpus-per-node", "0", "--detach", "-q"]) == 0
    assert json.loads(capsys.readouterr().out) == {"run_dir": str(run), "job_id": "1000"}
    assert main(["jobs", "status", str(run)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["job_id"], status["partition"], status["nodes"], status["outcome"]) == ("1000", "debug", 1, None)
    assert status["stage"] in ("PENDING", "RUNNING")
    assert main(["jobs", "cancel", str(run)]) == 0
    assert "cancelled Slurm job 1000" in capsys.readouterr().err
    assert main(["jobs", "follow", str(run), "-q"]) == 130
    assert "The job was cancelled" in capsys.readouterr().err
    assert _jobs(tmp_path / "slurm-state")[0]["state"] == "CANCELLED"
    assert json.loads((run / "job.json").read_text())["outcome"]["status"] == "stopped"


def test_a_requeued_job_that_fails_says_its_own_error(slurm, tmp_path):
    """The outcome is the last start's: a failed start after a preempted one is failed with its own sentence (the
    earlier start's `stopped` record does not make it "stopped"), and names the checkpoint to resume from."""
    from finetune.remote.slurm.run import Follower

    run = tmp_path / "run"
    run.mkdir()
    records = [{"event": "start"}, {"event": "checkpoint", "step": 3}, {"event": "stopped", "step": 3},
               {"event": "start"}, {"event": "error", "message": "The data changed.", "exit_code": 2}]
    (run / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "slurm-state" / "jobs").mkdir(parents=True)
    (tmp_path / "slurm-state" / "jobs" / "1000.json").write_text(json.dumps({"id": "1000", "state": "FAILED"}))
    job = {"backend": "slurm", "job_id": "1000", "nodes": 1, "gpus_per_node": 0, "partition": "debug",
           "events_before": 0, "run_dir": str(run)}
    result = Follower(job, lambda r: None, lambda line: None).run()
    assert (result.status, result.exit_code, result.message) == ("failed", 2, "The data changed.")
    (tmp_path / "slurm-state" / "jobs" / "1000.json").write_text(json.dumps({"id": "1000", "state": "CANCELLED"}))
    (run / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:4]))
    result = Follower(job, lambda r: None, lambda line: None).run()
    assert result.status == "stopped" and "continue from its checkpoint (step 3)" in result.message
