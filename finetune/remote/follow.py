"""Following a job to its end: its logs streamed, its events mirrored into the local run folder, and the outcome
recorded in job.json (`Follower`), re-runnable after an interrupt and from any process (a re-attach)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.errors import HTTPError as HubNetworkError

from finetune.remote.hfjobs import JobError, api_for, cancel, hub_token, refusal, status
from finetune.remote.jobfile import JobHandle, write_handle
from finetune.remote.mirror import Mirror, Outcome, outcome
from finetune.run.events import parse_log_line


def resume_command(handle: JobHandle) -> str:
    """The command that continues the run on a new job."""
    return f"finetune train {handle.run_dir / 'config.yaml'} resume=true --backend hf-jobs --flavor {handle.flavor}"


class Follower:
    """Streams a job's logs until it ends: each record into the local events.jsonl (`Mirror`) and to `on_record`,
    every other line to `on_log`. `run` may be called again after it was interrupted (Ctrl-C): records and lines
    already handled are not handled twice."""

    RETRIES = 5

    def __init__(self, handle: JobHandle, *, token: str | None = None,
                 on_record: Callable[[dict[str, Any]], None] | None = None,
                 on_log: Callable[[str], None] | None = None):
        self.handle, self.token = handle, token
        self.on_record, self.on_log = on_record or (lambda _: None), on_log or (lambda _: None)
        self.mirror = Mirror(handle.run_dir, handle.job_run_dir, handle.events_before)
        self.lines_shown = 0
        self.last_error_line: str | None = None
        self.guard: Outcome | None = None  # set when the job had to be cancelled (it trains without a GPU)

    def _line(self, line: str, index: int) -> None:
        if parse_log_line(line) is None:
            if index >= self.lines_shown:
                self.lines_shown += 1
                if line.startswith("error:"):
                    self.last_error_line = line
                self.on_log(line)
            return
        record = self.mirror.feed(line)
        if record is None:
            return
        if record["event"] == "start" and self.handle.gpus and not str(record.get("device", "")).startswith("cuda"):
            self._refuse(str(record.get("device")))
        self.on_record(record)

    def _refuse(self, device: str) -> None:
        """The image's torch has no CUDA: the job would bill a GPU it does not use."""
        cancel(self.handle, token=self.token)
        self.guard = Outcome("failed", 2, f"The job trained on {device}, not on the {self.handle.flavor} GPU: the "
                               f"image {self.handle.image} has torch without CUDA, so the job was cancelled; build "
                               "the Space with the variable TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 "
                               "(docs/jobs.md).", "CANCELED")

    def run(self) -> Outcome:
        """Follow to the end; record the outcome in job.json and return it."""
        token = hub_token(self.token)
        api, failures = api_for(self.handle), 0
        while True:
            self.mirror.restart()
            plain = 0
            try:
                for line in api.fetch_job_logs(job_id=self.handle.job_id, namespace=self.handle.namespace,
                                               follow=True, token=token):
                    is_plain = parse_log_line(line) is None
                    self._line(line, plain)
                    plain += is_plain
                state = status(self.handle, token=token)
            except HfHubHTTPError as e:
                raise refusal(e, f"follow job {self.handle.job_id}", token) from None
            except (HubNetworkError, OSError) as e:
                failures += 1
                if failures > self.RETRIES:
                    raise JobError(f"Lost the job's logs ({type(e).__name__}); it goes on: follow it again with "
                                   f"`finetune jobs follow {self.handle.run_dir}`.") from None
                time.sleep(min(2 ** failures, 30))
                continue
            if state.finished:
                break
            time.sleep(2)  # the stream ended before the job: open it again
        result = self.guard or outcome(state.stage, state.message, self.mirror.job_records(),
                                         running_s=state.running_s, timeout_s=self.handle.timeout_s,
                                         resume_command=resume_command(self.handle),
                                         last_error_line=self.last_error_line)
        write_handle(self.handle, outcome=result.to_dict())
        return result


def follow(handle: JobHandle, *, token: str | None = None, on_record: Callable[[dict[str, Any]], None] | None = None,
           on_log: Callable[[str], None] | None = None) -> Outcome:
    """Follow a job to its end (see `Follower`)."""
    return Follower(handle, token=token, on_record=on_record, on_log=on_log).run()
