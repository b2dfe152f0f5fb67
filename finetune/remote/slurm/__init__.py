"""Slurm as a backend of `finetune train` (`--backend slurm`): one job over `--nodes` machines of a partition,
`accelerate launch` on each (through `srun`), the run folder on a filesystem that every node shares.

This module is the light part (its options, for `finetune --help`); `cluster` talks to Slurm's commands (`sinfo`,
`sbatch`, `squeue`, `sacct`, `scancel`) and writes the batch script, `run` launches and follows a run.
User guide: docs/jobs.md.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.remote.backend import FormField, Hardware

if TYPE_CHECKING:
    from finetune.remote.mirror import Outcome


class Slurm:
    """A Slurm cluster, reached through its commands on this machine's PATH (a login node)."""

    name = "slurm"
    title = "Slurm"
    options = ("nodes", "gpus_per_node", "partition", "time", "gpu_memory")
    form = (FormField("nodes", "Nodes", int, "Machines to train on (empty: 1)."),
            FormField("gpus_per_node", "GPUs per node", int, "One process each (empty: 1; 0 trains on CPU)."),
            FormField("partition", "Partition", str, "Empty: the cluster's default (`sinfo` lists them)."),
            FormField("time", "Time limit", str, "As Slurm writes it (4:00:00, 90): a checkpoint is saved before "
                      "it and the requeued job resumes from it."))
    on_host = True  # the jobs run on this machine's Slurm account
    sweeps = True

    def add_arguments(self, g: argparse._ArgumentGroup) -> None:
        """`--nodes`, `--gpus-per-node`, `--partition`, `--time`, `--gpu-memory`."""
        g.add_argument("--nodes", type=int, help="slurm: the machines to train on (default 1); one `accelerate "
                       "launch` on each, the main process address from the first.")
        g.add_argument("--gpus-per-node", type=int, help="slurm: the GPUs of each node to use, one process each "
                       "(default 1; 0 trains on CPU, one process per node).")
        g.add_argument("--partition", help="slurm: the partition to submit to (default: the cluster's default; "
                       "`sinfo` lists them).")
        g.add_argument("--time", help="slurm: the job's time limit as Slurm writes it (4:00:00, 90, 1-00:00:00); "
                       "the run is asked to save a checkpoint and stop a little before it, and a requeued job "
                       "resumes from it.")
        g.add_argument("--gpu-memory", type=float, help="slurm: GB of memory of one of the partition's GPUs: the "
                       "plan's budget, checked before the job is submitted (default: what `sinfo` says, a node "
                       "feature such as h100_80gb or the GPU type's size).")

    def hardware(self, args: argparse.Namespace) -> Hardware:
        """The nodes and GPUs asked for, checked against the partition `sinfo` describes."""
        from finetune.remote.slurm import cluster

        return cluster.check_request(cluster.Request.from_args(args)).hardware

    def train(self, args: argparse.Namespace, config: Any) -> int:
        """Check, write the batch script, submit it and follow the job (Ctrl-C cancels it)."""
        from finetune.remote.slurm import run

        return run.train(args, config)

    def launch(self, args: argparse.Namespace, config: Any) -> Path:
        """Check, write the batch script and submit it; the run folder."""
        from finetune.remote.slurm import run

        return Path(run.submit(args, config)["run_dir"])

    def wait(self, run_dir: Path, *, fetch: bool) -> Outcome:
        """Follow the job quietly until Slurm reports its end (the run writes its events into the shared folder
        itself: nothing to fetch)."""
        from finetune.remote.slurm import run

        return run.Follower(run.read_job(run_dir), lambda record: None, lambda line: None).run()

    def follow(self, run_dir: Path, *, quiet: bool, fetch: bool) -> int:
        """Follow the run's job until it ends (the run folder is shared: nothing to fetch)."""
        from finetune.remote.slurm import run

        return run.follow_to_end(run.read_job(run_dir), quiet=quiet)

    def status(self, run_dir: Path) -> dict[str, Any]:
        """The job's state in Slurm and how the run ended."""
        from finetune.remote.slurm import cluster, run

        job = run.read_job(run_dir)
        return {"job_id": job["job_id"], "partition": job.get("partition"), "nodes": job.get("nodes"),
                "stage": cluster.state(job["job_id"]), "outcome": job.get("outcome")}

    def cancel(self, run_dir: Path) -> str:
        """`scancel` the run's job."""
        from finetune.remote.slurm import cluster, run

        job = run.read_job(run_dir)
        cluster.cancel(job["job_id"])
        return f"cancelled Slurm job {job['job_id']}"

    def fetch(self, run_dir: Path) -> list[str]:
        """Nothing to copy: the nodes wrote into the run folder itself (a shared filesystem)."""
        return []

    def describe(self, job: dict[str, Any]) -> str:
        """Where a run's job runs, for the app's Run panel."""
        return f"On Slurm (job {job.get('job_id')}, {job.get('nodes')} node(s) of {job.get('partition') or 'default'})"

    def run_on(self) -> list[tuple[str, str]]:
        """One entry while `sbatch` is on this machine's PATH (a login node), none otherwise."""
        if shutil.which("sbatch") is None:
            return []
        return [("Slurm: a job on this machine's cluster (sbatch), on the nodes and GPUs below", self.name)]

    def arguments(self, value: str, fields: dict[str, Any]) -> list[str]:
        """Its form's fields as options: `--nodes N --gpus-per-node G --partition P --time T`, the empty left out."""
        return [a for f in self.form for a in f.argument(fields.get(f.option))]


SLURM = Slurm()
