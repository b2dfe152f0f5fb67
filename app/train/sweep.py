"""Start sweep: the form as every trial's base config and the Sweep section's search (`app.train.sweep_form`),
checked as a Start is checked and then some, written as one config with a `sweep:` section, and run as one queue
entry: `finetune sweep` in the job manager's child, as a training run is (Stop stops it; the Run panel follows its
trials, `app.local.sweeps`).

Nothing runs or is written until every check has passed: who asks (the same door and rules as Start: who may
train, the caller's own runs folder, the data they may read), the sweep's name, the search as `finetune sweep`
checks it (an empty space, a range the schema refuses, an objective the task never logs), the server's limit of
trials (`--max-trials`), each searched value against the server's limits of a run, then Start's own checks (the
data, the plan, the disk). A sweep started again under the same name, with the same settings, goes on where it was:
the study in its folder keeps the finished trials.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import gradio as gr
import yaml

from app.door import limits
from app.door.access import new_run_name
from app.local.sweeps import VERB
from app.local.training import JobBusy
from app.mapping import FIELD_NAMES, changed_options, config_yaml, problems_text, values_to_config
from app.remote.choice import LOCAL
from app.report import display_path, queued_words, shown_path
from app.state import AppState
from app.train.run import RunHandlers, Started
from app.train.sweep_form import SWEEP_INPUTS, direction_for, objectives, sweep_section
from finetune.config.schema import Config, ConfigError, from_dict, read_yaml
from finetune.run.rundir import MARKER, mark_run_dir
from finetune.sweep.space import SECTION, SweepSpec, parse_spec
from finetune.sweep.study import STUDY_FILE, SUMMARY_FILE

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
LAUNCH = "launch.yaml"  # the sweep's config as the app started it (its folder's, as a run's)


class SweepHandlers:
    """Start sweep, and the Sweep section's choices that follow the form's task."""

    def __init__(self, state: AppState, run: RunHandlers):
        self.state, self.run = state, run

    def objective_choices(self, task: str, *, request: Any = None) -> dict[str, Any]:
        """The objectives of the chosen task (its first metric picked), and the direction that suits it."""
        names = objectives(task)
        return {"objective": gr.update(choices=names, value=names[0]), "direction": direction_for(names[0])}

    def direction(self, objective: str, *, request: Any = None) -> str:
        """The direction that suits the picked objective (minimize a loss, maximize an accuracy)."""
        return direction_for(objective)

    def start_on(self, run_on: str, *values: Any, request: Any = None) -> Started:
        """Start sweep as the page presses it, with the Run panel's "Run on": this machine only, for now."""
        if run_on != LOCAL:
            return Started(started=False, message="A sweep runs its trials on this machine: set Run on to This "
                                                  "machine (the app does not send a sweep to another backend yet).")
        return self.start(*values, request=request)

    def start(self, *values: Any, request: Any = None) -> Started:
        """Start a sweep: `values` are the Sweep section's (`SWEEP_INPUTS`' order), then the form's (`FIELD_NAMES`').
        A refusal is one sentence (or a short list), and nothing is written."""
        mine = dict(zip(SWEEP_INPUTS, values[:len(SWEEP_INPUTS)], strict=True))
        form = values[len(SWEEP_INPUTS):len(SWEEP_INPUTS) + len(FIELD_NAMES)]
        user, refusal = self.state.policy.who(request)
        if refusal:
            return Started(started=False, message=refusal)
        try:
            config = values_to_config(form)
            name = self._name(mine.get("name"))
            section = sweep_section(mine)
            spec = parse_spec(section, config)
        except ConfigError as e:
            return Started(started=False, message=problems_text(e))
        if refused := self._over_limits(config, spec):
            return Started(started=False, message=refused)
        try:
            with self.state.jobs.preparing(user):
                return self._start_checked(config.replace(output_dir=name, resume=False, overwrite=False), spec,
                                           user, request)
        except JobBusy as e:
            return Started(started=False, message=str(e))

    @staticmethod
    def _name(typed: Any) -> str:
        """The sweep's folder name: the one typed, else sweep-<date and time>."""
        text = str(typed or "").strip()
        if not text:
            return f"sweep-{new_run_name(False)}"
        if not NAME.fullmatch(text) or text.endswith(".") or "-trial-" in text:
            raise ConfigError([f"Sweep name {text[:80]!r} must be a folder name of at most 64 letters, digits, dots, "
                               "dashes and underscores (no '-trial-': its trials are named so), e.g. lr-search."])
        return text

    def _over_limits(self, config: Config, spec: SweepSpec) -> str:
        """Why this server refuses the sweep: more trials than it allows, or a searched value above its limit of a
        run (the highest epochs, the largest batch); "" when it may run."""
        server = self.state.jobs.limits
        if server.max_trials is not None and spec.trials > server.max_trials:
            return (f"Trials = {spec.trials} is above this server's limit of {server.max_trials} trials per sweep: "
                    "lower it.")
        for p in spec.space:
            for value in p.choices if p.choices is not None else (p.low, p.high):
                if problems := limits.check(config.replace(**{p.name: value}), server):
                    return f"The sweep's {p.name} = {value:g}: {problems[0]}"
        if "lora_r" in {p.name for p in spec.space} and config.lora == "false":
            return ("LoRA rank choices are searched, but LoRA is off (Advanced → LoRA: false): set LoRA to true or "
                    "auto, or leave the rank choices empty.")
        return ""

    def _start_checked(self, config: Config, spec: SweepSpec, user: str | None, request: Any) -> Started:
        folder = self.run.checks(config, user)
        if isinstance(folder, Started):
            return folder
        if taken := self.state.jobs.taken(folder):
            return Started(started=False, message=taken)
        shown = shown_path(folder, self.state.runs_dir, self.state.access.shared)
        config = from_dict({**changed_options(config), "output_dir": display_path(folder)})
        if refused := _folder_refusal(folder, shown, config, spec):
            return Started(started=False, message=refused)
        finished = _finished(folder)
        config_path = folder / LAUNCH
        command = f"finetune sweep {display_path(config_path)}"
        mark_run_dir(folder)
        header = f"Written by the finetune app, {time.strftime('%Y-%m-%d %H:%M')}.\nReproduce: {command}"
        config_path.write_text(config_yaml(config, header) + yaml.safe_dump({SECTION: spec.to_dict()},
                                                                              sort_keys=False), encoding="utf-8")
        try:
            position = self.state.jobs.start(config_path, folder, owner=user, verb=VERB)
        except JobBusy as e:
            return Started(started=False, message=str(e))
        what = f"Sweep `{shown}` ({spec.trials} trials of {spec.objective}, {spec.direction})"
        if finished:
            what += f", going on after the {finished} trial(s) it finished"
        if position:
            return Started(started=False, queued=True, position=position, run_dir=shown, command=command,
                           message=f"{what}: {queued_words(position)} Reproduce from a terminal with `{command}`.")
        return Started(started=True, run_dir=shown, command=command,
                       message=f"{what} started. Reproduce from a terminal with `{command}`.")


