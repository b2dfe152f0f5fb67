"""The Train tab's Run panel: Start (every check before anything is written, then `finetune train` through the job
client, or into the queue while a run trains), Stop, Resume and Cancel (of the caller's newest queued run), and the
panel's components with the Results under it (the poll, `app.follow`, fills them)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr

from app.door.access import AccessError, new_run_name, resolve_output_dir
from app.hubcheck import hub_problem
from app.local.planner import PLANNER_SLOW
from app.local.training import JobBusy, JobStatus
from app.mapping import (
    COLUMN_FIELDS,
    FIELD_NAMES,
    changed_options,
    config_yaml,
    field_problems,
    in_form_words,
    problems_text,
    values_to_config,
)
from app.remote.choice import LOCAL, backend_fields, backend_of, flavor_of, run_on_choices
from app.remote.jobs import JobLaunch
from app.report import display_path, queued_words, shown_path
from app.results import Unanswered
from app.state import AppState
from app.train import preview
from app.train.form import FieldNotes
from app.train.plan import PlanHandlers
from app.train.run_report import progress_html
from app.train.sweep_form import SweepPanel, build_sweep_panel
from finetune import registry as kinds
from finetune.config.schema import Config, ConfigError, from_dict
from finetune.config.tasks import single_task_values
from finetune.remote.flavors import Flavor
from finetune.run.rundir import RunDirError, check_run_dir, mark_run_dir


@dataclass(frozen=True, kw_only=True)
class Started:
    """What a Start did; the button and the API's `start` report the same. Messages are plain sentences."""

    started: bool
    message: str
    queued: bool = False  # put in the queue behind the run in progress: it starts by itself
    position: int | None = None  # its place in the queue (1: next to start)
    run_dir: str | None = None
    command: str = ""  # the command that reproduces the run from a terminal
    data_error: str = ""  # the dataset's problem, when that is what stopped the start
    form_message: str = ""  # the message in the form's words, when they differ from the config's (the API's)
    fields: dict[str, Any] | None = None  # the page: each field's help, or its problem in its place

    @property
    def note(self) -> str:
        """The message as the page shows it, in the form's words: a refusal gets a warning sign."""
        if self.started or self.queued:
            return self.message
        return f"⚠️ {in_form_words(self.form_message or self.message)}"

    @property
    def start_button(self) -> Any:
        """Start, disabled at the press (`Checking`): enabled again by the answer, whatever it is (a Start while a
        run trains is queued, so a started run needs no guard against a second press either)."""
        return gr.update(interactive=True)

    @property
    def panel(self) -> dict[str, Any]:
        """The Run panel, dimmed at the press: a started run's panel says it starts (the poll fills it next), a
        refused one's comes back as it was."""
        if not self.started:
            return {name: gr.update(elem_classes=[]) for name in PANEL_PARTS}
        fresh = {"status": f"**Starting** — `{self.run_dir}`", "progress": progress_html(JobStatus(state="starting")),
                 "stats": "", "loss": None, "log": "", "metrics": None}
        return {name: gr.update(value=fresh[name], elem_classes=[]) for name in PANEL_PARTS}

    @property
    def dataset_note(self) -> Any:
        """The line under the Dataset field: its problem, cleared by a start, else left as it is."""
        if self.data_error:
            return f"⚠️ {in_form_words(self.data_error)}"
        return "" if self.started else gr.skip()


STALE = "ft-stale"  # the class of a Run panel part that still shows the previous run (dimmed by the page's CSS)
PANEL_PARTS = ("status", "progress", "stats", "loss", "log", "metrics")  # what a new run replaces
RUN_PARTS = ("run-status", "run-progress", "run-stats", "loss-plot", "run-log", "run-metrics")  # their elem_ids


@dataclass(frozen=True, kw_only=True)
class Checking:
    """What Start answers at once, before its checks (the data, the plan: seconds, up to a minute): a sentence,
    Start disabled (a second press would start the checks again) and the previous run's panel dimmed."""

    note: str = "⏳ Checking the data and the plan before the run starts…"
    start_button: Any = field(default_factory=lambda: gr.update(interactive=False))
    panel: dict[str, Any] = field(default_factory=lambda: {name: gr.update(elem_classes=[STALE])
                                                           for name in PANEL_PARTS})


