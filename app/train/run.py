"""What the buttons (and the scripting API) do. The work is done by the `finetune` CLI in child processes (train,
plan) or by the pure helpers in `app.mapping`, `app.dataview`, `app.views`; each widget handler answers with a named
result from `app.results`, which `app.ui` maps to the widgets."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gradio as gr

from app import chatview, cleanup, dataview, limits, publish, regressionview, views
from app.access import Access, AccessError, new_run_name, resolve_output_dir
from app.jobs import JobBusy, JobManager, JobStatus, zip_model
from app.mapping import (
    COLUMN_FIELDS,
    FIELD_NAMES,
    KIND_FIELDS,
    SPECS,
    changed_options,
    config_to_values,
    config_yaml,
    field_problems,
    in_form_words,
    infer_task,
    load_config_file,
    plain_words,
    problems_markdown,
    problems_text,
    shown_fields,
    task_label,
    to_widget,
    values_to_config,
)
from app.results import (
    ChatExampleShown,
    DatasetShown,
    ExportShown,
    FieldsShown,
    FormShown,
    PlanShown,
    PredictionShown,
    PushShown,
    RunShown,
    Started,
    TaskGuess,
    TasksShown,
    TryPanel,
    UploadShown,
)
from app.tasksview import tasks_config, tasks_frame
from finetune.config.exclusions import takes
from finetune.config.multitask import single_task_values
from finetune.config.schema import FIELDS, Config, ConfigError, from_dict
from finetune.kinds import registry as kinds
from finetune.run.rundir import RunDirError, check_run_dir, mark_run_dir

PLAN_TIMEOUT_S = 120
PLAN_DEVICES = ("here", "cuda")  # "plan for this machine / for a CUDA GPU" (`finetune plan --device`)
PLAN_MEMO = 16  # plans (or planner errors) kept per app, by config: Start reuses what Plan just answered
PLANNER_SLOW = "The planner took longer than"
PROBE_OFF = "Estimated without a measured probe while a run is training."
TASK_COLUMNS = {name: kinds.entry(name).columns for name in kinds.names()}  # the column widgets each kind shows
NONE_CHOICE = ("—", "")
RUN_FOLDER_FIELDS = ("output_dir", "overwrite", "resume")  # where a run goes: never carried into the next one
TERMINAL = ("stopped", "done", "failed")
EXAMPLE_COLUMNS = {"messages_column", "chosen_column"}  # data whose first example the form shows, tokenized
CHAT_EXAMPLE_LABEL = "The first conversation as the model sees it (learned tokens highlighted)"


class Unanswered(RuntimeError):
    """The planner or the trained model could not answer; the message says why, in words a user can act on."""


def _display_path(path: Path | str) -> str:
    """`path` relative to the working directory when it is inside it (shorter, and what a CLI user would type)."""
    given = Path(path)
    try:
        return str(given.resolve().relative_to(Path.cwd().resolve())) if given.is_absolute() else str(given)
    except ValueError:
        return str(given)


def _run_dir_words(error: RunDirError, config: Config) -> str:
    """A refused run folder in the form's words ("tick Overwrite", not `overwrite=true`), with the way out that the
    CLI's message cannot name: a new run needs no Output dir at all."""
    text = in_form_words(str(error))
    return text if config.resume else f"{text} Or clear **Output dir** (under Training) for a new run."


def entity_pieces(out: dict[str, Any]) -> list[tuple[str, str | None]]:
    """A token-classification prediction as gr.HighlightedText pieces: each entity's words as one piece labelled
    with its type, the other words unlabelled (a tagging without entities, e.g. part of speech: each word's tag)."""
    words, tags, found = out.get("words") or [], out.get("tags") or [], out.get("entities") or []
    if not found:
        return [(f"{w} ", None if t == "O" else t) for w, t in zip(words, tags, strict=False)]
    starts = {e["start"]: e for e in found}
    pieces, i = [], 0
    while i < len(words):
        if i in starts:
            entity = starts[i]
            pieces += [(" ".join(words[i:entity["end"]]), entity["type"]), (" ", None)]
            i = entity["end"]
        else:
            pieces.append((f"{words[i]} ", None))
            i += 1
    return pieces


