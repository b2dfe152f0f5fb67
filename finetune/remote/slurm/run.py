"""A run on Slurm: checked, its folder prepared and its batch script submitted, then followed to the end.

The run folder is on a filesystem that every node shares, so the run writes its own `events.jsonl`, checkpoints and
model there: following a job is reading that file as it grows (for the progress bar) and the job's log (for its
other lines), while `squeue`/`sacct` say whether it still runs. A preempted or requeued job starts the batch script
again, which resumes from the newest checkpoint; following goes on until Slurm reports an end. `job.json` records
the job (`backend: slurm`), and, once it ended, how (`finetune.remote.mirror.outcome`, as for Hugging Face Jobs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from finetune.config.schema import Config
from finetune.errors import EXIT_STOPPED, RunDirError
from finetune.remote.mirror import Outcome, follow_cancelling, from_record, outcome
from finetune.remote.slurm import cluster
from finetune.run.events import ProgressBar, parse_log_line, read_events
from finetune.run.rundir import check_run_dir, default_output_dir, mark_run_dir, write_json, write_text

JOB_FILE = "job.json"
POLL_S = 1.0
# sacct's states → the stages `outcome` reads (Hugging Face Jobs' words).
STAGES = {"COMPLETED": "COMPLETED", "CANCELLED": "CANCELED", "TIMEOUT": "TIMEOUT", "PREEMPTED": "CANCELED"}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def read_job(run_dir: Path) -> dict[str, Any]:
    """The run's job.json (a Slurm job's), with its folder; a `RunDirError` otherwise."""
    path = Path(run_dir) / JOB_FILE
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise RunDirError(f"{path} cannot be read: {str(run_dir)!r} is not a run launched with --backend slurm.") \
            from None
    if values.get("backend") != "slurm":
        raise RunDirError(f"{path} does not describe a Slurm job.")
    return {**values, "run_dir": str(run_dir)}


def write_job(job: dict[str, Any]) -> None:
    """Record the job in its run folder's job.json (atomically)."""
    write_json(Path(job["run_dir"]) / JOB_FILE, {k: v for k, v in job.items() if k != "run_dir"})


def resume_command(job: dict[str, Any]) -> str:
    """The command that continues the run as a new job."""
    options = f"--nodes {job['nodes']} --gpus-per-node {job['gpus_per_node']} --partition {job['partition']}"
    return f"finetune train {Path(job['run_dir']) / 'config.yaml'} resume=true --backend slurm {options}"


def train(args: argparse.Namespace, c: Config) -> int:
    """`finetune train CONFIG --backend slurm …`: check, write the batch script, submit, follow."""
    job = submit(args, c)
    if args.detach:
        print(json.dumps({"run_dir": job["run_dir"], "job_id": job["job_id"]}, indent=2))
        return 0
    return follow_to_end(job, quiet=args.quiet)


def submit(args: argparse.Namespace, c: Config) -> dict[str, Any]:
    """Check the request and the plan for its GPUs, prepare the run folder, submit the batch script and record
    the job in job.json; the job, as job.json holds it (with its run folder)."""
    checked = cluster.check_request(cluster.Request.from_args(args))
    run_dir = Path(c.output_dir or default_output_dir()).resolve()
    job_config = c.replace(output_dir=str(run_dir))
    check_run_dir(job_config)
    if checked.hardware.gpu_memory_gb and checked.hardware.gpus_per_node:
        job_config = _planned(job_config, checked)
    mark_run_dir(run_dir)
    write_text(run_dir / cluster.CONFIG, job_config.replace(resume=False).to_yaml())
    name = re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.name)[:40] or "run"
    script_path = run_dir / cluster.SCRIPT
    write_text(script_path, cluster.script(checked, run_dir=run_dir, name=name, workdir=Path.cwd()))
    events_before = len(read_events(run_dir / "events.jsonl"))
    job_id = cluster.submit(script_path)
    r = checked.request
    job = {"backend": "slurm", "job_id": job_id, "partition": checked.partition.name, "nodes": r.nodes,
           "gpus_per_node": r.gpus_per_node, "time": r.time, "time_s": checked.time_s, "script": cluster.SCRIPT,
           "events_before": events_before, "created": time.time(), "outcome": None, "run_dir": str(run_dir)}
    write_job(job)
    _say(f"Slurm job {job_id} submitted to {checked.partition.name}: {r.nodes} node(s) × "
         f"{max(r.gpus_per_node, 1)} process(es)")
    _say(f"run folder: {run_dir} (re-attach with `finetune jobs follow {run_dir}`)")
    return job