def _folder_refusal(folder: Path, shown: str, config: Config, spec: SweepSpec) -> str:
    """Why the sweep cannot go into `folder`: it is a run's folder (or another program's), or a sweep of other
    settings ("" for a new folder, or this same sweep to go on with)."""
    if not folder.exists():
        if earlier := sorted(folder.parent.glob(f"{folder.name}-trial-*")):
            return (f"Trials of an earlier sweep named {folder.name} are still in your runs ({earlier[0].name}, …): "
                    "choose another sweep name, or delete them in the Runs tab.")
        return ""
    if not (folder / MARKER).is_file() or not (folder / LAUNCH).is_file():
        return f"`{shown}` is a folder the app did not make for a sweep: choose another sweep name."
    section = None
    try:
        values = read_yaml(folder / LAUNCH)
        section = values.pop(SECTION, None)
        before = from_dict(values)
        same = section is not None and before == config and parse_spec(section, before) == spec
    except (ConfigError, OSError, ValueError):
        same = False
    if section is None:
        return f"`{shown}` is a run's folder, not a sweep's: choose another sweep name."
    if not same:
        return (f"The sweep `{shown}` was started with other settings: choose another sweep name for these, or "
                "delete that sweep in the Runs tab to start it again.")
    return ""


def _finished(folder: Path) -> int:
    """How many trials the sweep in `folder` has ended (0 for a new one): its summary's count."""
    if not (folder / STUDY_FILE).is_file():
        return 0
    try:
        counts = json.loads((folder / SUMMARY_FILE).read_text(encoding="utf-8")).get("counts") or {}
    except (OSError, ValueError, AttributeError):
        return 0
    return sum(v for k, v in counts.items() if k in ("complete", "pruned", "failed") and isinstance(v, int))
