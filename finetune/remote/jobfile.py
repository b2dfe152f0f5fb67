"""`job.json`: what a run folder records of the Hugging Face Job that trains it, so that anyone can follow, stop,
re-attach to and fetch the job later (the launcher may be gone): its id, namespace and URL, the flavor and image,
the time limit, where the run lives in the bucket, what was uploaded for it, and, once it ended, how."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import RunDirError
from finetune.run.rundir import write_json

JOB_FILE = "job.json"
BACKEND = "hf-jobs"
RUNS_MOUNT = "/runs"  # where the job sees the bucket that holds its run folders


@dataclass(frozen=True)
class JobHandle:
    """One job of a run: how to reach it (`endpoint`, `namespace`, `job_id`) and what it runs. `events_before` is
    how many records the local `events.jsonl` held when it was launched (a resumed run's earlier jobs);
    `uploads` maps each uploaded copy's path in the job to the local path it came from."""

    run_dir: Path
    job_id: str
    namespace: str
    url: str
    endpoint: str
    flavor: str
    gpus: int
    image: str
    command: tuple[str, ...]
    timeout_s: int
    stop_after_s: int
    bucket: str
    remote_dir: str  # the run's folder in the bucket
    inputs_repo: str
    inputs_path: str  # the job's folder in the inputs dataset repository
    inputs_revision: str | None
    uploads: dict[str, str] = field(default_factory=dict)
    events_before: int = 0
    created: float = 0.0

    @property
    def job_run_dir(self) -> str:
        """The run folder as the job sees it (`output_dir` of the config it runs)."""
        return f"{RUNS_MOUNT}/{self.remote_dir}"

    def to_dict(self) -> dict[str, Any]:
        """As job.json holds it (the run folder is where the file is, so it is not written)."""
        values = dataclasses.asdict(self)
        values.pop("run_dir")
        return {"backend": BACKEND, **values, "command": list(self.command)}

    @classmethod
    def from_dict(cls, run_dir: Path, values: dict[str, Any]) -> JobHandle:
        """The handle job.json describes."""
        names = {f.name for f in dataclasses.fields(cls)} - {"run_dir"}
        known = {k: v for k, v in values.items() if k in names}
        return cls(run_dir=Path(run_dir), **{**known, "command": tuple(known.get("command") or ())})


def job_file(run_dir: Path) -> Path:
    """Where a run folder records its job."""
    return Path(run_dir) / JOB_FILE


def is_remote_run(run_dir: Path) -> bool:
    """Whether a run folder belongs to a Hugging Face Job (it has a job.json)."""
    return job_file(run_dir).is_file()


def read_job(run_dir: Path) -> dict[str, Any]:
    """job.json's contents, or a `RunDirError` that says the folder has none."""
    path = job_file(run_dir)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunDirError(f"{str(run_dir)!r} has no {JOB_FILE}: it is not a run launched with --backend hf-jobs "
                          "(give the folder `finetune train … --backend hf-jobs` printed).") from None
    except (OSError, ValueError):
        raise RunDirError(f"{path} cannot be read as JSON: it is damaged; the job's page on the Hub still shows "
                          "the job.") from None
    if not isinstance(values, dict) or values.get("backend") != BACKEND:
        raise RunDirError(f"{path} does not describe a Hugging Face Job.")
    return values


def read_handle(run_dir: Path) -> JobHandle:
    """The run's current job, from its job.json."""
    try:
        return JobHandle.from_dict(run_dir, read_job(run_dir))
    except TypeError:  # a field missing
        raise RunDirError(f"{job_file(run_dir)} lacks fields a job needs: it was not written by this version of "
                          "finetune.") from None


def write_handle(handle: JobHandle, **extra: Any) -> None:
    """Record the run's current job (atomically) with `extra` (its `outcome`, what was `fetched`, …) and what
    was recorded of it before; the earlier jobs of a resumed run are kept in `previous`."""
    path = job_file(handle.run_dir)
    old = read_job(handle.run_dir) if path.is_file() else {}
    previous = list(old.get("previous") or [])
    if old.get("job_id") and old["job_id"] != handle.job_id:  # a new job of a resumed run
        previous.append({k: v for k, v in old.items() if k != "previous"})
        old = {}
    own = set(handle.to_dict())
    kept = {k: v for k, v in old.items() if k not in own and k != "previous"}
    write_json(path, {**handle.to_dict(), **kept, **extra, "previous": previous})


def recorded(run_dir: Path, key: str) -> Any:
    """A value job.json records beside the handle (`outcome`, `fetched`), or None."""
    return read_job(run_dir).get(key) if is_remote_run(run_dir) else None