def run_dir_words(error: RunDirError, config: Config) -> str:
    """A refused run folder in the form's words ("tick Overwrite", not `overwrite=true`), with the way out that the
    CLI's message cannot name: a new run needs no Output dir at all."""
    text = in_form_words(str(error))
    return text if config.resume else f"{text} Or clear **Output dir** (under Training) for a new run."


def data_problem(config: Config) -> str:
    """Why the data of `config` cannot train (its first problem), checked as the preview checks it: the one
    dataset, or each task's of a multi-task config; "" when it can."""
    if not config.tasks:
        settings = {k: getattr(config, k) for k in kinds.entry(config.task).settings}  # GRPO's rewards
        view = preview.inspect(config.dataset, config.dataset_config, config.train_split, config.task,
                               {c: getattr(config, c) for c in COLUMN_FIELDS}, settings)
        return view.error
    for t in config.tasks:
        values = single_task_values(config, t)
        view = preview.inspect(t.dataset, t.dataset_config, t.train_split, config.task,
                               {c: values.get(c) for c in COLUMN_FIELDS})
        if view.error:
            return f"Task {t.name!r}: {view.error}"
    return ""


def new_run_dir(home: Path, shared: bool) -> Path:
    """A folder for a new run in `home`, named by the date and time (and a random part when shared)."""
    base = home / new_run_name(shared)
    path, n = base, 2
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


