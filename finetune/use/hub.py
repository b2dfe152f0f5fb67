"""Pushing a run's model to the Hugging Face Hub: the checks before training, and the upload after it.

The token is huggingface_hub's own (`HF_TOKEN`, else the one `hf auth login` stored). Before training, a run with
`push_to_hub` is refused when it could not push (no token, offline mode, a token that is invalid, read-only or not
allowed in the repository's namespace); only an unreachable Hub is left to the end. After training, a failed upload
never touches the saved model: it raises `PushError` (exit 3) with the command that pushes it again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub as hf
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import HfHubHTTPError

# The base error of the HTTP library huggingface_hub uses (httpx2 in 2.x; httpx before): unreachable hosts and
# timeouts raise it, and HfHubHTTPError is one too. Not an OSError.
from huggingface_hub.errors import HTTPError as HubNetworkError

from finetune.config.schema import Config, read_yaml
from finetune.errors import ConfigError, FinetuneError, InputError, PushError
from finetune.models.pretrained import resolve_model_dir
from finetune.run import modelcard
from finetune.run.events import EventLog, Pushed
from finetune.run.rundir import plot_loss
from finetune.use import ollama

LOSS_PLOT = "loss.png"  # drawn into the model folder, so that the card's picture travels with it
# What an upload can fail with: the Hub's answers and the network (HubNetworkError), files (OSError), the card's
# metadata refused by the Hub (ValueError), a run without a model (FinetuneError).
UPLOAD_ERRORS = (HubNetworkError, OSError, ValueError, FinetuneError)


@dataclass(frozen=True)
class PushResult:
    """Where a push went: the repository's page and the commit."""

    repo_id: str
    url: str
    commit: str


def token() -> str | None:
    """The token huggingface_hub would use: `HF_TOKEN`, else the stored login; None without one."""
    return hf.get_token()


def check_push(c: Config, hub_token: str | None = None) -> None:
    """Refuse `push_to_hub` before training when the push could not succeed (see the module docstring)."""
    if c.push_to_hub:
        check_can_push(c.push_to_hub, hub_token or token())


def check_can_push(repo_id: str, hub_token: str | None) -> None:
    """Raise a one-sentence `ConfigError` when `hub_token` cannot push to `repo_id`; an unreachable Hub passes."""
    if hf_constants.is_offline_mode():
        raise ConfigError([f"push_to_hub={repo_id} needs the network, but HF_HUB_OFFLINE is set: unset it, or drop "
                           "push_to_hub and push later with `finetune push RUN_DIR REPO`."])
    if not hub_token:
        raise ConfigError([f"push_to_hub={repo_id} needs a Hugging Face token with write access: set HF_TOKEN (or "
                           "run `hf auth login`)."])
    try:
        me = hf.HfApi().whoami(token=hub_token)
    except HfHubHTTPError as e:
        if e.response is not None and e.response.status_code == 401:
            raise ConfigError(["The Hugging Face token (HF_TOKEN) is not valid: create a token with write access at "
                               "https://huggingface.co/settings/tokens."]) from None
        return  # the Hub answered something else: the push at the end will say what is wrong
    except (HubNetworkError, OSError):  # unreachable now: the push at the end may still work
        return
    role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise ConfigError([f"The Hugging Face token of @{me.get('name')} is read-only: push_to_hub needs a token with "
                           "write access (https://huggingface.co/settings/tokens)."])
    namespace = repo_id.split("/")[0] if "/" in repo_id else me.get("name")
    allowed = {me.get("name"), *(o.get("name") for o in me.get("orgs") or [])}
    if role != "fineGrained" and namespace not in allowed:
        raise ConfigError([f"The Hugging Face token of @{me.get('name')} cannot create repositories under "
                           f"{namespace!r}: use push_to_hub={me.get('name')}/{repo_id.split('/')[-1]} or an "
                           "organisation you belong to."])


def push_run(run_dir: Path, repo_id: str, *, private: bool = True, hub_token: str | None = None,
             model_dir: Path | None = None) -> PushResult:
    """Write the model card into the run's model folder (or `model_dir`: one of its checkpoints' model folders,
    `finetune.use.checkpoint`, carded from the run) and upload the folder to `repo_id` (created if needed).

    Raises `ModelError` when the run has no final model, and huggingface_hub's errors (HTTP, network) as they are."""
    model_dir, run = (Path(model_dir), Path(run_dir)) if model_dir else resolve_model_dir(str(run_dir))
    run_dir = run or model_dir.parent
    if (run_dir / "events.jsonl").is_file():
        plot_loss(run_dir / "events.jsonl", model_dir / LOSS_PLOT)
    api = hf.HfApi(token=hub_token)
    license = _base_license(api, modelcard.base_model_id(_config_model(run_dir)))
    card = modelcard.render(run_dir, model_dir, repo_id, license=license)
    (model_dir / "README.md").write_text(card, encoding="utf-8")
    repo = api.create_repo(repo_id, private=private, exist_ok=True)
    files = sorted(p for p in model_dir.rglob("*") if p.is_file())
    operations = [hf.CommitOperationAdd(path_in_repo=p.relative_to(model_dir).as_posix(), path_or_fileobj=str(p))
                  for p in files]
    info = api.create_commit(repo.repo_id, operations, commit_message=f"Upload model trained with finetune "
                             f"({run_dir.name})")
    return PushResult(repo_id=repo.repo_id, url=str(repo), commit=info.oid)


