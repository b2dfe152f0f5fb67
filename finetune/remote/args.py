"""The command-line options of training elsewhere (`finetune train --backend hf-jobs`, `finetune jobs …`): argparse
only, so that `finetune --help` stays fast; the commands themselves are in `finetune.remote.cli`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from finetune.remote import backend


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    """`finetune train`'s options for where it trains: `--backend`, then each backend's own (docs/jobs.md)."""
    g = p.add_argument_group("training elsewhere (docs/jobs.md)")
    g.add_argument("--backend", choices=backend.names(), default=backend.LOCAL,
                   help="local: this machine (default); hf-jobs: a Hugging Face Job on a GPU flavor, billed by the "
                   "minute to your account, its run folder in your bucket and mirrored into output_dir here; slurm: "
                   "a Slurm job over one or more nodes that see output_dir on a shared filesystem.")
    g.add_argument("--detach", action="store_true", help="start the job and return; follow it later with "
                   "`finetune jobs follow RUN`.")
    g.add_argument("--no-fetch", action="store_true", help="hf-jobs: leave the finished model in the bucket "
                   "(`finetune jobs fetch RUN` copies it later).")
    for b in backend.every():
        b.add_arguments(p.add_argument_group(f"--backend {b.name}: {b.title}"))


def add_jobs_parser(sub: Any, func: Callable[[argparse.Namespace], int]) -> None:
    """`finetune jobs follow|status|cancel|fetch|flavors`."""
    p = sub.add_parser("jobs", help="Runs on Hugging Face Jobs or Slurm: follow, status, cancel, fetch; the flavors.",
                       description="Act on the job of a run folder made by `finetune train … --backend hf-jobs|slurm` "
                       "(its job.json names the backend), from any machine that reaches it.")
    jobs = p.add_subparsers(dest="jobs_command", required=True)
    q = jobs.add_parser("follow", help="Re-attach: stream the job's logs and mirror its events into RUN until it "
                        "ends; exit as the run did. Ctrl-C cancels the job.")
    q.add_argument("run_dir", help="The run folder (it holds job.json).")
    q.add_argument("-q", "--quiet", action="store_true", help="No progress bar.")
    q.add_argument("--no-fetch", action="store_true", help="Leave the finished model in the bucket.")
    for name, words in (("status", "Print the job's stage, its URL and how the run ended (JSON)."),
                        ("cancel", "Cancel the job (its checkpoints stay in the bucket; resume continues them)."),
                        ("fetch", "Copy the finished run (model, metrics, config) from the bucket into RUN.")):
        q = jobs.add_parser(name, help=words)
        q.add_argument("run_dir", help="The run folder (it holds job.json).")
    jobs.add_parser("flavors", help="The hardware flavors: GPUs, GPU memory, the plan's budget, price per hour.")
    p.set_defaults(func=func)
