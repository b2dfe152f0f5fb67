"""The one client the tabs ask for child processes: the training run, the export and the planner, and whether this
server has room for another job now.

One job at a time on a shared server: no run starts (or resumes) while an export runs or another Start is being
checked, and no export while a run trains or a Start is being checked (its plan can take a minute); locally the one
user may export one run while another trains. A plan measures no probe while a run trains or an export runs. A
refusal names the run in progress only to its owner, and by its place in the runs folder (`runs/<user>/<run>`),
never by a path of the server. Before a run starts the server's clean-up runs, and its limits and free disk are
checked. A Start (or Resume) while a run trains goes into the training manager's queue, up to the server's limit of
runs one user may have waiting (`limits.Limits.max_queued`); a user sees their own queued runs with their positions,
and nothing of anyone else's. A run elsewhere (`app.remote`: Hugging Face Jobs, Slurm) is started here too: this
module sits above both `app.local` and `app.remote`, which imports the local training manager to follow its runs.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any

from app.door import cleanup, limits
from app.door.access import Access
from app.local.export import EVAL_LOG, ExportChild, ExportJobs
from app.local.planner import Planner
from app.local.queue import Queued, remove_unstarted
from app.local.training import JobBusy, JobManager, JobStatus
from app.remote.jobs import JobLaunch, job_status
from app.report import shown_path
from finetune.config.schema import Config


class JobClient:
    """The training job manager, the export child and the planner of one app, over its runs folder."""

    def __init__(self, training: JobManager, *, runs_dir: Path, access: Access | None = None,
                 server_limits: limits.Limits = limits.LOCAL):
        self.training = training  # a `JobManager` (or a stand-in with its methods, in tests)
        self.runs_dir = runs_dir
        self.access = access or Access()
        self.limits = server_limits
        self.exports = ExportJobs(server_limits.max_run_s)
        self.evaluations = ExportJobs(server_limits.max_run_s, log=EVAL_LOG, busy="An evaluation is in progress on "
                                      "this server: wait for it to finish.")
        self.planner = Planner()
        self._lock = threading.RLock()  # one decision at a time about the server's one job
        self._preparing: int | None = None  # the thread checking a Start (`preparing`)

    # --- the training run
    def status(self) -> JobStatus:
        """The current (or last) run's state, events and messages (a run on Hugging Face Jobs told as one)."""
        return job_status(self.training.status())

    def start(self, config_path: Path, run_dir: Path, owner: str | None, launch: JobLaunch | None = None,
              verb: str = "train") -> int:
        """Start `finetune train CONFIG` now (0) or queue it behind the run in progress (its position, 1: next);
        `JobBusy` (with `run_refusal`'s sentence) while another job is in the way, or the owner's queue is full. A
        run on Hugging Face Jobs (`launch`'s options and environment) starts now or not at all: its token lives
        only in the launcher's environment, never in the queue's file."""
        with self._lock:
            if other := self.run_refusal(owner):
                raise JobBusy(other)
            if launch is not None:
                if self.training.queue.entries():
                    raise JobBusy("Runs are waiting in this app's queue, and a run elsewhere (Run on) is not queued "
                                  "(a Hugging Face Jobs token is kept nowhere): start it when the queue is empty.")
                self.training.start(config_path, run_dir, launch.args, owner=owner, env=launch.env)
                return 0
            return self.training.submit(config_path, run_dir, owner=owner, verb=verb)  # "sweep": `finetune sweep`

    def taken(self, run_dir: Path) -> str:
        """Why no Start may write into `run_dir` now (it trains, or waits in the queue); "" when it may."""
        return self.training.taken(run_dir)

    def resume(self, run_dir: Path, owner: str | None) -> int:
        """Continue a stopped or failed run from its newest checkpoint, now (0) or once the runs before it end (its
        position in the queue); `JobBusy` while another job is in the way."""
        with self._lock:
            if other := self.run_refusal(owner):
                raise JobBusy(other)
            return self.training.submit(run_dir / "config.yaml", run_dir, ["resume=true"], owner=owner)

    # --- the queue
    def queued(self, user: str | None) -> list[tuple[Queued, int]]:
        """`user`'s queued runs with their positions (1: next to start); everyone's, locally."""
        return [(q, i) for i, q in enumerate(self.training.queue.entries(), 1) if self.access.owns(user, q.owner)]

    def cancel(self, run_dir: Path, user: str | None) -> str:
        """Take `user`'s queued run `run_dir` off the queue, and its folder when nothing had run in it: what was
        done, in a sentence ("" when it is not one of their queued runs, or it has started)."""
        with self._lock:
            if not any(q.run_dir == run_dir for q, _ in self.queued(user)) or self.training.cancel(run_dir) is None:
                return ""
        shown = shown_path(run_dir, self.runs_dir, self.access.shared)
        if remove_unstarted(run_dir):
            return f"Cancelled the queued run `{shown}`; nothing had run, so its folder is removed."
        return f"Cancelled the queued run `{shown}`; its folder is kept."

    def queue_refusal(self, user: str | None) -> str:
        """Why `user` may queue no more runs (the server's limit of runs waiting per user); "" when they may."""
        cap = self.limits.max_queued
        if cap is None or len(self.queued(user)) < cap:
            return ""
        runs = f"{cap} run{'s' if cap != 1 else ''}"
        return (f"You already have {runs} waiting in the queue, this server's limit: wait until one of them has "
                "started, or cancel one, before queueing another.")

    def stop(self) -> str:
        """Stop the run after its optimizer step (a second call kills it); what happened, in a sentence."""
        return self.training.stop()

    # --- room for another job
    @contextlib.contextmanager
    def preparing(self, user: str | None) -> Iterator[None]:
        """Hold the server's one job while a Start of `user` is checked (its data, its plan) and started: an export
        or another Start asked for meanwhile is refused. `JobBusy` when another job is in the way now."""
        with self._lock:
            if other := self.run_refusal(user):
                raise JobBusy(other)
            self._preparing = threading.get_ident()
        try:
            yield
        finally:
            with self._lock:
                self._preparing = None

    def _someone_preparing(self) -> bool:
        return self._preparing is not None and self._preparing != threading.get_ident()

    def run_refusal(self, user: str | None = None) -> str:
        """Why no run may start (or be queued) now because of another job ("" when it may): a run in progress
        queues it, up to the server's limit of queued runs."""
        if self.status().active or self.training.queue.entries():
            return self.queue_refusal(user)
        if self._someone_preparing():
            return "A run is being started on this server: try again when it has started (one job at a time)."
        if self.access.shared and self.exports.running():
            return "An export is in progress on this server: start the run when it is done (one job at a time)."
        return ""

    def export_refusal(self) -> str:
        """Why no export may start now because of another job ("" when it may)."""
        # A queued run is about to start (between the end of one run and the start of the next).
        if self.access.shared and (self.status().active or self.training.queue.entries()):
            return "A run is training on this server: export when it is done (one job at a time)."
        if self.access.shared and self._someone_preparing():
            return "A run is being started on this server: export when it is done (one job at a time)."
        return ""

    def server_refusal(self, config: Config | None) -> str:
        """Why this server will not start `config` (its limits, its disk; None: a resumed run, disk only), after
        deleting what its clean-up policy says is old; "" when it may start."""
        cleanup.tidy(self.runs_dir, self.limits.keep_days, keep=self.status().run_dir,
                     gradio_dir=cleanup.gradio_temp_dir())
        problems = limits.check(config, self.limits) if config is not None else []
        disk = cleanup.disk_problem(self.runs_dir, self.limits.min_free_gb)
        return " ".join([*problems, *([disk] if disk else [])])

    # --- the other children
    def child_env(self) -> dict[str, str]:
        """The environment of an export or planner child: the app's locally, only what it needs when shared."""
        return self.access.child_env(os.environ)

    def start_export(self, command: list[str], run_dir: Path, owner: str | None) -> ExportChild:
        """Start `finetune export` (`command`) of `run_dir` for `owner`; `JobBusy` while another export runs."""
        with self._lock:
            if other := self.export_refusal():
                raise JobBusy(other)
            return self.exports.start(command, run_dir, owner, self.child_env())

    def start_evaluation(self, command: list[str], run_dir: Path, owner: str | None) -> ExportChild:
        """Start `finetune eval RUN --benchmarks …` (`command`) for `owner`, as an export starts; `JobBusy` while
        another evaluation runs (or, on a shared server, another job)."""
        with self._lock:
            if other := self.export_refusal():
                raise JobBusy(other.replace("export when", "evaluate when"))
            return self.evaluations.start(command, run_dir, owner, self.child_env())

    def plan(self, config: Config, key: Hashable, device: str = "here") -> dict[str, Any]:
        """`finetune plan` of `config` for `device`, remembered under `key`; `Unanswered` with the planner's
        sentence."""
        busy = self.status().active or self.exports.running()  # a probe would share the device with that job
        return self.planner.plan(config, key, device=device, training=busy, env=self.child_env())