def export_uploads(run_dir: Path, export_dir: Path | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """(the export's record, {path in the repo: file}) of what `push_export` uploads: the merged folder (a merged
    export), or the GGUF(s) with the Modelfile and the files Ollama's `hf.co/` pull reads (`template`, `params`,
    `system`) when the export wrote one. An `InputError` (one sentence) when there is no export to push."""
    import json

    export_dir = export_dir or run_dir / "export"
    record_path = export_dir / "export.json"
    if not record_path.is_file():
        raise InputError(f"{export_dir} holds no export: run `finetune export {run_dir}` first, then push it.")
    record = json.loads(record_path.read_text(encoding="utf-8"))
    merged = export_dir / "merged"
    if record.get("format") == "gguf":
        files = {p.name: p for p in sorted(export_dir.glob("model-*.gguf"))}
        modelfile = export_dir / "Modelfile"
        if modelfile.is_file():
            files["Modelfile"] = modelfile
    else:
        files = {p.relative_to(merged).as_posix(): p for p in sorted(merged.rglob("*")) if p.is_file()
                 and p.name not in ("README.md", LOSS_PLOT)}
    if not files:
        raise InputError(f"The export in {export_dir} has no files left: export the run again, then push it.")
    return record, files


def push_export(run_dir: Path, repo_id: str, *, export_dir: Path | None = None, private: bool = True,
                hub_token: str | None = None, model_dir: Path | None = None) -> PushResult:
    """Upload a run's export (see `export_uploads`) to `repo_id` with a model card whose usage section says how to
    run it (`ollama run hf.co/…`, `llama-cli -hf …`, or transformers for a merged folder)."""
    model_dir, run = (Path(model_dir), Path(run_dir)) if model_dir else resolve_model_dir(str(run_dir))
    run_dir = run or model_dir.parent
    export_dir = export_dir or run_dir / "export"
    record, files = export_uploads(run_dir, export_dir)
    api = hf.HfApi(token=hub_token)
    extra: dict[str, bytes] = {}
    if "Modelfile" in files:  # what `ollama run hf.co/<repo>` reads instead of a Modelfile
        extra.update({k: v.encode() for k, v in ollama.hub_files(files["Modelfile"].read_text(encoding="utf-8"))
                      .items()})
    if (run_dir / "events.jsonl").is_file():
        plot = export_dir / LOSS_PLOT
        plot_loss(run_dir / "events.jsonl", plot)
        if plot.is_file():
            files[LOSS_PLOT] = plot
    checks = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in sorted(export_dir.glob("check-*.json"))}
    exported = {"format": record.get("format"), "ggufs": [k for k in files if k.endswith(".gguf")],
                "modelfile": "Modelfile" in files, "checks": checks, "plot": LOSS_PLOT in files}
    license = _base_license(api, modelcard.base_model_id(_config_model(run_dir)))
    card = modelcard.render(run_dir, export_dir / "merged", repo_id, license=license, export=exported)
    repo = api.create_repo(repo_id, private=private, exist_ok=True)
    operations = [hf.CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for name, path in files.items()]
    operations += [hf.CommitOperationAdd(path_in_repo=name, path_or_fileobj=data) for name, data in
                   {**extra, "README.md": card.encode()}.items()]
    info = api.create_commit(repo.repo_id, operations, commit_message=f"Upload the {record.get('format')} export "
                             f"of a model trained with finetune ({run_dir.name})")
    return PushResult(repo_id=repo.repo_id, url=str(repo), commit=info.oid)


def _config_model(run_dir: Path) -> str:
    return str(read_yaml(run_dir / "config.yaml").get("model") or "")


def _base_license(api: Any, base: str | None) -> str | None:
    """The base model's license as its Hub card states it; None when unknown (a local model, no answer)."""
    if base is None:
        return None
    try:
        data = api.model_info(base).card_data
    except (HubNetworkError, OSError):  # not found, gated, unreachable: the card leaves the license out
        return None
    return data.get("license") if data is not None else None


def describe_failure(e: BaseException, hub_token: str | None) -> str:
    """An upload failure in one line, without the token."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    return text.replace(hub_token, "***") if hub_token else text


def push_after_training(run_dir: Path, c: Config, log: EventLog) -> PushResult:
    """The end of a run with `push_to_hub`: push, record a `push` event, and on failure raise `PushError` (exit 3)
    saying where the model is and how to push it again."""
    hub_token = token()
    try:
        result = push_run(run_dir, c.push_to_hub, private=c.hub_private, hub_token=hub_token)
    except UPLOAD_ERRORS as e:
        reason = describe_failure(e, hub_token)
        log.emit(Pushed(repo_id=c.push_to_hub, model_dir=str(run_dir / "model"), error=reason))
        raise PushError(f"Training finished and the model is saved in {run_dir / 'model'}, but pushing it to "
                        f"{c.push_to_hub} failed ({reason}): push it again with `finetune push {run_dir} "
                        f"{c.push_to_hub}`.") from None
    log.emit(Pushed(repo_id=result.repo_id, model_dir=str(run_dir / "model"), url=result.url, commit=result.commit))
    return result
