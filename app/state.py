"""What every tab shares: one small object, handed to each tab's handlers (as LLaMA-Factory hands its engine to
each `create_*_tab`), instead of one controller that does everything."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from app.client import JobClient
from app.door import persist
from app.door.access import Access
from app.door.limits import LOCAL, Limits
from app.door.policy import RequestPolicy
from app.downloads import Downloads
from app.local.training import JobManager
from app.remote.jobs import RemoteRuns


@dataclass
class AppState:
    """The request policy (who asks, what they may read), the job client (every child process), the server's limits,
    the files handed out to download, and what a run on Hugging Face Jobs needs (whose token, re-attaching)."""

    policy: RequestPolicy
    jobs: JobClient
    limits: Limits = LOCAL
    downloads: Downloads = field(default_factory=Downloads)
    remote: RemoteRuns = field(default_factory=lambda: RemoteRuns(Access()))
    restart_notice: str = ""  # on a Space whose runs a restart would lose: the page says so (app.door.persist)

    @classmethod
    def create(cls, runs_dir: Path, training: JobManager, *, access: Access | None = None,
               samples: tuple[Path, ...] = (), server_limits: Limits = LOCAL) -> AppState:
        """The state of an app serving `runs_dir`, whose training runs `training` starts."""
        access = access or Access()
        return cls(policy=RequestPolicy(access, runs_dir, samples),
                   jobs=JobClient(training, runs_dir=runs_dir, access=access, server_limits=server_limits),
                   limits=server_limits, remote=RemoteRuns(access),
                   restart_notice=persist.restart_notice(runs_dir, os.environ))

    @property
    def access(self) -> Access:
        """The access policy (who may train and push, which files a run may read)."""
        return self.policy.access

    @property
    def runs_dir(self) -> Path:
        """The runs folder (users' runs and uploads under it)."""
        return self.policy.runs_dir
