"""Hugging Face Jobs as a `Backend` (finetune.remote.backend): the options of `--backend hf-jobs`, and the life of
a run there, through `hfjobs` (check, launch, status, cancel), `follow` and `fetch`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.remote.backend import FormField, Hardware

if TYPE_CHECKING:
    from finetune.remote.mirror import Outcome


class HFJobs:
    """Hugging Face Jobs: one machine of a GPU flavor, billed by the minute; the run folder in a bucket."""

    name = "hf-jobs"
    title = "Hugging Face Jobs"
    options = ("flavor", "image", "timeout", "namespace", "bucket", "inputs_repo")
    form: tuple[FormField, ...] = ()  # the flavor is the Run on entry itself; the app adds whose job it is
    on_host = False  # billed to the user's own Hugging Face account
    sweeps = True

    def add_arguments(self, g: argparse._ArgumentGroup) -> None:
        """`--flavor`, `--image`, `--timeout`, `--namespace`, `--bucket`, `--inputs-repo`."""
        g.add_argument("--flavor", help="hf-jobs: the hardware, e.g. a10g-large (`finetune jobs flavors` lists them "
                       "with their GPU memory and price); its GPU memory is the plan's budget.")
        g.add_argument("--image", help="hf-jobs: the image to run, e.g. hf.co/spaces/USER/SPACE (a copy of this "
                       "project's Space built for a GPU); default inside a Space: the Space's own.")
        g.add_argument("--timeout", help="hf-jobs: the job's time limit (90m, 2h, 1h30m); default: the plan's "
                       "estimate with a margin. The run is asked to stop with a checkpoint a little before it.")
        g.add_argument("--namespace", help="hf-jobs: the user or organization the job runs under and is billed to "
                       "(default: the token's user).")
        g.add_argument("--bucket", help="hf-jobs: the private bucket that holds the run folders (default: "
                       "NAMESPACE/finetune-runs).")
        g.add_argument("--inputs-repo", help="hf-jobs: the private dataset repository the config and local files "
                       "are uploaded to (default: NAMESPACE/finetune-inputs).")

    def hardware(self, args: argparse.Namespace) -> Hardware:
        """The flavor's GPUs on one machine (the built-in table; the Hub's own for a flavor it does not know)."""
        from finetune.errors import ConfigError
        from finetune.remote import flavors

        if not args.flavor:
            raise ConfigError(["--backend hf-jobs needs --flavor: the GPU to train on (`finetune jobs flavors` lists "
                               "them with their memory and price)."])
        flavor = flavors.find(args.flavor, flavors.BUILT_IN)
        ram = flavor.ram_bytes
        return Hardware(1, flavor.gpus, flavor.budget_gib or None, ram / 1e9 if ram else None)

    def train(self, args: argparse.Namespace, config: Any) -> int:
        """Check, upload, start the job and follow it (`finetune.remote.cli.train_remote`)."""
        from finetune.remote.cli import train_remote

        return train_remote(args, config)

    def launch(self, args: argparse.Namespace, config: Any) -> Path:
        """Check, upload and start the job; its run folder (`finetune.remote.cli.launch_remote`)."""
        from finetune.remote.cli import launch_remote

        return launch_remote(args, config).run_dir

    def wait(self, run_dir: Path, *, fetch: bool) -> Outcome:
        """Follow the job quietly to its end (its events mirrored), then fetch a finished run's model; a failed
        fetch is said in the outcome's sentence (the model stays in the bucket)."""
        import dataclasses

        from finetune.errors import describe
        from finetune.remote import fetch as fetching
        from finetune.remote import hfjobs
        from finetune.remote.follow import follow

        handle = hfjobs.attach(run_dir)
        result = follow(handle)
        if result.status == "done" and fetch:
            try:
                fetching.fetch(handle)
            except fetching.FetchError as e:
                return dataclasses.replace(result, message=f"{result.message} {describe(e)}")
        return result

    def follow(self, run_dir: Path, *, quiet: bool, fetch: bool) -> int:
        """Stream the job's logs, mirror its events; fetch the model when it is done."""
        from finetune.remote import hfjobs
        from finetune.remote.cli import follow_to_end

        return follow_to_end(hfjobs.attach(run_dir), quiet=quiet, fetch=fetch)

    def status(self, run_dir: Path) -> dict[str, Any]:
        """The job's stage on the Hub, its URL and how the run ended."""
        from finetune.remote import hfjobs
        from finetune.remote.jobfile import recorded

        handle = hfjobs.attach(run_dir)
        state = hfjobs.status(handle)
        return {"job_id": handle.job_id, "url": handle.url, "flavor": handle.flavor, "stage": state.stage,
                "message": state.message, "running_s": state.running_s,
                "outcome": recorded(handle.run_dir, "outcome")}

    def cancel(self, run_dir: Path) -> str:
        """Cancel the job on the Hub (its checkpoints stay in the bucket)."""
        from finetune.remote import hfjobs

        handle = hfjobs.attach(run_dir)
        hfjobs.cancel(handle)
        return f"cancelled job {handle.job_id} ({handle.url})"

    def fetch(self, run_dir: Path) -> list[str]:
        """Copy the run from the bucket (all but its checkpoints)."""
        from finetune.remote import fetch as fetching
        from finetune.remote import hfjobs

        return fetching.fetch(hfjobs.attach(run_dir))

    def describe(self, job: dict[str, Any]) -> str:
        """Where a run's job runs, for the app's Run panel."""
        return f"On Hugging Face Jobs ({job.get('flavor')}): {job.get('url')}"

    def run_on(self) -> list[tuple[str, str]]:
        """Every flavor with a GPU, with its GPUs, their memory and its price (the built-in table)."""
        from finetune.remote import flavors

        return [(f"Hugging Face Jobs: {f.name} — {f.gpus} × {f.gpu_model}, {f.gpu_memory_gb:g} GB GPU memory, "
                 f"${f.usd_per_hour:.2f}/h", f.name) for f in flavors.BUILT_IN.flavors if f.gpus]

    def arguments(self, value: str, fields: dict[str, Any]) -> list[str]:
        """`--flavor VALUE` (the image and the namespace are the app's: whose job it is)."""
        return ["--flavor", value]


HF_JOBS = HFJobs()
