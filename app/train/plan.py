"""The Train tab's memory panel: the budget and batch fields, *Plan for* this machine or a CUDA GPU, and the plan
(`finetune plan` in a child process, through the job client) in words and bars; and the warning under the model
when it cannot fit the budget at all."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from app.door import limits
from app.door.access import AccessError
from app.hubcheck import hub_problem
from app.mapping import changed_options, config_yaml, field_problems, in_form_words, problems_markdown, values_to_config
from app.remote.choice import LOCAL, flavor_of
from app.results import Unanswered, hidden
from app.state import AppState
from app.train import plan_report, preview
from app.train.form import RUN_FOLDER_FIELDS, FieldNotes, Form
from finetune.config.schema import Config, ConfigError, from_dict

PLAN_DEVICES = ("here", "cuda")  # "plan for this machine / for a CUDA GPU" (`finetune plan --device`)


@dataclass(frozen=True, kw_only=True)
class PlanShown:
    """The plan as text and as a bar chart, or the error next to the Plan button."""

    text: str = ""
    chart: Any = hidden()
    error: str = ""
    fields: dict[str, Any] | None = None  # each field's help, or its problem in its place (None: left as they are)
    button: Any = field(default_factory=lambda: gr.update(interactive=True))  # Plan again, once this one answered


@dataclass(frozen=True, kw_only=True)
class Planning:
    """What Plan answers at once, before the planner's child does (seconds to a minute): a sentence where the plan
    goes, the last plan's bars dimmed and the button off; no spinner over the form."""

    text: str = "⏳ Planning: the model is weighed for this config (seconds, a minute at most)…"
    error: str = ""
    chart: Any = field(default_factory=lambda: gr.update(elem_classes=["ft-stale"]))
    button: Any = field(default_factory=lambda: gr.update(interactive=False))


class PlanHandlers:
    """Plan, and the model's fit: the caller's config checked by the access policy and the server's limits, then
    planned by the job client's planner (remembered per user and config, so Plan then Start plans once)."""

    def __init__(self, state: AppState, notes: FieldNotes):
        self.state, self.notes = state, notes

    def make_plan(self, config: Config, *, device: str = "here", request: Any = None) -> dict[str, Any]:
        """`finetune plan` on `config` (for this machine, or with `device` "cuda" for a CUDA GPU of the budget's
        memory): the plan.json mapping; raises `Unanswered` with the planner's message."""
        user, refusal = self.state.policy.who(request)
        self.admit(config, user, refusal)
        return self.planned(config, user, device)

    def admit(self, config: Config, user: str | None, refusal: str) -> None:
        """Whether `user` (refused for `refusal`, "" when not) may plan `config`: the access policy, the server's
        limits, a hub model in reach; raises `Unanswered` saying why not. Start checks all of these itself, once,
        before it plans (`planned`)."""
        try:
            if refusal:
                raise AccessError(refusal)
            self.state.access.check_config(config, self.state.policy.readable(user), self.state.policy.own_runs(user))
        except AccessError as e:
            raise Unanswered(str(e)) from None
        if over := limits.check(config, self.state.limits):
            raise Unanswered(" ".join(over))
        if unreachable := hub_problem(config.model):  # at once, not after the planner's minute of retries
            raise Unanswered(unreachable)

    def planned(self, config: Config, user: str | None, device: str = "here") -> dict[str, Any]:
        """The plan of `config`, already admitted for `user` (`admit`), by the job client's planner (remembered per
        user and config: Plan then Start plans once); raises `Unanswered` with the planner's message."""
        device = device if device in PLAN_DEVICES else "here"
        return self.state.jobs.plan(config, (*_plan_key(config, user), device), device)

    def planning(self, *, request: Any = None) -> Planning:
        """The press of Plan, answered at once (`plan_for` follows it)."""
        return Planning()

    def plan(self, *values: Any, request: Any = None) -> PlanShown:
        """Plan the form's config for this machine (see `plan_for`)."""
        return self.plan_for("here", LOCAL, *values, request=request)

    def plan_for(self, device: str, run_on: str | None, *values: Any, request: Any = None) -> PlanShown:
        """Plan the form's config for `device` ("here", or "cuda": a CUDA GPU of the budget's memory) and show the
        answer, or its error next to the button and each bad value next to its field. A Hugging Face Jobs flavor
        under Run on wins: the plan is for one of its GPUs, as Start plans it (`job_config`)."""
        try:
            config, flavor = values_to_config(values), flavor_of(run_on)
            if flavor is not None:
                from finetune.remote.preflight import job_config  # as Start does: it imports the planner

                config, device = job_config(config, flavor), "cuda"
            plan = self.make_plan(config, device=device, request=request)
        except ConfigError as e:
            return PlanShown(error=problems_markdown(e), fields=self.notes.notes(field_problems(e)))
        except Unanswered as e:  # the planner's sentence, at the field it names too (max_completion_length, task)
            return PlanShown(error=f"⚠️ {in_form_words(str(e))}",
                             fields=self.notes.notes(field_problems(ConfigError([str(e)]))))
        where = (f"Planned for one GPU of Hugging Face Jobs' {flavor.describe()} ({config.memory_budget_gb:g} GiB), "
                 f"the Run on choice.\n\n{flavor_cost(config, plan, flavor)}\n\n") if flavor is not None else ""
        return PlanShown(text=where + plan_report.plan_markdown(plan),
                         chart=gr.update(value=plan_report.plan_chart_html(plan), visible=True, elem_classes=[]),
                         fields=self.notes.notes({}))

    def model_fit(self, *values: Any, request: Any = None) -> str:
        """After a model is picked: a warning when it is on a Hub out of reach, or cannot fit the budget even with a
        4-bit base, with the smallest budget that works (the planner's refusal); "" when it fits or cannot be told."""
        try:
            config = values_to_config(values)
        except ConfigError:
            return ""  # the form's own problems are shown by Plan and Start
        if unreachable := hub_problem(config.model):  # said when the preset is picked (was 62 s of nothing)
            return f"⚠️ {unreachable}"
        if config.memory_budget_gb is None or config.tasks:
            return ""
        try:
            self.make_plan(config, request=request)
        except Unanswered as e:
            if str(e).startswith("Nothing fits"):
                return (f"⚠️ This model does not fit the memory budget, even with LoRA on a 4-bit base: "
                        f"{in_form_words(str(e))}")
            return ""
        return ""