class RunHandlers:
    """Start, Stop and Resume of the caller's run (the scripting API's `start` and `stop` are these too)."""

    def __init__(self, state: AppState, notes: FieldNotes, plans: PlanHandlers):
        self.state, self.notes, self.plans = state, notes, plans

    def checking(self, *, request: Any = None) -> Checking:
        """The press of Start, answered at once (`start` follows it)."""
        return Checking()

    def start(self, *values: Any, request: Any = None) -> Started:
        """Start the form's config on this machine (see `start_run`)."""
        return self.start_on(LOCAL, *values, request=request)

    def start_on(self, run_on: str, *values: Any, request: Any = None) -> Started:
        """Start the form's config where the form's "Run on" says: this machine, a Hugging Face Jobs flavor, or
        another backend; `values` are the form's (`FIELD_NAMES`' order), then on the page the backends' own fields
        (`backend_fields`' order)."""
        values, extra = values[:len(FIELD_NAMES)], values[len(FIELD_NAMES):]
        fields = {f.option: v for (_, f), v in zip(backend_fields(), extra, strict=False)}
        try:
            config = values_to_config(values)
        except ConfigError as e:
            return Started(started=False, message=problems_text(e), fields=self.notes.notes(field_problems(e)))
        started = self.start_run(config, request=request, run_on=run_on, fields=fields)
        # A refusal that names an option (`output_dir` outside the runs folder, a dataset that is not an upload) is
        # shown at that field too.
        refused = {} if started.started or started.queued else field_problems(ConfigError([started.message]))
        return dataclasses.replace(started, fields=self.notes.notes(refused))

    def backend_form(self, run_on: str, *, request: Any = None) -> dict[str, Any]:
        """The chosen backend's own fields shown, the others hidden (`backend_form_shown`)."""
        return backend_form_shown(run_on)

    def run_on_note(self, run_on: str, *, request: Any = None) -> str:
        """What picking `run_on` means, said when it is picked rather than at Start: for a Hugging Face Jobs flavor,
        why this user cannot start a job here (offline, no token, …), or that Plan plans for its GPU."""
        try:
            chosen, flavor = backend_of(run_on), flavor_of(run_on)
            if chosen is None:
                return ""
            user, refusal = self.state.policy.who(request)
            if refusal:
                raise AccessError(refusal)
            if flavor is None:  # another backend: its own refusal here, else where it runs
                if refused := self.state.remote.refusal(chosen):
                    raise AccessError(refused)
                return (f"Runs on {chosen.title}, with the options below: the launcher checks them and plans for "
                        "one of its GPUs before it submits the job.")
            self.state.remote.prepare(flavor, user, request)
        except ConfigError as e:
            return f"⚠️ {problems_text(e)}"
        except AccessError as e:
            return f"⚠️ {e}"
        return (f"Runs on Hugging Face Jobs' {flavor.describe()}, billed to your account: Plan and Start plan for "
                f"one of its GPUs ({flavor.budget_gib:g} GiB).")

    def checks(self, config: Config, user: str | None) -> Started | Path:
        """Start's checks of `config` for `user` on this machine (access, the server's limits and disk, the data,
        the plan), nothing written: the refusal, or the run folder it goes to (what Start sweep checks too)."""
        return self._refused(config, user, None)

    def _refused(self, config: Config, user: str | None, flavor: Flavor | None,
                 launch: JobLaunch | None = None) -> Started | Path:
        """Why `config` may not start for `user` (checked in this order, nothing written), or its run folder. A run
        on another backend than Jobs is planned by its launcher, for that backend's GPU (not this machine's)."""
        state = self.state
        home = state.access.home(state.runs_dir, user)
        try:
            state.access.check_config(config, state.policy.readable(user), state.policy.own_runs(user))
            # The app writes only inside its runs folder (the CLI keeps its freedom on the command line).
            run_dir = resolve_output_dir(config.output_dir, home) or new_run_dir(home, state.access.shared)
        except AccessError as e:
            about_data = str(e).startswith(("`dataset`", "`tasks["))
            return Started(started=False, message=str(e), data_error=str(e) if about_data else "")
        if refused := state.jobs.server_refusal(config):
            return Started(started=False, message=refused)
        if problem := data_problem(config):
            return Started(started=False, message=problem, data_error=problem)
        if unreachable := hub_problem(config.model):  # the run would retry the Hub for a minute, then fail
            return Started(started=False, message=unreachable)
        if flavor is not None:
            # A job's budget is one of the flavor's GPUs (the launcher plans for it again before it sends anything).
            from finetune.remote.preflight import job_config

            planned, device = job_config(config, flavor), "cuda"
        else:
            planned, device = config, "here"
        if planned.memory_budget_gb is not None and (launch is None or flavor is not None):
            # The plan's checks before any folder is made: an impossible budget is refused here, in the form,
            # rather than by the run a few seconds after it started.
            try:  # admitted above: who, the access policy, the limits and the Hub, each checked once per Start
                self.plans.planned(planned, user, device)
            except Unanswered as e:
                if not str(e).startswith(PLANNER_SLOW):  # a slow planner is no reason to refuse: the run plans too
                    return Started(started=False, message=str(e),
                                   form_message=f"Not started (nothing was written): {in_form_words(str(e))}")
        return run_dir

    def start_run(self, config: Config, *, request: Any = None, run_on: str | None = None,
                  fields: dict[str, Any] | None = None) -> Started:
        """Check who asks, where the run goes (`run_on`: this machine, a Hugging Face Jobs flavor: who pays for
        it, or another backend with its form's `fields`), the server's limits and disk, the data and the run
        directory, write the YAML into it and start `finetune train` (with `--backend NAME …` elsewhere)."""
        user, refusal = self.state.policy.who(request)
        if refusal:
            return Started(started=False, message=refusal)
        try:
            flavor = flavor_of(run_on)
            launch = self.state.remote.launch(run_on, fields or {}, user, request)
        except (ConfigError, AccessError) as e:
            return Started(started=False, message=problems_text(e) if isinstance(e, ConfigError) else str(e))
        try:
            # The server's one job is held from the first check to the start: an export asked for while this
            # Start plans (a minute, for a big model) is refused, not run beside it.
            with self.state.jobs.preparing(user):
                return self._start_checked(config, user, flavor, launch)
        except JobBusy as e:
            return Started(started=False, message=str(e))

    def _start_checked(self, config: Config, user: str | None, flavor: Flavor | None,
                       launch: JobLaunch | None) -> Started:
        run_dir = self._refused(config, user, flavor, launch)
        if isinstance(run_dir, Started):
            return run_dir
        if taken := self.state.jobs.taken(run_dir):
            # Refused before anything is written: a queued run starts later from its launch.yaml as it was queued.
            return Started(started=False, message=taken)
        config = from_dict({**changed_options(config), "output_dir": display_path(run_dir)})
        try:
            run_dir = check_run_dir(config)
        except RunDirError as e:
            # The run folder by its place in the runs folder, not where the server keeps it.
            shown = shown_path(run_dir, self.state.runs_dir, self.state.access.shared)
            e = RunDirError(str(e).replace(str(config.output_dir), shown))
            return Started(started=False, message=str(e), form_message=run_dir_words(e, config))
        config_path = run_dir / "launch.yaml"
        command = " ".join(["finetune", "train", display_path(config_path), *(launch.args if launch else [])])
        mark_run_dir(run_dir)
        config_path.write_text(config_yaml(config, f"Written by the finetune app, {time.strftime('%Y-%m-%d %H:%M')}."
                                                   f"\nReproduce: {command}"), encoding="utf-8")
        position = self.state.jobs.start(config_path, run_dir, owner=user, launch=launch)
        shown = shown_path(run_dir, self.state.runs_dir, self.state.access.shared)
        if position:
            return Started(started=False, queued=True, position=position, run_dir=shown,
                           command=command, message=f"{queued_words(position)} Reproduce from a terminal with "
                                                    f"`{command}`.")
        where = f" on Hugging Face Jobs ({flavor.describe()}, billed to your account)" if flavor else ""
        if launch is not None and launch.title:
            where = f" on {launch.title}"
        return Started(started=True, message=f"Started{where}. Reproduce from a terminal with `{command}`.",
                       run_dir=shown, command=command)

    def stop(self, *, request: Any = None) -> str:
        """Ask the run to stop cleanly (a second press kills it); only its owner may."""
        user, refusal = self.state.policy.who(request)
        status = self.state.jobs.status()
        if refusal or (status.active and not self.state.policy.is_mine(status, user)):
            return f"⚠️ {refusal or 'Only the one who started the run in progress can stop it.'}"
        # A run on Jobs whose child cannot be trusted to cancel its job: this press kills the launcher, or the child
        # is a follower the app re-attached (a Stop while it still starts ended it before it could cancel). The
        # launcher itself cancels on the first press.
        follower = status.active and "finetune jobs follow" in status.command
        cancelled = self.state.remote.cancel(status, request) if status.state == "stopping" or follower else ""
        return " ".join(filter(None, (self.state.jobs.stop(), cancelled)))

    def resume(self, *, request: Any = None) -> str:
        """Continue the stopped run from its checkpoint."""
        user, refusal = self.state.policy.who(request)
        if refusal:
            return f"⚠️ {refusal}"
        status = self.state.jobs.status()
        if status.state not in ("stopped", "failed") or status.run_dir is None or \
                not self.state.policy.is_mine(status, user):
            return "Nothing to resume: only a stopped or failed run can be resumed."
        if not status.resumable:
            return "This run ended before its first checkpoint: start it again instead."
        if refused := self.state.policy.run_refusal(status.run_dir, user):
            return f"⚠️ {refused}"
        if refused := self.state.jobs.server_refusal(None):
            return f"⚠️ {refused}"
        try:
            position = self.state.jobs.resume(status.run_dir, owner=user)
        except JobBusy as e:
            return f"⚠️ {e}"
        return (f"{queued_words(position) if position else 'Resuming.'} From a terminal: "
                f"`finetune train {display_path(status.run_dir / 'config.yaml')} resume=true`.")

    def cancel(self, *, request: Any = None) -> str:
        """Take the caller's newest queued run off the queue (its folder too, when nothing had run in it)."""
        user, refusal = self.state.policy.who(request)
        if refusal:
            return f"⚠️ {refusal}"
        queued = self.state.jobs.queued(user)
        if not queued:
            return "Nothing to cancel: you have no run waiting in the queue."
        return self.state.jobs.cancel(queued[-1][0].run_dir, user) or "That run has already started: Stop it instead."

    def cancel_named(self, run: str, *, request: Any = None) -> str:
        """Take the caller's queued run `run` (its folder as Start named it) off the queue; only one of theirs."""
        user, refusal = self.state.policy.who(request)
        if refusal:
            return f"⚠️ {refusal}"
        named = next((q.run_dir for q, _ in self.state.jobs.queued(user) if display_path(q.run_dir) == run), None)
        said = self.state.jobs.cancel(named, user) if named is not None else ""
        return said or f"⚠️ {run!r} is not one of your runs waiting in the queue."


