"""Push to the Hub from the Export tab (and the API's `/push`): who may, with which token, and the sentence the page
shows; and what the page says of a run's last push.

The push runs in the app's own process with the token of whoever runs the app (`HF_TOKEN`, or their stored login),
which never leaves that process: the training child of a shared server does not get it, and no answer contains it
(`finetune.use.hub.describe_failure` masks it in error text). Who may push is `Access.may_push` (see `app.door.access`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.door.access import Access
from app.export.picked import NOTHING_YET, model_buttons, picked_model
from app.local.training import JobStatus
from app.picks import Picked, PickRefused
from app.report import waiting_note
from app.state import AppState
from finetune.config.schema import repo_id_problem
from finetune.errors import ConfigError, InputError
from finetune.run.events import EventLog, Pushed
from finetune.use import hub


@dataclass(frozen=True)
class PushOutcome:
    """How a push went: the Markdown line the page shows and, when it went through, where the model now is."""

    message: str
    url: str | None = None
    commit: str | None = None


def push_finished_run(access: Access, status: JobStatus, user: str | None, repo: str, private: bool,
                      export: bool = False, picked: Picked | None = None) -> PushOutcome:
    """Push the finished run of `status` (or the run or checkpoint `picked`, `app.export.picked`) to `repo` as
    `user`: its model, or with `export` its export (`hub.push_export`: the merged folder, or the GGUFs and
    Modelfile)."""
    if refusal := access.refusal(user) or access.push_refusal(user):
        return PushOutcome(f"⚠️ {refusal}")
    if picked is None:
        if status.state != "done" or status.run_dir is None:
            return PushOutcome(NOTHING_YET)
        picked = Picked(run_dir=status.run_dir, target=status.run_dir)
    repo = (repo or "").strip()
    if not repo:
        return PushOutcome("⚠️ Give the repository to push to, such as your-name/my-model.")
    if problem := repo_id_problem(repo):
        return PushOutcome(f"⚠️ {problem.replace('`push_to_hub` must be', 'The repository must be')}")
    if export:
        try:
            hub.export_uploads(picked.target)  # a run's export, or a checkpoint's (beside it)
        except InputError:
            return PushOutcome("Nothing to push yet: export the run first (Export model).")
    token = hub.token()
    if not token:
        return PushOutcome("⚠️ This server has no Hugging Face token: whoever runs the app sets HF_TOKEN (on a "
                           "Space, as a secret) to a token with write access.")
    try:
        hub.check_can_push(repo, token)
    except ConfigError as e:
        return PushOutcome(f"⚠️ {e.problems[0]}")
    log = EventLog(picked.run_dir / "events.jsonl")
    model_dir = str(picked.target / "model")
    try:
        # A checkpoint: its model folder (written on first use), carded from its run; its export is beside it.
        where = {"model_dir": picked.model_dir} if picked.checkpoint else {}
        if export and picked.checkpoint:
            where["export_dir"] = picked.target / "export"
        push = hub.push_export if export else hub.push_run
        result = push(picked.run_dir, repo, private=private, hub_token=token, **where)
    except InputError as e:  # a checkpoint whose model folder cannot be written
        return PushOutcome(f"⚠️ {e}")
    except hub.UPLOAD_ERRORS as e:
        reason = hub.describe_failure(e, token)
        log.emit(Pushed(repo_id=repo, model_dir=model_dir, error=reason))
        return PushOutcome(f"⚠️ Pushing to {repo} failed ({reason}). The model is unchanged in the run folder: try "
                           "again.")
    log.emit(Pushed(repo_id=result.repo_id, model_dir=model_dir, url=result.url, commit=result.commit))
    return PushOutcome(f"Pushed to [{result.repo_id}]({result.url}) (commit `{result.commit[:7]}`).", result.url,
                       result.commit)


def hub_markdown(status: JobStatus, on_space: bool) -> str:
    """How the run's last push went; on a Space (whose disk does not last) a finished, unpushed run is told to push."""
    push = status.last("push")
    if push and push.get("url"):
        return f"✅ Pushed to [{push['repo_id']}]({push['url']})."
    note = f"⚠️ The push to {push['repo_id']} failed: {push.get('error')}" if push else ""
    if status.model_dir is None:
        return waiting_note(status)
    if on_space and status.state == "done":
        advice = ("💡 This Space's disk is wiped when the Space restarts: push the model to the Hub (or download "
                  "it) to keep it.")
        note = f"{note}\n\n{advice}" if note else advice
    return note


@dataclass(frozen=True, kw_only=True)
class PushShown:
    """Push to the Hub: how it went, in one line."""

    message: str


class PushHandlers:
    """Download model, the Push to the Hub button and the API's `/push`, for the caller's finished run or the run or
    checkpoint picked in the Export tab (`app.export.picked`)."""

    def __init__(self, state: AppState):
        self.state = state

    def push(self, repo: str, private: bool, run: str | None = None, *, request: Any = None) -> PushShown:
        """Push the picked (or finished) run's model and its model card to `repo` (the Push button)."""
        return PushShown(message=self.push_run(repo, private, run, request=request).message)

    def push_run(self, repo: str, private: bool, run: str | None = None, *, request: Any = None,
                 export: bool = False) -> PushOutcome:
        """Push the finished run's model, or the run or checkpoint `run` picked among the caller's (or with `export`
        its export), and its model card to `repo`, with the token of whoever runs the app (only for those
        `Access.may_push` allows)."""
        user, refusal = self.state.policy.who(request)
        status = self.state.jobs.status()
        if run and str(run).strip():
            if refused := self.state.access.refusal(user) or self.state.access.push_refusal(user):
                return PushOutcome(f"⚠️ {refused}")
            try:
                picked = picked_model(self.state, user, refusal, run)
            except PickRefused as e:
                return PushOutcome(f"⚠️ {e}")
            return push_finished_run(self.state.access, status, user, repo, bool(private), export=export,
                                     picked=picked)
        if status.state != "idle" and not self.state.policy.is_mine(status, user):
            return PushOutcome("⚠️ Only the one who started the run can push it.")
        return push_finished_run(self.state.access, status, user, repo, bool(private), export=export)

    def model(self, run: str | None, *, request: Any = None) -> dict[str, Any]:
        """The pick changed: Download model hands out its zip, Push to the Hub acts on it."""
        user, refusal = self.state.policy.who(request)
        return model_buttons(self.state, user, refusal, run)
