"""The app's scripting API: `start`, `plan`, `status`, `stop`, `cancel`, `predict`, `push`, `export` and
`export_status`, with named parameters and results.

A script passes a run's config as one value, YAML text or a mapping of the config's options, and gets JSON back
(see "Scripting the app" in docs/app.md). The endpoints call the same handlers as the page's buttons (`app.tabs`),
with the caller's request, so that on a shared server a script sees and steers only its own user's run.
"""

# No `from __future__ import annotations` here: Gradio reads these type hints at run time to describe each endpoint's
# parameters and results to clients (`Client.view_api()`).

from typing import TYPE_CHECKING, Any, TypedDict

import gradio as gr

from app.door import limits
from app.mapping import parse_config, problems_text
from app.report import display_path, final_metrics, reproduce_command, waits_for
from app.results import Unanswered
from finetune.config.schema import Config, ConfigError

if TYPE_CHECKING:
    from app.tabs import Handlers


class StartResult(TypedDict):
    """Whether the run started (or was queued behind the run in progress, at `position`), where, the command that
    reproduces it, and a message (the reason, when refused)."""

    started: bool
    queued: bool  # waiting in the queue: it starts by itself when the runs before it end
    position: int | None  # its place in the queue (1: next to start); None unless queued
    run_dir: str | None
    command: str
    message: str


class QueuedResult(TypedDict):
    """One of the caller's runs waiting in the queue."""

    run_dir: str
    position: int  # 1: next to start


class StatusResult(TypedDict):
    """The current (or last) run: its state, optimizer step, latest training loss and final metrics; or, while the
    caller's next run waits in the queue and no run of theirs trains, that run ("queued", at `position`)."""

    state: str  # idle, queued, starting, running, stopping, stopped, done, failed
    queued: bool  # the caller has runs waiting in the queue (all of them in `queue`)
    position: int | None  # the place of the caller's next queued run (1: next to start); None when none waits
    queue: list[QueuedResult]  # the caller's queued runs, first to start first (nobody else's)
    run_dir: str | None
    step: int | None
    total_steps: int | None
    loss: float | None
    message: str
    metrics: dict[str, float]  # empty until the run is done
    model_dir: str | None
    command: str


class PushResult(TypedDict):
    """Whether the finished run's model reached the Hub, where, and a message (the reason, when it did not)."""

    pushed: bool
    url: str | None
    commit: str | None
    message: str


class ExportResult(TypedDict):
    """Whether the export started, of which run, the command it runs, and a message (the reason, when refused)."""

    started: bool
    run_dir: str | None
    command: str
    message: str


class ExportStatusResult(TypedDict):
    """The caller's export: its state, stage, a message, the behaviour check (a GGUF) and the files written."""

    state: str  # idle, running, done, failed
    run_dir: str | None
    stage: str
    message: str
    check: dict[str, Any] | None
    files: list[str]  # names in RUN/export/ ("merged" for the merged folder)


