"""The commands of training on Hugging Face Jobs: `finetune train … --backend hf-jobs` and `finetune jobs …`.

What the terminal shows: the plan and time limit before anything is sent, the job's URL, its logs (on stderr) and a
progress bar fed by its events; at the end the metrics as JSON (as a local run prints them) once the model is
fetched. The exit code is the run's: 0 done, 130 stopped or cancelled (Ctrl-C cancels the job), the run's own code
when it failed, 3 when only the fetch failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import huggingface_hub as hf
from huggingface_hub import HfApi
from huggingface_hub import constants as hf_constants

from finetune.config.schema import Config
from finetune.errors import EXIT_STOPPED
from finetune.remote import fetch as fetching
from finetune.remote import flavors, hfjobs
from finetune.remote.follow import Follower
from finetune.remote.jobfile import JOB_FILE, JobHandle
from finetune.remote.mirror import follow_cancelling, from_record
from finetune.remote.timelimit import parse_duration
from finetune.run.events import ProgressBar


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def launch_remote(args: argparse.Namespace, c: Config) -> JobHandle:
    """Check `c` for the options' flavor, upload its inputs and start the job; say where it runs."""
    options = hfjobs.JobOptions(flavor=args.flavor, image=args.image, namespace=args.namespace, bucket=args.bucket,
                                inputs_repo=args.inputs_repo,
                                timeout_s=parse_duration(args.timeout) if args.timeout else None)
    handle = hfjobs.launch(c, options, space_id=os.environ.get("SPACE_ID"), say=_say)
    _say(f"job {handle.job_id} started: {handle.url}")
    _say(f"run folder: {handle.run_dir} (re-attach with `finetune jobs follow {handle.run_dir}`)")
    return handle


def train_remote(args: argparse.Namespace, c: Config) -> int:
    """`finetune train CONFIG --backend hf-jobs --flavor F …`: check, launch, then follow to the end."""
    handle = launch_remote(args, c)
    if args.detach:
        print(json.dumps({"run_dir": str(handle.run_dir), "job_id": handle.job_id, "url": handle.url}, indent=2))
        return 0
    return follow_to_end(handle, quiet=args.quiet, fetch=not args.no_fetch)


def follow_to_end(handle: JobHandle, *, quiet: bool = False, fetch: bool = True) -> int:
    """Stream the job until it ends, mirror its events, cancel it on Ctrl-C; fetch the model when it is done."""
    bar = ProgressBar(disable=quiet)

    def on_record(record: dict[str, Any]) -> None:
        event = from_record(record)
        if event is not None:
            bar(event)

    follower = Follower(handle, on_record=on_record, on_log=bar.say)  # the job's log lines above the bar
    result = follow_cancelling(follower.run, lambda: hfjobs.cancel(handle), bar,
                               "\nCancelling the job (billing stops; its checkpoints stay in the bucket). Ctrl-C "
                               "again leaves without waiting for it to end.")
    if result is None:
        return EXIT_STOPPED
    if result.status != "done":
        _say(("error: " if result.status == "failed" else "") + result.message)
        return result.exit_code
    done = next((r for r in reversed(follower.mirror.job_records()) if r.get("event") == "done"), {})
    if fetch:
        files = fetching.fetch(handle)
        _say(f"fetched {len(files)} file(s) from hf://buckets/{handle.bucket}/{handle.remote_dir} into "
             f"{handle.run_dir}")
    else:
        _say(f"the model stays in hf://buckets/{handle.bucket}/{handle.remote_dir}: `finetune jobs fetch "
             f"{handle.run_dir}` copies it here")
    print(json.dumps({"run_dir": str(handle.run_dir), **(done.get("metrics") or {})}, indent=2))
    return 0


def jobs_command(args: argparse.Namespace) -> int:
    """`finetune jobs follow|status|cancel|fetch|flavors`: the run's backend (its job.json) does the work."""
    from finetune.remote import backend

    if args.jobs_command == "flavors":
        token = hf.get_token()
        table = None if hf_constants.is_offline_mode() else flavors.live_table(HfApi(), token or False)
        print((table or flavors.BUILT_IN).render())
        return 0
    # A folder without job.json gets Hugging Face Jobs' sentence about it, as before there were other backends.
    runner = backend.of_run(args.run_dir) if (Path(args.run_dir) / JOB_FILE).is_file() else backend.get("hf-jobs")
    if args.jobs_command == "follow":
        return runner.follow(Path(args.run_dir), quiet=args.quiet, fetch=not args.no_fetch)
    if args.jobs_command == "status":
        print(json.dumps(runner.status(Path(args.run_dir)), indent=2))
        return 0
    if args.jobs_command == "cancel":
        _say(runner.cancel(Path(args.run_dir)))
        return 0
    files = runner.fetch(Path(args.run_dir))
    print(json.dumps({"run_dir": str(args.run_dir), "files": files}, indent=2))
    return 0