class Controller:
    """The handlers of one app: they share the runs directory, the job manager and the access policy.

    Every handler takes the Gradio request (`request=`, None when called from Python) to tell who asks: on a shared
    server a user sees and steers only their own run and reads only their own files (see `app.access`)."""

    def __init__(self, runs_dir: Path, jobs: JobManager, *, access: Access | None = None,
                 samples: tuple[Path, ...] = (), server_limits: limits.Limits = limits.LOCAL):
        self.runs_dir = runs_dir
        self.jobs = jobs
        self.access = access or Access()
        self.samples = tuple(Path(p).resolve() for p in samples)  # the app's own sample data, readable by all
        self.limits = server_limits
        self._downloads: Path | None = None  # where finished zips are handed out from, when the runs are elsewhere
        self._plans: dict[tuple, dict[str, Any] | str] = {}  # see make_plan
        # Each field's help as the page shows it (the page sets it: the budget's names the detected memory).
        self.field_infos: dict[str, str] = {name: spec.info for name, spec in SPECS.items()}

    # --- who asks
    def who(self, request: Any) -> tuple[str | None, str]:
        """The user behind `request` and why they may not train ("" when they may)."""
        user = self.access.identify(request)
        return user, self.access.refusal(user)

    def admit(self, request: Any, args: tuple[Any, ...], gate: str = "signed_in") -> str:
        """The door of every page event (see `app.ui._on`): "" when the event may run, else why not. Inputs over
        `limits.MAX_INPUT_CHARS` are refused for everyone; with `gate` "signed_in" (every event that reads a file
        or a visitor's input) so is a caller who may not train. "public" events (progress, Stop, the form of one's
        own run) check ownership themselves."""
        if over := limits.input_size_problem(args):
            return over
        return "" if gate == "public" else self.who(request)[1]

    def _readable(self, user: str | None) -> tuple[Path, ...]:
        return (self.access.uploads(self.runs_dir, user).resolve(), *self.samples)

    def is_mine(self, status: JobStatus, user: str | None) -> bool:
        """Whether `status` is a run `user` may see and steer (every run, locally)."""
        return status.state != "idle" and self.access.owns(user, status.owner)

    @staticmethod
    def in_progress(status: JobStatus) -> str:
        """All that someone else's run shows of itself."""
        step, total = status.progress or (0, None)
        return f"A run is in progress (step {step}/{total})." if total else "A run is in progress (starting)."

    def _busy(self, status: JobStatus, user: str | None) -> str:
        if self.is_mine(status, user):
            return self.jobs.busy_message()
        return f"{self.in_progress(status)} Only one job runs at a time: start yours when it has finished."

    # --- model and dataset
    def on_model(self, model: str, *, request: Any = None) -> TaskGuess:
        """Infer the task from a preset or a local model folder."""
        try:
            self.access.check_source((model or "").strip(), "model", ())
        except AccessError as e:
            return TaskGuess(note=f"⚠️ {e}")
        task = infer_task((model or "").strip())
        if task is None:
            return TaskGuess(note="The task cannot be told offline for this model: choose it under Task.")
        return TaskGuess(task=task, note=f"Task inferred from the model: **{task_label(task)}**.")

    def refresh_dataset(self, source: str, config_name: str, split: str, task: str, *columns: str,
                        request: Any = None) -> DatasetShown:
        """Preview the dataset and fill the column dropdowns from its real columns."""
        wanted = dict(zip(COLUMN_FIELDS, columns, strict=True))
        user, refusal = self.who(request)
        try:
            if refusal:
                raise AccessError(refusal)
            self.access.check_source((source or "").strip(), "dataset", self._readable(user))
        except AccessError as e:  # no preview, and no columns, of a file that is not the user's
            view = dataview.DatasetView(error=str(e))
        else:
            view = dataview.inspect((source or "").strip(), (config_name or "").strip() or None,
                                    (split or "").strip() or "train", task, wanted)
        shown = TASK_COLUMNS.get(task, COLUMN_FIELDS)
        # A missing or unusable column is said beside its dropdown too, not only under the dataset.
        about = field_problems(ConfigError([view.error])) if view.error else {}
        if view.error_field:
            about = {view.error_field: plain_words(view.error)}
        updates = {}
        for name in COLUMN_FIELDS:
            value = view.chosen.get(name) if view.columns else wanted.get(name)
            choices = [NONE_CHOICE, *[(c, c) for c in view.columns]] if view.columns else [NONE_CHOICE]
            if value and value not in view.columns:
                choices.append((value, value))  # an imported mapping stays visible until the data is there
            updates[name] = gr.update(choices=choices, value=value or "", visible=name in shown,
                                      **self._column_note(name, about))
        return DatasetShown(preview=view.preview, columns=updates, labels=dataview.labels_markdown(view),
                            error=f"⚠️ {in_form_words(view.error)}" if view.error else "")

    def _column_note(self, name: str, problems: dict[str, str]) -> dict[str, Any]:
        info = self.field_infos.get(name, "")
        if name in problems:
            return {"info": f"⚠️ {problems[name]}", "elem_classes": ["ft-invalid"]}
        return {"info": info, "elem_classes": []}

    def tasks_table(self, text: str, mixing: str, temperature: Any, cap: Any, *, request: Any = None) -> TasksShown:
        """The Tasks table of the multi-task YAML: each task's data, columns, weight and share, after the same file
        policy as a run (a task's `dataset` is a file like any other)."""
        user, refusal = self.who(request)
        try:
            if refusal:
                raise AccessError(refusal)
            self.access.check_config(tasks_config(text, mixing, temperature, cap), self._readable(user))
        except AccessError as e:
            return TasksShown(table=tasks_frame("", mixing, temperature, cap)[0], note=f"⚠️ {e}")
        except ConfigError:
            pass  # the table words the config's own problem
        table, note = tasks_frame(text, mixing, temperature, cap)
        return TasksShown(table=table, note=note)

    def on_upload(self, uploaded: str | None, config_name: str, split: str, task: str, *columns: str,
                  request: Any = None) -> UploadShown:
        """Keep a stable copy of the uploaded file, point `dataset` at it and preview it.

        The evaluation settings go back to a hold-out of the new file: an evaluation set chosen for other data
        (the sample's, say) would not have this file's columns."""
        if not uploaded:
            return UploadShown()
        user, refusal = self.who(request)
        if refusal:
            return UploadShown(data=self.refresh_dataset("", "", split, task, *columns, request=request))
        folder = self.access.uploads(self.runs_dir, user)
        if over := cleanup.upload_quota_problem(self.runs_dir, folder, Path(uploaded), self.limits.upload_quota):
            Path(uploaded).unlink(missing_ok=True)  # Gradio's copy: refused, so not kept either
            return UploadShown(data=DatasetShown(preview=gr.skip(), columns={}, labels="", error=f"⚠️ {over}"))
        source = _display_path(dataview.keep_upload(uploaded, folder))
        data = self.refresh_dataset(source, "", split, task, *columns, request=request)
        fraction = FIELDS["eval_fraction"].default
        note = f"Evaluation: {fraction:.0%} of this file is held out (More data options sets another evaluation set)."
        labels = f"{data.labels}\n\n{note}" if data.labels else data.labels
        return UploadShown(dataset=source, eval_dataset="", eval_split="", eval_fraction=fraction,
                           data=DatasetShown(preview=data.preview, columns=data.columns, labels=labels,
                                             error=data.error))

    def chat_example(self, source: str, config_name: str, split: str, task: str, column: str, model: str,
                     chat_template: str, train_on: str, max_length: Any, prompt_column: str = "",
                     chosen_column: str = "", rejected_column: str = "", *, request: Any = None) -> ChatExampleShown:
        """For conversation data: the first conversation as the model sees it, the learned tokens highlighted; for
        preference pairs, the first pair, its scored (completion) tokens highlighted."""
        pair = task in kinds.names() and "chosen_column" in kinds.entry(task).columns  # a kind of preference pairs
        if not source or not (pair or (task == "causal_lm" and column)):
            return ChatExampleShown()
        user, refusal = self.who(request)
        try:
            if refusal:
                raise AccessError(refusal)
            self.access.check_source((source or "").strip(), "dataset", self._readable(user))
            self.access.check_source((model or "").strip(), "model", ())
            self.access.check_source((chat_template or "").strip(), "chat_template", self._readable(user))
        except AccessError as e:
            return ChatExampleShown(note=f"⚠️ {e}")
        try:
            length = int(max_length)
        except (TypeError, ValueError):
            length = FIELDS["max_length"].default
        where = (source.strip(), (config_name or "").strip() or None, (split or "").strip() or "train")
        if pair:
            columns = (prompt_column or "prompt", chosen_column or "chosen", rejected_column or "rejected")
            pieces, note = chatview.pair_example(*where, columns, (model or "").strip(), length)
            label = "The first pair as the model sees it (scored tokens highlighted)"
        else:
            pieces, note = chatview.example(*where, column, (model or "").strip(),
                                            (chat_template or "").strip() or None, train_on or "assistant", length)
            label = CHAT_EXAMPLE_LABEL
        return ChatExampleShown(example=gr.update(value=pieces, visible=bool(pieces), label=label), note=note)

    # --- plan
    def make_plan(self, config: Config, *, device: str = "here", request: Any = None) -> dict[str, Any]:
        """`finetune plan` on `config` (for this machine, or with `device` "cuda" for a CUDA GPU of the budget's
        memory): the plan.json mapping; raises `Unanswered` with the planner's message."""
        user, refusal = self.who(request)
        try:
            if refusal:
                raise AccessError(refusal)
            self.access.check_config(config, self._readable(user))
        except AccessError as e:
            raise Unanswered(str(e)) from None
        if over := limits.check(config, self.limits):
            raise Unanswered(" ".join(over))
        device = device if device in PLAN_DEVICES else "here"
        key = (*self._plan_key(config, user), device)
        if key in self._plans:  # Plan, then Start on the same form: one planner run, not two
            answer = self._plans[key]
            if isinstance(answer, str):
                raise Unanswered(answer)
            return dict(answer)
        try:
            plan = self._run_planner(config, device)
        except Unanswered as e:
            if not str(e).startswith(PLANNER_SLOW):
                self._remember(key, str(e))
            raise
        if not plan.get("notes") or PROBE_OFF not in plan["notes"]:
            self._remember(key, plan)
        return plan

    def _plan_key(self, config: Config, user: str | None) -> tuple:
        options = {k: v for k, v in changed_options(config).items() if k not in RUN_FOLDER_FIELDS}
        files = tuple(dataview._stamp(str(p)) for p in (config.dataset, config.eval_dataset) if p)
        return user, config_yaml(from_dict(options)), files

    def _remember(self, key: tuple, answer: dict[str, Any] | str) -> None:
        self._plans[key] = answer
        while len(self._plans) > PLAN_MEMO:
            self._plans.pop(next(iter(self._plans)))

    def _run_planner(self, config: Config, device: str = "here") -> dict[str, Any]:
        """`finetune plan --json` in a child process."""
        extra = ["--device", "cuda"] if device == "cuda" else []
        if self.jobs.status().active and "plan_probe" in FIELDS:
            # A measured probe would train on the device the running job is using: estimate without one.
            extra = ["plan_probe=false", *extra]
        with tempfile.TemporaryDirectory(prefix="finetune-plan-") as tmp:
            cfg_path, out_path = Path(tmp) / "config.yaml", Path(tmp) / "plan.json"
            cfg_path.write_text(config_yaml(config), encoding="utf-8")
            try:
                proc = subprocess.run([sys.executable, "-m", "finetune", "plan", str(cfg_path), *extra, "--json",
                                       str(out_path)], capture_output=True, text=True, timeout=PLAN_TIMEOUT_S,
                                      env=self.access.child_env(os.environ))
            except subprocess.TimeoutExpired:
                raise Unanswered(f"{PLANNER_SLOW} {PLAN_TIMEOUT_S} s.") from None
            if proc.returncode != 0 or not out_path.is_file():
                text = (proc.stderr or proc.stdout).strip().splitlines()
                message = next((line[len("error: "):] for line in reversed(text) if line.startswith("error: ")),
                               None)
                raise Unanswered(limits.short_text(message or (text[-1] if text else "The planner failed.")))
            plan = json.loads(out_path.read_text(encoding="utf-8"))
        if "plan_probe=false" in extra:
            plan["notes"] = [*plan.get("notes", []), PROBE_OFF]
        return plan

    def plan(self, *values: Any, request: Any = None) -> PlanShown:
        """Plan the form's config for this machine (see `plan_for`)."""
        return self.plan_for("here", *values, request=request)

    def plan_for(self, device: str, *values: Any, request: Any = None) -> PlanShown:
        """Plan the form's config for `device` ("here", or "cuda": a CUDA GPU of the budget's memory) and show the
        answer, or its error next to the button and each bad value next to its field."""
        try:
            plan = self.make_plan(values_to_config(values), device=device, request=request)
        except ConfigError as e:
            return PlanShown(error=problems_markdown(e), fields=self.field_notes(field_problems(e)))
        except Unanswered as e:
            return PlanShown(error=f"⚠️ {in_form_words(str(e))}", fields=self.field_notes({}))
        return PlanShown(text=views.plan_markdown(plan), chart=gr.update(value=views.plan_chart_html(plan),
                                                                         visible=True),
                         fields=self.field_notes({}))

    def field_notes(self, problems: dict[str, str]) -> dict[str, Any]:
        """Each field's help, or (for the fields in `problems`) its problem in its place, marked: a bad value is
        shown next to its field, and a fixed one goes back to its help."""
        return {name: gr.update(info=f"⚠️ {problems[name]}" if name in problems else info,
                                elem_classes=["ft-invalid"] if name in problems else [])
                for name, info in self.field_infos.items()}

    def form_fields(self, task: str, source: str, *, request: Any = None) -> FieldsShown:
        """Only what applies: the fields of the chosen task kind and, for a local file, no hub config or split.

        Whether a path is a file is told only of the user's own files: the fields must not tell a visitor which
        paths exist on a shared server."""
        user, refusal = self.who(request)
        try:
            if refusal:
                raise AccessError(refusal)
            self.access.check_source((source or "").strip(), "dataset", self._readable(user))
        except AccessError:
            source = ""
        shown = shown_fields(task, source)
        shown_columns = kinds.entry(task).columns if task in kinds.names() else COLUMN_FIELDS
        # A hidden kind option goes back to its default: a value set for another kind (preference's β, say) is
        # not sent with this one, where the config would refuse it at a field no one can see. (Columns are set by
        # refresh_dataset for the kind; the hub fields and the one-control fields only hide.)
        reset = {name for name, visible in shown.items()
                 if not visible and name in KIND_FIELDS and name not in COLUMN_FIELDS}
        return FieldsShown(fields={name: gr.update(visible=visible, **(
                               {"value": to_widget(name, FIELDS[name].default)} if name in reset else {}))
                               for name, visible in shown.items()},
                           tasks_section=gr.update(visible=takes(task, "tasks") if task in kinds.names() else True),
                           chat_example=gr.skip() if EXAMPLE_COLUMNS & set(shown_columns) else
                           gr.update(visible=False))

    def model_fit(self, *values: Any, request: Any = None) -> str:
        """After a model is picked: a warning when it cannot fit the budget even with a 4-bit base, with the
        smallest budget that works (the planner's refusal); "" when it fits or cannot be told."""
        try:
            config = values_to_config(values)
        except ConfigError:
            return ""  # the form's own problems are shown by Plan and Start
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

    # --- training
    def start(self, *values: Any, request: Any = None) -> Started:
        """Start the form's config (see `start_run`)."""
        try:
            config = values_to_config(values)
        except ConfigError as e:
            return Started(started=False, message=problems_text(e), fields=self.field_notes(field_problems(e)))
        started = self.start_run(config, request=request)
        return dataclasses.replace(started, fields=self.field_notes({}))

    def start_run(self, config: Config, *, request: Any = None) -> Started:
        """Check who asks, the server's limits and disk, the data and the run directory, write the YAML into it and
        start `finetune train`."""
        user, refusal = self.who(request)
        if refusal:
            return Started(started=False, message=refusal)
        status = self.jobs.status()
        if status.active:
            return Started(started=False, message=self._busy(status, user))
        if self.access.shared and (exporter := getattr(self, "exporter", None)) is not None and exporter.running():
            return Started(started=False, message="An export is in progress on this server: start the run when it "
                                                  "is done (one job at a time).")
        home = self.access.home(self.runs_dir, user)
        try:
            self.access.check_config(config, self._readable(user))
            # The app writes only inside its runs folder (the CLI keeps its freedom on the command line).
            run_dir = resolve_output_dir(config.output_dir, home) or self._new_run_dir(home)
        except AccessError as e:
            about_data = str(e).startswith(("`dataset`", "`tasks["))
            return Started(started=False, message=str(e), data_error=str(e) if about_data else "")
        if refused := self._server_refuses(config):
            return Started(started=False, message=refused)
        if problem := self._data_problem(config):
            return Started(started=False, message=problem, data_error=problem)
        if config.memory_budget_gb is not None:
            # The plan's checks before any folder is made: an impossible budget is refused here, in the form,
            # rather than by the run a few seconds after it started.
            try:
                self.make_plan(config, request=request)
            except Unanswered as e:
                if not str(e).startswith(PLANNER_SLOW):  # a slow planner is no reason to refuse: the run plans too
                    return Started(started=False, message=str(e),
                                   form_message=f"Not started (nothing was written): {in_form_words(str(e))}")
        config = from_dict({**changed_options(config), "output_dir": _display_path(run_dir)})
        try:
            run_dir = check_run_dir(config)
        except RunDirError as e:
            return Started(started=False, message=str(e), form_message=_run_dir_words(e, config))
        config_path = run_dir / "launch.yaml"
        command = f"finetune train {_display_path(config_path)}"
        mark_run_dir(run_dir)
        config_path.write_text(config_yaml(config, f"Written by the finetune app, {time.strftime('%Y-%m-%d %H:%M')}."
                                                   f"\nReproduce: {command}"), encoding="utf-8")
        try:
            self.jobs.start(config_path, run_dir, owner=user)
        except JobBusy as e:
            return Started(started=False, message=str(e))
        return Started(started=True, message=f"Started. Reproduce from a terminal with `{command}`.",
                       run_dir=_display_path(run_dir), command=command)

    @staticmethod
    def _data_problem(config: Config) -> str:
        """Why the data of `config` cannot train (its first problem), checked as the preview checks it: the one
        dataset, or each task's of a multi-task config; "" when it can."""
        if not config.tasks:
            view = dataview.inspect(config.dataset, config.dataset_config, config.train_split, config.task,
                                    {c: getattr(config, c) for c in COLUMN_FIELDS})
            return view.error
        for t in config.tasks:
            values = single_task_values(config, t)
            view = dataview.inspect(t.dataset, t.dataset_config, t.train_split, config.task,
                                    {c: values.get(c) for c in COLUMN_FIELDS})
            if view.error:
                return f"Task {t.name!r}: {view.error}"
        return ""

    def _server_refuses(self, config: Config | None) -> str:
        """Why this server will not start `config` (its limits, its disk), after deleting what its clean-up policy
        says is old; "" when it may start."""
        cleanup.tidy(self.runs_dir, self.limits.keep_days, keep=self.jobs.status().run_dir,
                     gradio_dir=cleanup.gradio_temp_dir())
        problems = limits.check(config, self.limits) if config is not None else []
        disk = cleanup.disk_problem(self.runs_dir, self.limits.min_free_gb)
        return " ".join([*problems, *([disk] if disk else [])])

    def _new_run_dir(self, home: Path) -> Path:
        base = home / new_run_name(self.access.shared)
        path, n = base, 2
        while path.exists():
            path, n = base.with_name(f"{base.name}-{n}"), n + 1
        return path

    def stop(self, *, request: Any = None) -> str:
        """Ask the run to stop cleanly (a second press kills it); only its owner may."""
        user, refusal = self.who(request)
        status = self.jobs.status()
        if refusal or (status.active and not self.is_mine(status, user)):
            return f"⚠️ {refusal or 'Only the one who started the run in progress can stop it.'}"
        return self.jobs.stop()

    def resume(self, *, request: Any = None) -> str:
        """Continue the stopped run from its checkpoint."""
        user, refusal = self.who(request)
        if refusal:
            return f"⚠️ {refusal}"
        status = self.jobs.status()
        if status.state not in ("stopped", "failed") or status.run_dir is None or not self.is_mine(status, user):
            return "Nothing to resume: only a stopped or failed run can be resumed."
        if not status.resumable:
            return "This run ended before its first checkpoint: start it again instead."
        if refused := self._server_refuses(None):
            return f"⚠️ {refused}"
        try:
            self.jobs.resume(status.run_dir, owner=user)
        except JobBusy as e:
            return f"⚠️ {e}"
        return (f"Resuming. From a terminal: `finetune train {_display_path(status.run_dir / 'config.yaml')} "
                "resume=true`.")

    def poll(self, seen: Any, *, request: Any = None) -> RunShown:
        """Refresh the run's progress, curve, log and results; leave everything as it is when nothing changed.

        Someone else's run shows only that it is in progress, and at which step."""
        user, refusal = self.who(request)
        status = self.jobs.status()
        if not self.is_mine(status, user):
            note = self.in_progress(status) if status.active else ""
            status = JobStatus(state="idle")
            text = "\n\n".join(f"**{line}**" for line in (note, refusal) if line) or views.status_markdown(status)
        else:
            text = views.status_markdown(status)
        signature = (str(status.run_dir), len(status.events), status.state, status.message, status.output_tail,
                     text)
        if seen == signature:
            return RunShown()
        model_dir = status.model_dir
        changed_run = not isinstance(seen, (list, tuple)) or list(seen[:1]) + list(seen[2:3]) != [
            str(status.run_dir), status.state]
        download = (gr.update(value=self._handout(zip_model(model_dir, status.run_dir / "model.zip"),
                                                  f"{status.run_dir.name}.zip"), interactive=True)
                    if status.state == "done" and model_dir is not None else gr.update(value=None, interactive=False))
        command = self.command(status)
        options = publish.run_options(status) if status.run_dir else {"report_to": [], "push_to_hub": None}
        return RunShown(signature=signature, status=text,
                        progress=views.progress_html(status), stats=views.stats_markdown(status),
                        loss_curve=views.curves_html(status.events), log=views.log_text(status),
                        metrics=views.final_metrics(status) or None, run_dir=str(status.run_dir or ""),
                        download=download, start_button=gr.update(interactive=not status.active),
                        stop_button=gr.update(interactive=status.active),
                        resume_button=gr.update(visible=status.resumable),
                        command=command if command else gr.skip(),
                        trackers=views.trackers_markdown(options["report_to"], status.run_dir),
                        hub_note=views.hub_markdown(status, on_space=self.access.mode == "space"),
                        push_repo=options["push_to_hub"] or gr.skip(),
                        try_panel=self.try_panel(status, new_model=not isinstance(seen, (list, tuple))
                                                 or seen[0] != str(status.run_dir) or status.state == "done")
                        if changed_run else None,
                        # "Started…", "Stopping…" and the like answered an action on this run: its end replaces them.
                        note="" if changed_run and status.state in TERMINAL and isinstance(seen, (list, tuple))
                        else gr.skip(),
                        scatter=regressionview.scatter_update(status))

    @staticmethod
    def try_panel(status: JobStatus, *, new_model: bool) -> TryPanel:
        """Try it for `status`: the chat box (a run trained on conversations) or the text box, Predict enabled once
        the model is finished; a new model clears the last one's chat, prediction and message."""
        kind = views.try_kind(status)
        chat = kind == "chat"
        cleared = {"label": gr.update(value=None, visible=False), "generated": gr.update(value="", visible=False),
                   "entities": gr.update(value=None, visible=False), "message": ""} if new_model else {}
        ready = kind is not None
        return TryPanel(chat=gr.update(visible=chat, **({"value": []} if new_model else {})),
                        new_chat=gr.update(visible=chat), push=gr.update(interactive=ready),
                        button=gr.update(interactive=ready, value="Send" if chat else "Predict"),
                        text=gr.update(label="Your message" if chat else "Try it",
                                       placeholder="Write to the trained model" if chat
                                       else "Type a text for the trained model"), **cleared)

    def _handout(self, path: Path, name: str | None = None) -> str:
        """A path the download button may take, named `name` (what the browser saves it as; default: the file's own
        name, after its folder's when it is handed out from elsewhere): Gradio copies a returned file into its cache
        (under a path nobody can guess) only from the working or the temporary directory, and nothing under the runs
        folder is served."""
        resolved = path.resolve()
        if name in (None, path.name) and any(resolved.is_relative_to(Path(d).resolve())
                                             for d in (Path.cwd(), tempfile.gettempdir())):
            return str(path)
        if self._downloads is None:
            self._downloads = Path(tempfile.mkdtemp(prefix="finetune-downloads-"))
        out = self._downloads / f"{path.parent.name}-{path.name}"
        if name:  # a folder per source folder: two users' runs of the same name never share a download
            out = self._downloads / hashlib.sha256(str(resolved.parent).encode()).hexdigest()[:16] / name
            out.parent.mkdir(exist_ok=True)
        if not out.is_file() or out.stat().st_mtime < path.stat().st_mtime:
            out.unlink(missing_ok=True)
            try:
                os.link(path, out)  # free on the same file system
            except OSError:
                shutil.copyfile(path, out)
        return str(out)

    def running_config(self, *, request: Any = None) -> FormShown:
        """On page load: the form (and its dataset preview) shows the config of the owner's current or last run, as
        the Run panel does, clearly labelled; its run folder is left out, so the next Start makes a new run rather
        than meeting the running one's folder."""
        user = self.access.identify(request)
        status = self.jobs.status()
        if status.config_path is None or not self.is_mine(status, user):
            return FormShown()
        try:
            config = load_config_file(status.config_path)
        except ConfigError:  # a config the app did not write, which no longer validates: keep the form
            return FormShown()
        config = from_dict({k: v for k, v in changed_options(config).items() if k not in RUN_FOLDER_FIELDS})
        data = self.refresh_dataset(config.dataset or "", config.dataset_config or "", config.train_split,
                                    config.task, *[getattr(config, c) or "" for c in COLUMN_FIELDS], request=request)
        return FormShown(values=dict(zip(FIELD_NAMES, config_to_values(config), strict=True)), data=data,
                         note=f"The form shows the settings of run `{_display_path(status.run_dir)}`. Start makes a "
                              "new run (in a new folder) from them.")

    def clear_note(self, *, request: Any = None) -> str:
        """Empty the model's note (after an import: the imported model may differ)."""
        return ""

    @staticmethod
    def command(status: JobStatus) -> str:
        """The command that reproduces the current (or last) run from a terminal; "" before any run."""
        if status.config_path is None:
            return ""
        extra = ["resume=true"] if "resume=true" in status.command.split() else []
        return shlex.join(["finetune", "train", _display_path(status.config_path), *extra])

    # --- results
    def _finished_run(self, text: str, request: Any) -> tuple[str, JobStatus]:
        """The text cut to the Try it limit and the finished run of the user who asks, or `Unanswered`."""
        user, refusal = self.who(request)
        if refusal:
            raise Unanswered(refusal)
        text, _ = limits.truncate_try_text(text)
        if not text:
            raise Unanswered("Type a text first.")
        status = self.jobs.status()
        if status.model_dir is None or not self.is_mine(status, user):
            raise Unanswered("No trained model yet: train (or resume) a run to the end first.")
        return text, status

    def predict(self, text: str, *, request: Any = None) -> dict[str, Any]:
        """The finished model on one text: {label, probabilities}, {reply} (a causal LM with a chat template: the
        text is the user's turn), {generated}, or {words, tags, entities} (token classification).

        Raises `Unanswered` without a text or a finished model, and `finetune.models.load.ModelError` when the model
        cannot be loaded."""
        text, status = self._finished_run(text, request)
        from finetune.use.predict import predict

        out = predict(str(status.run_dir), [text], max_new_tokens=limits.MAX_NEW_TOKENS)[0]
        return {k: v for k, v in out.items() if k != "text"}  # the kind's record, less the text it was given

    def try_it(self, text: str, history: list[dict[str, Any]] | None = None, *, request: Any = None
               ) -> PredictionShown:
        """Try it: label probabilities, a generated continuation, or (a causal LM with a chat template) the next
        turn of a chat with the finished model, through the template it was trained with."""
        from finetune.models.load import ModelError
        from finetune.use.predict import chat

        try:
            status = self.jobs.status()
            if history or views.try_kind(status) == "chat":  # the model answers the whole conversation
                text, status = self._finished_run(text, request)
                turns = [*chatview.history_turns(history), {"role": "user", "content": text}]
                out = {"reply": chat(str(status.run_dir), turns, max_new_tokens=limits.MAX_NEW_TOKENS)}
            else:
                out = self.predict(text, request=request)
        except Unanswered as e:
            return PredictionShown(message=str(e))
        except ModelError as e:
            return PredictionShown(message=f"⚠️ {e}")
        shown_text, note = limits.truncate_try_text(text)
        if "probabilities" in out:
            return PredictionShown(label=gr.update(value=out["probabilities"], visible=True),
                                   generated=gr.update(visible=False), chat=gr.update(visible=False), message=note)
        if "reply" in out:
            reply = out["reply"]
            if not reply.strip():  # an empty bubble reads as a broken page
                reply = "*(no reply)*"
                note = " ".join(n for n in (note, "The model answered with nothing: it may need more training, or "
                                            "more data.") if n)
            shown = [*chatview.history_turns(history), {"role": "user", "content": shown_text},
                     {"role": "assistant", "content": reply}]
            return PredictionShown(label=gr.update(visible=False), generated=gr.update(visible=False),
                                   chat=gr.update(value=shown, visible=True), text="", message=note)
        if "tags" in out:  # token classification: the text with its entities highlighted
            return PredictionShown(label=gr.update(visible=False), chat=gr.update(visible=False), message=note,
                                   generated=gr.update(visible=False),
                                   entities=gr.update(value=entity_pieces(out), visible=True))
        if "score" in out:  # a reward model: the text's reward (issue 21 item 7: Try it scores a text)
            return PredictionShown(label=gr.update(visible=False), chat=gr.update(visible=False), message=note,
                                   generated=gr.update(value=f"{out['score']:.4g}", label="Reward (score)",
                                                       visible=True))
        if "value" in out:  # regression: the predicted number
            return PredictionShown(label=gr.update(visible=False), chat=gr.update(visible=False), message=note,
                                   generated=gr.update(value=f"{out['value']:.4g}", label="Predicted value",
                                                       visible=True))
        return PredictionShown(label=gr.update(visible=False), chat=gr.update(visible=False),
                               generated=gr.update(value=out["generated"], label="Generated continuation",
                                                   visible=True), message=note)

    def push(self, repo: str, private: bool, *, request: Any = None) -> PushShown:
        """Push the finished run's model and its model card to `repo` (the Push button)."""
        return PushShown(message=self.push_run(repo, private, request=request).message)

    def push_run(self, repo: str, private: bool, *, request: Any = None) -> publish.PushOutcome:
        """Push the finished run's model and its model card to `repo`, with the token of whoever runs the app (only
        for those `Access.may_push` allows; see `app.publish`)."""
        user, _ = self.who(request)
        status = self.jobs.status()
        if status.state != "idle" and not self.is_mine(status, user):
            return publish.PushOutcome("⚠️ Only the one who started the run can push it.")
        return publish.push_finished_run(self.access, status, user, repo, bool(private))

    # --- reproducibility
    def export(self, *values: Any, request: Any = None) -> ExportShown:
        """The form as the YAML a CLI user would write, a file to download and the command that runs it."""
        try:
            config = values_to_config(values)
        except ConfigError as e:
            return ExportShown(message=problems_markdown(e))
        path = Path(tempfile.mkdtemp(prefix="finetune-export-")) / "finetune-config.yaml"
        path.write_text(config_yaml(config, "finetune config, exported from the app.\nRun: finetune train "
                                    "finetune-config.yaml"), encoding="utf-8")
        return ExportShown(yaml=path.read_text(encoding="utf-8"), file=str(path),
                           command="finetune train finetune-config.yaml",
                           message="Exported: download the file, or copy the YAML.")

    def import_config(self, uploaded: str | None, *, request: Any = None) -> FormShown:
        """Fill every widget from a YAML config (its errors are the config's own)."""
        if not uploaded:
            return FormShown()
        if too_big := limits.config_size_problem(uploaded, is_file=True):  # before parsing: a 5 MB YAML takes minutes
            return FormShown(note=f"⚠️ {too_big}")
        try:
            config = load_config_file(uploaded)
        except ConfigError as e:  # in the file's words (its keys), not the form's: the file is what to fix
            return FormShown(note=f"⚠️ {problems_text(e)}")
        return FormShown(values=dict(zip(FIELD_NAMES, config_to_values(config), strict=True)),
                         note=f"Imported `{Path(uploaded).name}`.", yaml=config_yaml(config))