def flavor_cost(config: Config, plan: dict[str, Any], flavor: Any) -> str:
    """What a run on a Jobs flavor may cost: the time limit the job gets (`finetune.remote.timelimit`, as Start sets
    it) at the flavor's price, the most it is billed."""
    from finetune.plan.planner import Plan
    from finetune.remote.timelimit import estimate, format_duration, parameter_count, training_rows

    if "micro_batch_size" not in plan:  # no batch split planned (an error's answer): nothing to price
        return "Cost: not known before the plan has a batch split."
    try:
        limit = estimate(config, Plan.from_dict(plan), gpus=flavor.gpus, gpu_model=flavor.gpu_model or "",
                         rows=None if config.max_steps else training_rows(config), params=parameter_count(config))
    except ConfigError as e:
        return f"Cost: not known before the run ({e.problems[0]})"
    return (f"**Cost: at most ${flavor.usd_per_hour * limit.seconds / 3600:,.2f}**: the job's time limit "
            f"{format_duration(limit.seconds)} at ${flavor.usd_per_hour:.2f}/h (billed by the minute it runs; the "
            f"limit is {limit.reason}).")


def _plan_key(config: Config, user: str | None) -> tuple:
    """What a plan depends on: who asks (each user's files), the config but its run folder, the data files' state."""
    options = {k: v for k, v in changed_options(config).items() if k not in RUN_FOLDER_FIELDS}
    files = tuple(preview.file_stamp(str(p)) for p in (config.dataset, config.eval_dataset) if p)
    return user, config_yaml(from_dict(options)), files


@dataclass
class PlanPanel:
    """The memory panel's own components (its budget and batch fields are the form's)."""

    device: Any
    button: Any
    error: Any
    text: Any
    chart: Any


def build_plan_panel(form: Form) -> PlanPanel:
    """The memory panel, inside the open Train tab column."""
    gr.Markdown("## 3 · Memory budget and batch")
    form.place("batch", per_row=2)
    form.place("memory", per_row=2)
    with gr.Row():
        device = gr.Radio([("this machine", "here"), ("a CUDA GPU of the budget's memory", "cuda")], value="here",
                          label="Plan for", elem_id="plan-device",
                          info="A CUDA GPU: plan here for a GPU you will train on (precision bf16, the CUDA context "
                               "counted); Start trains on this machine.")
        button = gr.Button("Plan", scale=0, elem_id="plan-button")
    error = gr.Markdown(elem_classes="ft-error", elem_id="plan-error")
    text = gr.Markdown(elem_id="plan")
    # Drawn by the app (app.train.plan_report.plan_chart_html): bars scaled to the peak, the budget a marker, each
    # part's size beside it (a 0.6 GiB part of a 24 GiB budget stays visible).
    chart = gr.HTML(visible=False, elem_id="plan-plot")
    return PlanPanel(device=device, button=button, error=error, text=text, chart=chart)
