"""Hugging Face Jobs as a backend of `finetune train`: check a run, start it as a job, read the job's stage and
cancel it, through huggingface_hub's own client (`run_job`, `inspect_job`, `cancel_job`, `list_jobs`, buckets and
repositories); `finetune.remote.follow` follows a job and `finetune.remote.fetch` copies its results.

What a job is made of (`job_spec`): the image (a copy of this project's Space, `hf.co/spaces/USER/SPACE`); the
command `finetune train /inputs/config.yaml -q --log-events --doctor` (its log starts with `finetune doctor`'s
findings; under `accelerate launch --num_processes N` on a flavor with N GPUs), run under coreutils' `timeout`,
which asks it to stop (SIGTERM: a checkpoint, then exit 130) a grace period before the job's own time limit; the
token as the job's secret `HF_TOKEN` and nowhere else; two volumes: the user's private bucket, which holds the run
folder (`/runs/<run>`: checkpoints, events, model), and the folder of the private inputs dataset repository that
holds the config and the local files it names (`/inputs`, read-only). Every function takes the token to act with
(default: huggingface_hub's, `HF_TOKEN` or the stored login), so that a server can act for each signed-in user with
theirs; none prints: the launcher and the app say what they like.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub as hf
from huggingface_hub import HfApi, Volume
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.errors import HTTPError as HubNetworkError

from finetune.config.schema import Config, from_dict
from finetune.errors import ConfigError, FinetuneError, InputError
from finetune.remote import flavors as flavor_tables
from finetune.remote.inputs import CONFIG_NAME, INPUTS, commit_operations, describe, job_inputs, local_view
from finetune.remote.jobfile import RUNS_MOUNT, JobHandle, read_handle, write_handle
from finetune.remote.preflight import Preflight, preflight
from finetune.remote.timelimit import TimeLimit
from finetune.run.events import read_events
from finetune.run.rundir import (
    MARKER,
    check_run_dir,
    clear_run_dir,
    default_output_dir,
    is_finished,
    mark_run_dir,
    write_json,
    write_text,
)

BUCKET_NAME = "finetune-runs"  # in the job's namespace, created private when missing
INPUTS_NAME = "finetune-inputs"  # a dataset repository in the job's namespace, created private when missing
TERMINAL = ("COMPLETED", "CANCELED", "ERROR", "DELETED")
# The job's environment: plain settings only (the token is a secret, never here).
JOB_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


class JobError(FinetuneError):
    """The job could not be started, followed or fetched; the message says what to do (exit 1)."""


class JobRefused(InputError):
    """The Hub refused to start the job for a reason the user can fix (token, namespace, credits): exit 2."""


@dataclass(frozen=True)
class JobOptions:
    """How to run on Jobs: the flavor, the image (default: this Space's own, inside a Space), the time limit in
    seconds (default: the estimate), the namespace billed (default: the token's user), the bucket and the inputs
    repository (default: `<namespace>/finetune-runs` and `<namespace>/finetune-inputs`)."""

    flavor: str | None = None
    image: str | None = None
    timeout_s: int | None = None
    namespace: str | None = None
    bucket: str | None = None
    inputs_repo: str | None = None


@dataclass(frozen=True)
class JobState:
    """A job's stage as the Hub reports it now, its message and how long it has run."""

    stage: str
    message: str | None
    running_s: int | None

    @property
    def finished(self) -> bool:
        """Whether the job has ended (completed, cancelled, failed or deleted)."""
        return self.stage in TERMINAL


def resolve_image(image: str | None, space_id: str | None) -> str:
    """The image to run: `image`, else the Space's own when this runs inside one (`SPACE_ID`)."""
    if image:
        return image
    if space_id:
        return f"hf.co/spaces/{space_id}"
    raise ConfigError(["Hugging Face Jobs needs an image with finetune installed: give --image "
                       "hf.co/spaces/USER/SPACE, a copy of this project's Space built for a GPU (docs/jobs.md)."])


def hub_token(token: str | None = None) -> str:
    """The token to act with, or one sentence when there is none (or the Hub is switched off)."""
    if hf_constants.is_offline_mode():
        raise ConfigError(["Hugging Face Jobs needs the network, but HF_HUB_OFFLINE is set: unset it to launch, "
                           "follow or fetch a job."])
    token = token or hf.get_token()
    if not token:
        raise ConfigError(["Hugging Face Jobs needs a token with write access and the `jobs` permission: set "
                           "HF_TOKEN (or run `hf auth login`)."])
    return token


def flavor_table(api: HfApi, name: str | None, token: str | None) -> flavor_tables.FlavorTable:
    """The built-in table when it knows `name` (no request: a refusal costs nothing), else the Hub's own."""
    if name and flavor_tables.BUILT_IN.get(name):
        return flavor_tables.BUILT_IN
    if hf_constants.is_offline_mode():
        return flavor_tables.BUILT_IN
    return flavor_tables.live_table(api, token or False) or flavor_tables.BUILT_IN


def job_command(limit: TimeLimit, gpus: int) -> list[str]:
    """The job's command: the run under `timeout`, which sends SIGTERM `limit.grace_s` before the limit (the
    run then checkpoints and exits 130, `--preserve-status` keeps that code); on several GPUs, `accelerate
    launch` with one process per GPU."""
    launcher = ["python", "-m", "finetune"] if gpus <= 1 else [
        "accelerate", "launch", "--multi_gpu", "--num_processes", str(gpus), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "finetune"]
    return ["timeout", "--signal=TERM", "--preserve-status", f"{limit.stop_after_s}s", *launcher, "train",
            f"{INPUTS}/{CONFIG_NAME}", "-q", "--log-events", "--doctor"]


def job_spec(*, image: str, flavor: str, command: list[str], limit: TimeLimit, token: str, bucket: str,
             remote_dir: str, inputs_repo: str, inputs_path: str, inputs_revision: str | None) -> dict[str, Any]:
    """The keyword arguments of `HfApi.run_job` (less namespace and token): the token only in `secrets`."""
    return {"image": image, "command": command, "env": dict(JOB_ENV), "secrets": {"HF_TOKEN": token},
            "flavor": flavor, "timeout": limit.seconds, "name": remote_dir,
            "labels": {"finetune-run": remote_dir},
            "volumes": [Volume(type="bucket", source=bucket, mount_path=RUNS_MOUNT),
                        Volume(type="dataset", source=inputs_repo, mount_path=INPUTS, path=inputs_path,
                               revision=inputs_revision)]}


def refusal(e: HfHubHTTPError, what: str, token: str) -> JobRefused | JobError:
    """An HTTP refusal in one sentence, without the token."""
    status = e.response.status_code if e.response is not None else None
    text = (str(e).strip().splitlines() or [type(e).__name__])[0][:300].replace(token, "***")
    hints = {401: "the token is not valid: create one with write access and the `jobs` permission at "
                  "https://huggingface.co/settings/tokens",
             402: "the account has no credits for Jobs: add some at https://huggingface.co/settings/billing",
             403: "the token may not do that in this namespace: check --namespace and the token's permissions"}
    if status in hints:
        return JobRefused(f"The Hub refused to {what} ({hints[status]}).")
    return JobError(f"Could not {what}: {text}. Nothing was started; try again.")


def _local_run(c: Config, options: JobOptions) -> tuple[Path, JobHandle | None]:
    """The local run folder the job mirrors into, checked as `finetune train` checks it, and the run's earlier
    job when `resume=true` continues one."""
    run_dir = Path(c.output_dir or default_output_dir())
    if not c.resume:
        check_run_dir(c.replace(output_dir=str(run_dir)))
        return run_dir, None
    previous = read_handle(run_dir)
    if is_finished(run_dir):
        raise ConfigError([f"The run in {str(run_dir)!r} already finished: nothing to resume."])
    return run_dir, previous


def _same_budget(previous: JobHandle, flavor: flavor_tables.Flavor) -> None:
    """A resumed run keeps its plan: refuse a flavor with other GPUs than the one it ran on."""
    before = flavor_tables.BUILT_IN.get(previous.flavor)
    if before is not None and (before.budget_gib, before.gpus) != (flavor.budget_gib, flavor.gpus):
        raise ConfigError([f"The run trained on {previous.flavor} ({before.gpus} × {before.gpu_model}); resume it "
                           f"on the same GPUs (`--flavor {previous.flavor}`), since its plan was made for them."])


def _remote_name(run_dir: Path) -> str:
    """The run's folder in the bucket: the local folder's name and the time, so that runs never collide."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", Path(run_dir).resolve().name)[:40].strip("-") or "run"
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def check(c: Config, options: JobOptions, *, space_id: str | None = None, api: HfApi | None = None,
          token: str | None = None) -> tuple[Preflight, str, Path, JobHandle | None]:
    """Everything that can be refused before anything is created: the image, the flavor, the local run folder,
    the plan for the flavor's GPU and the time limit. Returns the preflight, the image, the run folder and the
    earlier job of a resumed run."""
    api = api or HfApi()
    image = resolve_image(options.image, space_id)
    run_dir, previous = _local_run(c, options)
    name = options.flavor or (previous.flavor if previous else None)
    if not name:
        raise ConfigError(["--backend hf-jobs needs --flavor: the GPU to train on (`finetune jobs flavors` lists "
                           "them with their memory and price)."])
    flavor = flavor_tables.find(name, flavor_table(api, name, token or hf.get_token()))
    if previous is not None:
        _same_budget(previous, flavor)
    return preflight(c, flavor, timeout_s=options.timeout_s, api=api), image, run_dir, previous


def launch(c: Config, options: JobOptions, *, token: str | None = None, space_id: str | None = None,
           api: HfApi | None = None, say: Callable[[str], None] = lambda _: None) -> JobHandle:
    """Start `c` as a job and record it in the local run folder (job.json, the config, the plan for the flavor).
    Refusals (flavor, plan, image, run folder) come before anything is created; when starting fails after that,
    what was written here is removed again, and a job that may have been created anyway is cancelled."""
    api = api or HfApi()
    pre, image, run_dir, previous = check(c, options, space_id=space_id, api=api, token=token)
    say(pre.summary())
    token = hub_token(token)
    try:
        namespace = options.namespace or (previous.namespace if previous else api.whoami(token=token)["name"])
    except HfHubHTTPError as e:
        raise refusal(e, "read the token's account", token) from None
    remote_dir = previous.remote_dir if previous else _remote_name(run_dir)
    bucket = options.bucket or (previous.bucket if previous else f"{namespace}/{BUCKET_NAME}")
    inputs_repo = options.inputs_repo or (previous.inputs_repo if previous else f"{namespace}/{INPUTS_NAME}")
    inputs_path = f"{remote_dir}/{time.strftime('%Y%m%d-%H%M%S')}"
    job_config, uploads = job_inputs(pre.config, f"{RUNS_MOUNT}/{remote_dir}")
    local = {u.remote: str(u.local) for u in uploads}
    undo = _prepare_folder(run_dir, c, from_dict(local_view(job_config.to_dict(), local, str(run_dir))), pre)
    events_before = len(read_events(run_dir / "events.jsonl"))
    command = job_command(pre.limit, pre.flavor.gpus)
    starting = False
    try:
        revision = _send_inputs(api, inputs_repo, inputs_path, uploads, job_config.to_yaml(), token, say)
        _private_bucket(api, bucket, token)
        spec = job_spec(image=image, flavor=pre.flavor.name, command=command, limit=pre.limit, token=token,
                        bucket=bucket, remote_dir=remote_dir, inputs_repo=inputs_repo, inputs_path=inputs_path,
                        inputs_revision=revision)
        starting = True
        info = api.run_job(**spec, namespace=namespace, token=token)
    except BaseException as e:
        undo()
        if starting and not isinstance(e, HfHubHTTPError):  # the Hub may have made the job: none is left running
            _cancel_started(api, namespace, remote_dir, token)
        if isinstance(e, HfHubHTTPError):
            raise refusal(e, "start the job", token) from None
        if isinstance(e, HubNetworkError):
            raise JobError(f"The Hub could not be reached to start the job ({type(e).__name__}): nothing was "
                           "started; try again.") from None
        raise
    handle = JobHandle(run_dir=run_dir, job_id=info.id, namespace=namespace, url=info.url, endpoint=api.endpoint,
                       flavor=pre.flavor.name, gpus=pre.flavor.gpus, image=image, command=tuple(command),
                       timeout_s=pre.limit.seconds, stop_after_s=pre.limit.stop_after_s, bucket=bucket,
                       remote_dir=remote_dir, inputs_repo=inputs_repo, inputs_path=inputs_path,
                       inputs_revision=revision, uploads=local, events_before=events_before, created=time.time())
    write_handle(handle, outcome=None, fetched=None, time_limit_reason=pre.limit.reason)
    return handle


def _prepare_folder(run_dir: Path, c: Config, local_config: Config, pre: Preflight) -> Callable[[], None]:
    """Make the local run folder (marker, the config with local paths, the plan for the flavor) as the run asks
    (`overwrite` clears an earlier run); returns what takes a new folder's files away again."""
    created = not run_dir.exists()
    fresh = created or not any(run_dir.iterdir())
    if c.overwrite and not c.resume and run_dir.is_dir():
        clear_run_dir(run_dir)
    mark_run_dir(run_dir)
    write_text(run_dir / "config.yaml", local_config.to_yaml())
    write_json(run_dir / "plan.json", pre.plan.to_dict())

    def undo() -> None:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif fresh:
            for name in (MARKER, "config.yaml", "plan.json"):
                (run_dir / name).unlink(missing_ok=True)

    return undo


def _cancel_started(api: HfApi, namespace: str, remote_dir: str, token: str) -> None:
    """Cancel the job of `remote_dir` if starting it was interrupted after the Hub created it (best effort: the
    Hub may not be reachable)."""
    try:
        for info in api.list_jobs(labels={"finetune-run": remote_dir}, namespace=namespace, token=token):
            if str(info.status.stage) not in TERMINAL:
                api.cancel_job(job_id=info.id, namespace=namespace, token=token)
    except (HubNetworkError, OSError):
        pass


def _send_inputs(api: HfApi, repo: str, folder: str, uploads: list[Any], config_text: str, token: str,
                 say: Callable[[str], None]) -> str | None:
    """Upload the job's config and local inputs to `repo` (a private dataset repository) in one commit; returns
    the commit, which the job mounts (later uploads do not change what a running job reads)."""
    api.create_repo(repo, repo_type="dataset", private=True, exist_ok=True, token=token)
    if not api.repo_info(repo, repo_type="dataset", token=token).private:
        raise JobRefused(f"The inputs repository {repo} is public: your data would be too. Make it private, or "
                         "give another with --inputs-repo.")
    say(f"uploading {describe(uploads)} to hf.co/datasets/{repo}/{folder}")
    commit = api.create_commit(repo, repo_type="dataset", operations=commit_operations(uploads, folder, config_text),
                               commit_message=f"finetune: inputs of {folder}", token=token)
    return commit.oid


def _private_bucket(api: HfApi, bucket: str, token: str) -> None:
    """Create the runs bucket (private) when missing; refuse one that is public."""
    api.create_bucket(bucket, private=True, exist_ok=True, token=token)
    if not api.bucket_info(bucket, token=token).private:
        raise JobRefused(f"The bucket {bucket} is public: your runs would be too. Make it private, or give another "
                         "with --bucket.")


def api_for(handle: JobHandle) -> HfApi:
    """A client of the Hub the job runs on."""
    return HfApi(endpoint=handle.endpoint)


def status(handle: JobHandle, *, token: str | None = None) -> JobState:
    """The job's stage now."""
    token = hub_token(token)
    try:
        info = api_for(handle).inspect_job(job_id=handle.job_id, namespace=handle.namespace, token=token)
    except HfHubHTTPError as e:
        raise refusal(e, f"read job {handle.job_id}", token) from None
    durations = info.durations
    return JobState(str(info.status.stage), info.status.message, durations.running_secs if durations else None)


def cancel(handle: JobHandle, *, token: str | None = None) -> None:
    """Cancel the job (billing stops; the run's checkpoints stay in the bucket)."""
    token = hub_token(token)
    try:
        api_for(handle).cancel_job(job_id=handle.job_id, namespace=handle.namespace, token=token)
    except HfHubHTTPError as e:
        raise refusal(e, f"cancel job {handle.job_id}", token) from None


def attach(run_dir: Path) -> JobHandle:
    """The job of a run folder (its job.json), to follow, stop or fetch after the launcher is gone."""
    return read_handle(Path(run_dir))