class ScriptApi:
    """The endpoints of one app, bound to its handlers."""

    def __init__(self, handlers: "Handlers"):
        self.handlers = handlers

    def register(self) -> None:
        """Add the endpoints to the Blocks being built (call it inside `with gr.Blocks()`)."""
        gr.api(self.start, api_name="start")
        gr.api(self.plan, api_name="plan", concurrency_id="plan", concurrency_limit=limits.PLAN_CONCURRENCY)
        # Status and Stop must answer while another call (a plan, say) is being served.
        gr.api(self.status, api_name="status", concurrency_limit=None)
        gr.api(self.stop, api_name="stop", concurrency_limit=None)
        gr.api(self.cancel, api_name="cancel", concurrency_limit=None)
        gr.api(self.predict, api_name="predict")
        gr.api(self.push, api_name="push", concurrency_id="push", concurrency_limit=1)
        gr.api(self.export, api_name="export", concurrency_id="export", concurrency_limit=1)
        gr.api(self.export_status, api_name="export_status", concurrency_limit=None)

    def _read(self, config: Any, request: Any) -> Config:
        """The caller's config, read only once the caller may train (anyone's text is bounded before it is
        parsed: `limits.config_size_problem`, `limits.mapping_size_problem`); `Unanswered` with the refusal."""
        refusal = self.handlers.state.policy.who(request)[1]
        if refusal:
            raise Unanswered(refusal)
        return parse_config(config)

    def start(self, config: str | dict[str, Any], request: gr.Request, run_on: str = "local") -> StartResult:
        """Start training `config` (YAML text, or a mapping of config options) as a `finetune train` child process,
        on this machine (`run_on` "local"), on a Hugging Face Jobs flavor (`run_on` "a10g-large", …) or another
        entry of the page's Run on list (`slurm`: with its defaults, one node and one GPU)."""
        try:
            parsed = self._read(config, request)
        except (ConfigError, Unanswered) as e:
            message = problems_text(e) if isinstance(e, ConfigError) else str(e)
            return StartResult(started=False, queued=False, position=None, run_dir=None, command="", message=message)
        result = self.handlers.run.start_run(parsed, request=request, run_on=run_on)
        return StartResult(started=result.started, queued=result.queued, position=result.position,
                           run_dir=result.run_dir, command=result.command, message=result.message)

    def plan(self, config: str | dict[str, Any], request: gr.Request) -> dict[str, Any]:
        """The training plan for `config` (what `finetune plan --json` writes), or {"error": message}."""
        try:
            return self.handlers.plan.make_plan(self._read(config, request), request=request)
        except ConfigError as e:
            return {"error": problems_text(e)}
        except Unanswered as e:
            return {"error": str(e)}

    def status(self, request: gr.Request) -> StatusResult:
        """The state of the current (or last) run, its progress and, once done, its final metrics."""
        state = self.handlers.state
        policy = state.policy
        user, refusal = policy.who(request)
        status = state.jobs.status()
        if not refusal and state.remote.reattach(state.jobs.training, status, user, request):
            status = state.jobs.status()  # a job whose launcher went away, followed again
        step, total = status.progress or (None, None)
        queued = state.jobs.queued(user)
        queue = [QueuedResult(run_dir=display_path(q.run_dir), position=n) for q, n in queued]
        waiting = {"queued": bool(queue), "position": queue[0]["position"] if queue else None, "queue": queue}
        mine = policy.is_mine(status, user)
        if queued and not (mine and status.active):  # the caller's next run, waiting for the one in progress
            first, position = queued[0]
            said = f"Queued, position {position}: it starts by itself when {waits_for(position)}."
            return StatusResult(state="queued", **waiting, run_dir=display_path(first.run_dir), step=None,
                                total_steps=None, loss=None, message=said, metrics={}, model_dir=None,
                                command=" ".join(["finetune train", display_path(first.config_path), *first.overrides]))
        if not mine:  # someone else's run: only that one is in progress, and its step
            shown = policy.in_progress(status) if status.active else ""
            return StatusResult(state=status.state if status.active else "idle", **waiting, run_dir=None,
                                step=step if status.active else None, total_steps=total if status.active else None,
                                loss=None, message=" ".join(m for m in (shown, refusal) if m), metrics={},
                                model_dir=None, command="")
        last_step = status.last("step")
        return StatusResult(state=status.state, **waiting, run_dir=str(status.run_dir) if status.run_dir else None,
                            step=step, total_steps=total, loss=last_step["loss"] if last_step else None,
                            message=status.message, metrics=final_metrics(status),
                            model_dir=str(status.model_dir) if status.model_dir else None,
                            command=reproduce_command(status))

    def stop(self, request: gr.Request) -> dict[str, str]:
        """Stop the run after its current optimizer step, with a checkpoint; a second call kills it: {message}."""
        return {"message": self.handlers.run.stop(request=request).removeprefix("⚠️ ")}

    def cancel(self, run: str = "", request: gr.Request = None) -> dict[str, str]:
        """Take the caller's queued run off the queue (`run`: its folder, as /start answered it; default the newest
        one queued), before it starts: {message}."""
        if not run:
            return {"message": self.handlers.run.cancel(request=request).removeprefix("⚠️ ")}
        return {"message": self.handlers.run.cancel_named(run, request=request).removeprefix("⚠️ ")}

    def predict(self, text: str, request: gr.Request = None, max_new_tokens: int | None = None,
                temperature: float | None = None, top_p: float | None = None, system_prompt: str = "",
                run: str | None = None, with_base: bool = False, tools: str = "") -> dict[str, Any]:
        """The finished run's model on `text`: {label, probabilities}, {generated}, {reply}, {words, tags,
        entities}, or {"error": message}; a model that generates text does so with the settings given (unset: its
        generation_config's; at most Try it's new tokens). `run`: one of the caller's runs or checkpoints instead
        of the current run (a value of Try it's picker, `app.picks`); `with_base`: the base model's answer too,
        under "base" (a model that generates text); `tools`: a chat's tools, a JSON list of function schemas, offered
        through the run's chat template, the reply's parsed calls under "tool_calls" (Try it's Tools box)."""
        from finetune.errors import InputError

        try:
            return self.handlers.tryit.predict(text, request=request, max_new_tokens=max_new_tokens,
                                               temperature=temperature, top_p=top_p, system_prompt=system_prompt,
                                               run=run, with_base=bool(with_base), tools=tools or "")
        except (Unanswered, InputError) as e:  # InputError: the model cannot be loaded, or its template fails
            return {"error": str(e)}

    def push(self, repo: str, private: bool, request: gr.Request = None, run: str = "") -> PushResult:
        """Push the finished run's model and its model card to the Hub repository `repo` (created private when
        `private`), with the token of whoever runs the app, as the Push button does; `run`: one of the caller's runs
        or checkpoints instead of the current run (a value of the Export tab's picker, `app.picks`)."""
        outcome = self.handlers.publish.push_run(repo, private, run or None, request=request)
        message = outcome.message.removeprefix("⚠️ ")
        return PushResult(pushed=outcome.url is not None, url=outcome.url, commit=outcome.commit, message=message)

    def export(self, format: str = "merged", quant: str = "", ollama: bool = False, run: str = "",
               request: gr.Request = None) -> ExportResult:
        """Export the caller's finished run (`finetune export` in a child process; `run`: one of their run folders,
        default their current run): `format` merged or gguf, `quant` f16, q8_0 or q4_k_m, `ollama` a Modelfile."""
        out = self.handlers.inference.start(format, quant or None, bool(ollama), run or None, request=request)
        return ExportResult(**out)

    def export_status(self, request: gr.Request) -> ExportStatusResult:
        """The caller's export: running (with its stage), done (with the check and the files) or failed (why)."""
        return ExportStatusResult(**self.handlers.inference.status(request=request))