@dataclass
class RunPanel:
    """The Run panel and the Results under it."""

    run_on: Any  # this machine, or an entry of a backend (a Hugging Face Jobs flavor, Slurm)
    backend_groups: dict[str, Any]  # backend name → the group of its own fields, shown while it is chosen
    backend_inputs: list[Any]  # those fields, in `backend_fields`' order (Start's first inputs after Run on)
    start: Any
    stop: Any
    resume: Any
    cancel: Any
    message: Any
    status: Any
    progress: Any
    stats: Any
    trackers: Any
    loss: Any
    log: Any
    metrics: Any
    scatter: Any
    completions: Any
    run_dir: Any
    sweep: SweepPanel  # under Start: a search of several trials instead of one run (app.train.sweep)


def _backend_form() -> tuple[dict[str, Any], list[Any]]:
    """Each backend's own fields (a number or a text box), in a group hidden until one of its entries is chosen."""
    groups: dict[str, Any] = {}
    inputs: list[Any] = []
    for chosen, f in backend_fields():
        if chosen.name not in groups:
            groups[chosen.name] = gr.Group(visible=False, elem_id=f"run-on-{chosen.name}")
        with groups[chosen.name]:
            widget = gr.Number if f.kind in (int, float) else gr.Textbox
            extra = {"precision": 0} if f.kind is int else {}
            inputs.append(widget(label=f.label, info=f.info, elem_id=f"run-on-{f.option.replace('_', '-')}",
                                 **extra))
    return groups, inputs


