"""What a job reads from this machine: the config's local files and folders, uploaded for the job.

Every option that names something to read (the schema's `source` metadata: `model`, `reference_model`, `dataset`,
`eval_dataset`, `chat_template`, each task's `dataset` and `eval_dataset`) is either a Hub id, which the job reads by
name (nothing is downloaded here), or a local file or folder, which is uploaded with one commit to a folder of a
private dataset repository of the user's and mounted read-only into the job at `INPUTS`. The job's config names the
copies, at paths that depend only on the option and the file's name (`/inputs/dataset/train.csv`), so a resumed job
reads the same paths. The config itself travels the same way (`/inputs/config.yaml`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config.schema import DEFAULT_MODEL, FIELDS, Config, from_dict
from finetune.config.tasks import TASK_KEYS
from finetune.data.load import is_local
from finetune.errors import ConfigError

INPUTS = "/inputs"  # where the job sees its uploaded inputs
CONFIG_NAME = "config.yaml"


@dataclass(frozen=True)
class Upload:
    """One local file or folder and where the job finds it (`remote`, under `INPUTS`)."""

    option: str  # `dataset`, `tasks[1].eval_dataset`, …
    local: Path
    path_in_repo: str  # relative to the run's folder of the inputs repository
    size: int

    @property
    def remote(self) -> str:
        """The path the job's config names."""
        return f"{INPUTS}/{self.path_in_repo}"


def _is_local_model(value: str) -> bool:
    """Whether a model option names a folder here rather than a Hub id (as `resolve_model_path` reads it)."""
    if value == DEFAULT_MODEL:  # installed in the image with the package
        return False
    path = Path(value).expanduser()
    return path.exists() or value.startswith((".", "/", "~")) or value.count("/") > 1


def _is_local(kind: str, value: str) -> bool:
    if kind == "model":
        return _is_local_model(value)
    if kind == "file":
        return True
    return is_local(value)


def _upload(option: str, kind: str, value: str, folder: str) -> Upload:
    """The upload of one local value, refused in one sentence when there is nothing there to send."""
    path = Path(value).expanduser()
    if kind == "model":
        if not (path / "config.json").is_file():
            raise ConfigError([f"`{option}` names the folder {value!r}, which has no config.json: give a folder "
                               "written by `save_pretrained`, or a Hub id the job can download."])
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return Upload(option, path.resolve(), folder, size)
    if not path.is_file():
        raise ConfigError([f"`{option}` names {value!r}, which is not a file here: give an existing file (it is "
                           "uploaded for the job) or a Hub dataset id (the job reads it by name)."])
    return Upload(option, path.resolve(), f"{folder}/{path.name}", path.stat().st_size)


def _sources(values: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(option, kind, value, folder) of every option that names something to read, tasks included."""
    found = []
    for name, f in FIELDS.items():
        kind = f.metadata.get("source")
        if kind in ("model", "data", "file") and isinstance(values.get(name), str):
            found.append((name, kind, values[name], name))
    for i, task in enumerate(values.get("tasks") or []):
        for key, f in TASK_KEYS.items():
            if f.metadata.get("source") == "data" and isinstance(task.get(key), str):
                found.append((f"tasks[{i}].{key}", "data", task[key], f"tasks/{i}-{key}"))
    return found


def _set(values: dict[str, Any], option: str, value: str) -> None:
    if option.startswith("tasks["):
        index, key = option[len("tasks["):].split("].")
        values["tasks"][int(index)][key] = value
    else:
        values[option] = value


def job_inputs(c: Config, output_dir: str) -> tuple[Config, list[Upload]]:
    """The config the job runs (local paths replaced by the uploaded copies', `output_dir` the job's run folder)
    and the uploads that make those copies."""
    values = c.to_dict()
    uploads = [_upload(option, kind, value, folder) for option, kind, value, folder in _sources(values)
               if _is_local(kind, value)]
    for upload in uploads:
        _set(values, upload.option, upload.remote)
    values["output_dir"] = output_dir
    return from_dict(values), uploads


def local_view(remote: dict[str, Any], uploads: dict[str, str], output_dir: str) -> dict[str, Any]:
    """A config the job wrote (its `config.yaml`), as this machine reads it: each uploaded copy named by the local
    path it came from (`uploads` maps remote to local), `output_dir` the local run folder."""
    values = {k: ([dict(t) for t in v] if k == "tasks" and isinstance(v, list) else v) for k, v in remote.items()}
    for option, _, value, _ in _sources(values):
        if value in uploads:
            _set(values, option, uploads[value])
    values["output_dir"] = output_dir
    return values


def commit_operations(uploads: list[Upload], folder: str, config_text: str) -> list[Any]:
    """The commit that puts the uploads and the job's config under `folder` of the inputs repository."""
    from huggingface_hub import CommitOperationAdd

    operations = [CommitOperationAdd(path_in_repo=f"{folder}/{CONFIG_NAME}",
                                     path_or_fileobj=config_text.encode("utf-8"))]
    for upload in uploads:
        if upload.local.is_dir():
            operations += [CommitOperationAdd(path_in_repo=f"{folder}/{upload.path_in_repo}/"
                                                           f"{p.relative_to(upload.local).as_posix()}",
                                              path_or_fileobj=str(p))
                           for p in sorted(upload.local.rglob("*")) if p.is_file() and ".cache" not in p.parts]
        else:
            operations.append(CommitOperationAdd(path_in_repo=f"{folder}/{upload.path_in_repo}",
                                                 path_or_fileobj=str(upload.local)))
    return operations


def describe(uploads: list[Upload]) -> str:
    """`2 local inputs (1.2 MB): dataset cls.csv, model tiny_bert/`, for the launcher's log."""
    if not uploads:
        return "no local inputs (the job reads everything by name)"
    total = sum(u.size for u in uploads)
    names = ", ".join(f"{u.option} {u.local.name}{'/' if u.local.is_dir() else ''}" for u in uploads)
    return f"{len(uploads)} local input(s) ({total / 1e6:.1f} MB): {names}"