def _planned(c: Config, checked: cluster.Checked) -> Config:
    """`c` with one of the partition's GPUs (`--gpu-memory`) as its memory budget, for all of the job's
    processes; refused in one sentence when its plan does not fit there."""
    from finetune.remote.flavors import Flavor
    from finetune.remote.preflight import job_config, plan_for

    hw, partition = checked.hardware, checked.partition
    processes = hw.processes
    # The RAM of all the nodes, so that each process's share is its node's RAM over the node's GPUs.
    ram = f"{hw.ram_gb * hw.nodes:g} GB" if hw.ram_gb else ""
    flavor = Flavor(name=f"partition {partition.name}", pretty_name=partition.name, gpus=processes,
                    gpu_model=(partition.gpu_type or "GPU").upper(),
                    gpu_memory_gb=float(hw.gpu_memory_gb or 0) * processes, usd_per_hour=0.0, ram=ram)
    planned = job_config(c, flavor)
    plan_for(planned, flavor, service="Slurm",
             larger="choose a partition with more {more} (`sinfo` lists them), or give --gpu-memory its GPUs' GB")
    return planned


class Follower:
    """Reads a job's run folder while Slurm runs it: new records of `events.jsonl` to `on_record`, new lines of
    its log to `on_log`; re-runnable after an interrupt (nothing is handled twice)."""

    def __init__(self, job: dict[str, Any], on_record: Any, on_log: Any):
        self.job, self.on_record, self.on_log = job, on_record, on_log
        self.run_dir = Path(job["run_dir"])
        self.records_seen = int(job.get("events_before") or 0)
        self.log_offset = 0
        self.last_error_line: str | None = None

    def _read(self) -> None:
        records = read_events(self.run_dir / "events.jsonl")
        if len(records) < self.records_seen:  # a requeued start before any checkpoint began the file again
            self.records_seen = min(len(records), int(self.job.get("events_before") or 0))
        for record in records[self.records_seen:]:
            self.on_record(record)
        self.records_seen = max(self.records_seen, len(records))
        log = self.run_dir / cluster.LOG
        if log.is_file():
            with log.open("rb") as f:
                f.seek(self.log_offset)
                data = f.read()
            complete = data[:data.rfind(b"\n") + 1]
            self.log_offset += len(complete)
            for line in complete.decode("utf-8", "replace").splitlines():
                if parse_log_line(line) is None:
                    if line.startswith("error:"):
                        self.last_error_line = line
                    self.on_log(line)

    def run(self) -> Outcome:
        """Follow until Slurm reports the job's end; record the outcome in job.json and return it."""
        while True:
            self._read()
            stage = cluster.state(self.job["job_id"])
            if stage not in cluster.ACTIVE:
                break
            time.sleep(POLL_S)
        self._read()
        records = read_events(self.run_dir / "events.jsonl")[int(self.job.get("events_before") or 0):]
        # A requeued job's end is its last start's (a preempted start's `stopped` record is not this end's), but
        # the checkpoints of every start are there to resume from.
        last = max((i for i, r in enumerate(records) if r.get("event") == "start"), default=0)
        records = [r for r in records[:last] if r.get("event") == "checkpoint"] + records[last:]
        result = outcome(STAGES.get(stage, stage), "timed out" if stage == "TIMEOUT" else None, records,
                         running_s=None, timeout_s=int(self.job.get("time_s") or 0),
                         resume_command=resume_command(self.job), last_error_line=self.last_error_line)
        self.job = {**self.job, "outcome": result.to_dict()}
        write_job(self.job)
        return result


def follow_to_end(job: dict[str, Any], *, quiet: bool = False) -> int:
    """Follow the job until it ends; Ctrl-C (or SIGTERM) cancels it (`scancel`) and waits for its end."""
    bar = ProgressBar(disable=quiet)

    def on_record(record: dict[str, Any]) -> None:
        event = from_record(record)
        if event is not None:
            bar(event)

    follower = Follower(job, on_record, bar.say)  # the job's log lines above the bar
    result = follow_cancelling(follower.run, lambda: cluster.cancel(job["job_id"]), bar,
                               f"\nCancelling Slurm job {job['job_id']} (its checkpoints stay in the run folder). "
                               "Ctrl-C again leaves without waiting for it to end.")
    if result is None:
        return EXIT_STOPPED
    if result.status != "done":
        _say(("error: " if result.status == "failed" else "") + result.message)
        return result.exit_code
    done = next((r for r in reversed(read_events(Path(job["run_dir"]) / "events.jsonl"))
                 if r.get("event") == "done"), {})
    print(json.dumps({"run_dir": job["run_dir"], **(done.get("metrics") or {})}, indent=2))
    return 0