def backend_form_shown(run_on: str | None) -> dict[str, Any]:
    """The backends' field groups for a Run on choice: the chosen backend's shown, the others hidden."""
    try:
        chosen = backend_of(run_on)
    except ConfigError:
        chosen = None
    names = dict.fromkeys(b.name for b, _ in backend_fields())
    return {name: gr.update(visible=chosen is not None and chosen.name == name) for name in names}


def build_run_panel(choices: list[tuple[str, str]] | None = None) -> RunPanel:
    """The Run panel (Run on with each backend's own fields, Start, Stop, Resume, progress, the loss chart, the log)
    and Results, in the open column; `choices`: the Run on list this app offers (default: every entry)."""
    with gr.Column(variant="panel"):
        gr.Markdown("## Run")
        run_on = gr.Dropdown(choices or run_on_choices(), value=LOCAL, label="Run on", elem_id="run-on",
                             info="This machine, or elsewhere: a GPU of Hugging Face Jobs (billed by the minute to "
                             "your own Hugging Face account; on a Space, the one you signed in with), or a cluster "
                             "this machine submits jobs to; the plan is made for its GPU memory before anything is "
                             "sent.")
        backend_groups, backend_inputs = _backend_form()
        with gr.Row():
            start = gr.Button("Start training", variant="primary", elem_id="start-button")
            stop = gr.Button("Stop", variant="stop", interactive=False)
            resume = gr.Button("Resume", visible=False)
            cancel = gr.Button("Cancel queued run", visible=False, elem_id="cancel-queued")
        message = gr.Markdown(elem_id="run-message")
        sweep = build_sweep_panel()
        status = gr.Markdown(elem_id="run-status")
        progress = gr.HTML(elem_id="run-progress")
        stats = gr.Markdown(elem_id="run-stats")
        trackers = gr.Markdown(elem_id="run-trackers")
        # Drawn by the app (app.charts.loss_chart_html), not gr.LinePlot: see app.charts.
        loss = gr.HTML(label="Loss per optimizer step", container=True, elem_id="loss-plot")
        log = gr.Textbox(label="Log", lines=12, max_lines=12, autoscroll=True, interactive=False,
                         elem_id="run-log")
    with gr.Column(variant="panel"):
        gr.Markdown("## Results")
        metrics = gr.JSON(label="Final metrics", open=True, elem_id="run-metrics")
        scatter = gr.ScatterPlot(None, x="true", y="predicted", height=260, visible=False,
                                 label="Predicted against true values (evaluation rows)", elem_id="regression-scatter")
        # A kind that generates while it trains (GRPO): the latest evaluation's completions and their rewards.
        completions = gr.HTML(visible=False, elem_id="run-completions")
        run_dir = gr.Textbox(label="Run directory", interactive=False)
    return RunPanel(run_on=run_on, backend_groups=backend_groups, backend_inputs=backend_inputs, start=start,
                    stop=stop, resume=resume, cancel=cancel, message=message, status=status,
                    progress=progress, stats=stats, trackers=trackers, loss=loss, log=log, metrics=metrics,
                    scatter=scatter, completions=completions, run_dir=run_dir, sweep=sweep)
