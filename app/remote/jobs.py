"""What a run on Hugging Face Jobs needs from the app, and what the app shows of it.

A Start with a flavor runs `finetune train CONFIG --backend hf-jobs --flavor F --image I [--namespace USER] -q` as
the run's child process, exactly as a local run is `finetune train CONFIG -q`: the child checks, uploads, starts the
job and follows it, mirroring its events into the run folder, so the Run panel, Stop (SIGINT: the child cancels the
job) and the Runs tab work as they do for a local run. Whose job it is:

- On a Space, the signed-in user's: their own OAuth token (the Space asks for the `jobs` scope) goes to the child
  in its environment (`HF_TOKEN`, never in its arguments, its log or a file), which passes it to the job only as
  its secret; the job runs in the user's namespace and is billed to them. Without a token, Jobs is refused: a
  visitor never spends the Space owner's credits, and the owner's own `HF_TOKEN` never reaches a child.
- Locally, the one user's (their `HF_TOKEN` or `hf auth login`), as on the command line.
- On any other shared server (accounts, `--no-auth`), nobody's: a job would be billed to whoever runs the server.

A backend that runs on this machine's own account (`on_host`: Slurm, through the cluster this machine logs in to)
is the app's owner's: offered locally, never on a Space (its visitors would run commands on the host's cluster),
and on a shared server only when its owner lists it in `FINETUNE_BACKENDS` (e.g. `FINETUNE_BACKENDS=slurm`). Its
child is a local run's (`finetune train … --backend NAME …` in the app's environment); Stop, re-attaching and the
Run panel work as for Jobs, through the backend job.json names.

A launcher that went away (the app restarted) is replaced by `finetune jobs follow RUN -q`, once per app process,
when the run's owner next asks (a page load or the poll, the API's status) with a token to follow it with.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.door.access import Access, AccessError
from app.local.training import JobBusy, JobManager, JobStatus
from app.remote.choice import backend_of, flavor_of, launch_arguments, run_on_choices
from finetune.errors import FinetuneError
from finetune.remote import backend
from finetune.remote.backend import Backend
from finetune.remote.flavors import Flavor
from finetune.remote.jobfile import is_remote_run

BACKENDS_VAR = "FINETUNE_BACKENDS"  # the backends on the host's own account a shared server offers (`slurm`)
IMAGE_VAR = "FINETUNE_JOBS_IMAGE"  # the image a job runs (default on a Space: the Space's own)
JOBS_SCOPE = "jobs"  # the OAuth scope that lets the Space start jobs for its user (README.md's hf_oauth_scopes)
NO_TOKEN = ("Sign in with Hugging Face to run on Hugging Face Jobs: the job runs in your account, with your token, "
            "and is billed to you, never to this Space's owner.")
NO_SCOPE = ("Your sign-in does not let this Space start Hugging Face Jobs for you: sign out and sign in again to "
            "grant it the `jobs` permission.")
NOT_HERE = ("Hugging Face Jobs is not offered on this server: a job would be billed to whoever runs it. Run on this "
            "machine, or use the app on a Hugging Face Space (each user runs jobs with their own account) or on your "
            "own computer.")
NO_IMAGE = (f"Hugging Face Jobs needs an image with finetune in it: set {IMAGE_VAR}=hf.co/spaces/USER/SPACE (a copy "
            "of this project's Space built for a GPU, docs/jobs.md) where the app runs, then start again.")
NO_LOCAL_TOKEN = ("Hugging Face Jobs needs your Hugging Face token (write access and the `jobs` permission): set "
                  "HF_TOKEN or run `hf auth login` where the app runs, then start again.")
OFFLINE = "Hugging Face Jobs needs the network, but HF_HUB_OFFLINE is set where the app runs: unset it to use Jobs."
ON_SPACE = ("{title} is not offered on a Space: its jobs would run on the Space's own machine and account. Run on "
            "this machine, or use the app on the cluster's login node.")
NOT_ENABLED = ("{title} is not offered on this server: its jobs run with the server's own account. Its owner can "
               f"offer it with {BACKENDS_VAR}={{name}}.")


@dataclass(frozen=True)
class JobLaunch:
    """What a run on Jobs adds to `finetune train`: its options, and the child's environment (None: the app's own,
    as for a local run)."""

    args: list[str]
    env: dict[str, str] | None
    title: str = ""  # where it runs, said by Start, for a backend other than Jobs (whose flavor says more)


def _on(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


class RemoteRuns:
    """The Jobs side of one app: who may start a job and with which token, and its re-attaching."""

    def __init__(self, access: Access, env: Mapping[str, str] | None = None):
        self.access = access
        self.env = os.environ if env is None else env  # the app's environment, read when a job starts
        self._reattached: set[Path] = set()  # runs already re-attached to by this app process (one try each)

    def image(self) -> str | None:
        """The image a job runs: `FINETUNE_JOBS_IMAGE`, else on a Space the Space's own."""
        if self.env.get(IMAGE_VAR):
            return self.env[IMAGE_VAR]
        space = self.env.get("SPACE_ID")
        return f"hf.co/spaces/{space}" if space and self.access.mode == "space" else None

    def _token_env(self, request: Any) -> dict[str, str] | None:
        """The child's environment for acting on Jobs for the caller; `AccessError` with why it cannot."""
        if _on(self.env.get("HF_HUB_OFFLINE")):
            raise AccessError(OFFLINE)
        if self.access.mode == "space":
            signed_in = self.access.oauth_token(request)
            if signed_in is None:
                raise AccessError(NO_TOKEN)
            token, scope = signed_in
            if JOBS_SCOPE not in scope.split():
                raise AccessError(NO_SCOPE)
            # Only what a training child gets on a shared server, and the user's token: never the Space's own.
            return {**self.access.child_env(self.env), "HF_TOKEN": token}
        if self.access.shared:
            raise AccessError(NOT_HERE)
        import huggingface_hub as hf

        if not hf.get_token():
            raise AccessError(NO_LOCAL_TOKEN)
        return None

    def prepare(self, flavor: Flavor, user: str | None, request: Any) -> JobLaunch:
        """The options and environment of `finetune train … --backend hf-jobs` for the caller on `flavor`;
        `AccessError` (one sentence) when the caller cannot run a job here."""
        env = self._token_env(request)
        image = self.image()
        if not image:
            raise AccessError(NO_IMAGE)
        args = ["--backend", "hf-jobs", "--flavor", flavor.name, "--image", image]
        if self.access.mode == "space" and user:
            args += ["--namespace", user]  # the signed-in user's own account, whatever else their token may reach
        return JobLaunch(args, env)

    def refusal(self, chosen: Backend) -> str:
        """Why this app does not offer a backend on this machine's own account (`on_host`); "" when it does."""
        if not chosen.on_host:
            return ""
        if self.access.mode == "space":
            return ON_SPACE.format(title=chosen.title)
        enabled = {n.strip() for n in (self.env.get(BACKENDS_VAR) or "").split(",")}
        if self.access.shared and chosen.name not in enabled:
            return NOT_ENABLED.format(title=chosen.title, name=chosen.name)
        return ""

    def choices(self) -> list[tuple[str, str]]:
        """The Run on list of this app: `run_on_choices` less the entries of a backend it does not offer."""
        return [(label, value) for label, value in run_on_choices()
                if (chosen := backend_of(value)) is None or not self.refusal(chosen)]

    def launch(self, run_on: str | None, fields: dict[str, Any], user: str | None, request: Any) -> JobLaunch | None:
        """What `finetune train` gets for a Run on choice (None: this machine): a Jobs flavor's as `prepare` says,
        another backend's options from its form's `fields`; `AccessError` or `ConfigError` (one sentence) when the
        caller cannot run there."""
        chosen = backend_of(run_on)
        if chosen is None:
            return None
        flavor = flavor_of(run_on)
        if flavor is not None:
            return self.prepare(flavor, user, request)
        if refused := self.refusal(chosen):
            raise AccessError(refused)
        return JobLaunch(launch_arguments(str(run_on), fields), None, chosen.title)  # a local run's child

    def _follow_env(self, run_dir: Path, request: Any) -> dict[str, str] | None:
        """The environment a follower of the run's job gets: the caller's token for Jobs, the app's own for a
        backend on this machine's account (`AccessError` when this app does not offer it)."""
        chosen = backend.of_run(run_dir)
        if chosen.on_host:
            if refused := self.refusal(chosen):
                raise AccessError(refused)
            return None
        return self._token_env(request)

    # --- a job whose launcher went away
    def reattach(self, training: JobManager, status: JobStatus, user: str | None, request: Any) -> bool:
        """Follow the caller's job again (`finetune jobs follow`) when its launcher is gone and the job's end is
        not recorded yet: once per run and app process, and only with a token to follow it with."""
        run_dir = status.run_dir
        if status.active or run_dir is None or run_dir in self._reattached or not is_remote_run(run_dir):
            return False
        if not self.access.owns(user, status.owner):
            return False
        try:
            job = backend.read_job(run_dir)
            env = self._follow_env(run_dir, request)
        except (AccessError, FinetuneError):
            return False
        if job.get("outcome") is not None:
            return False
        self._reattached.add(run_dir)
        try:
            training.follow_job(run_dir, owner=status.owner, env=env, launched=float(job.get("created") or 0) - 1)
        except JobBusy:
            return False
        return True

    def cancel(self, status: JobStatus, request: Any) -> str:
        """Cancel the job of `status` from the app itself, with the caller's token: what happened, in a sentence
        ("" when it is no job, or the job is not started yet). Stop asks this as well as signalling the child: a
        launcher or a re-attached follower that is still starting (or is killed by a second Stop) would leave the
        job billing."""
        if status.run_dir is None or not is_remote_run(status.run_dir):
            return ""
        try:
            chosen = backend.of_run(status.run_dir)
        except FinetuneError:
            return ""
        if chosen.on_host:
            return self._cancel_on_host(chosen, status.run_dir)
        from huggingface_hub.errors import HTTPError as HubNetworkError

        from finetune.remote import hfjobs

        try:
            job = hfjobs.attach(status.run_dir)
        except FinetuneError:
            return ""  # no job.json yet: the launcher has started no job, or cancels the one it is starting
        try:
            env = self._token_env(request)
            hfjobs.cancel(job, token=(env or {}).get("HF_TOKEN"))
        except (AccessError, FinetuneError) as e:
            reason = str(e)
        except (HubNetworkError, OSError) as e:
            reason = f"the Hub could not be reached: {type(e).__name__}"
        else:
            return "The job on Hugging Face Jobs is cancelled: its billing stops."
        return (f"⚠️ The app could not cancel the job on Hugging Face Jobs ({reason.rstrip('.')}): cancel it on its "
                f"page, {job.url}, or it runs on, billed to its account.")

    def _cancel_on_host(self, chosen: Backend, run_dir: Path) -> str:
        """Cancel a job on this machine's account (`scancel`): what happened, in a sentence."""
        try:
            said = chosen.cancel(run_dir)
        except FinetuneError as e:
            return (f"⚠️ The app could not cancel the job on {chosen.title} ({str(e).rstrip('.')}): "
                    f"`finetune jobs cancel {run_dir}` cancels it.")
        return f"The job on {chosen.title} is cancelled ({said})."


def job_status(status: JobStatus) -> JobStatus:
    """`status` as the Run panel tells a run on another backend (Jobs, Slurm): where it runs while it is active,
    and once it ended, the job's own sentence (cancelled, stopped at its time limit, failed) that the launcher
    recorded in job.json."""
    from finetune.remote import backend

    if status.run_dir is None or not is_remote_run(status.run_dir):
        return status
    try:
        job = backend.read_job(status.run_dir)
    except FinetuneError:
        return status
    outcome = job.get("outcome") or {}
    if status.active:
        where = backend.get(job["backend"]).describe(job)
        return dataclasses.replace(status, message=f"{status.message} {where}".strip())
    if outcome.get("status") in ("stopped", "failed") and outcome.get("message"):
        state = "stopped" if outcome["status"] == "stopped" else "failed"
        return dataclasses.replace(status, state=state, message=str(outcome["message"]))
    return status
