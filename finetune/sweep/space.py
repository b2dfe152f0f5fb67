"""The `sweep:` section of a config: what to search (each option's range or choices), what to optimise (a metric
the run logs, and its direction) and how (the sampler, the number of trials, median pruning).

Everything here is checked before a trial runs, against the schema (a value the schema refuses is refused here,
with the schema's sentence) and against the metrics the task kind logs (`finetune.registry.Entry.metrics`), so that a
typo in the search is one sentence and exit 2, not a failure an hour into the sweep. Imports no optimisation
library: the search's description is plain data, which `finetune.sweep.study` hands to Optuna.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import registry
from finetune.config.schema import (
    FIELDS,
    Config,
    field_type,
    from_dict,
    is_list_field,
    parse_overrides,
    read_yaml,
    unknown_key_message,
)
from finetune.errors import ConfigError, summary

SECTION = "sweep"
KEYS = ("objective", "direction", "trials", "sampler", "space", "pruning", "startup_trials", "seed")
SAMPLERS = ("tpe", "grid")
DIRECTIONS = ("maximize", "minimize")
RANGE_KEYS = ("low", "high", "log", "step")
# Where a trial's run goes is the sweep's to decide; a list of names or of tasks is no single value to sample.
NOT_SWEPT = ("output_dir", "resume", "overwrite", "tasks", "push_to_hub")
# What the `done` event (metrics.json) adds to the final evaluation's metrics: an objective may name them too.
RUN_FIGURES = ("train_seconds", "train_samples_per_s")
EVAL_PREFIX = "eval/"  # `eval/accuracy` is `accuracy` of the eval events, as trackers name it
MAX_TRIALS = 10_000


@dataclass(frozen=True)
class Param:
    """One searched option: a range (`low`..`high`, `log`, `step`) or a list of `choices`."""

    name: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None

    @property
    def integer(self) -> bool:
        """Whether the option takes whole numbers (its range is sampled as integers)."""
        return field_type(self.name)[0] is int

    def to_dict(self) -> dict[str, Any]:
        """As the config spells it."""
        if self.choices is not None:
            return {self.name: list(self.choices)}
        spec = {"low": self.low, "high": self.high, "log": self.log}
        return {self.name: spec | ({"step": self.step} if self.step is not None else {})}


@dataclass(frozen=True)
class SweepSpec:
    """A checked `sweep:` section."""

    objective: str  # the metric's name as the run's events and metrics.json spell it (`eval/` taken off)
    direction: str
    trials: int
    sampler: str
    space: tuple[Param, ...]
    pruning: str = "median"
    startup_trials: int = 2  # completed trials median pruning waits for before it prunes
    seed: int = 42

    def to_dict(self) -> dict[str, Any]:
        """As the config spells it (what a resumed sweep compares with the study it finds)."""
        space: dict[str, Any] = {}
        for p in self.space:
            space.update(p.to_dict())
        return {"objective": self.objective, "direction": self.direction, "trials": self.trials,
                "sampler": self.sampler, "space": space, "pruning": self.pruning,
                "startup_trials": self.startup_trials, "seed": self.seed}


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> tuple[Config, SweepSpec]:
    """The run config and the checked sweep of a config file with a `sweep:` section (`key=value` overrides apply
    to the run config)."""
    values = read_yaml(path)
    section = values.pop(SECTION, None)
    if section is None:
        raise ConfigError([f"Config file {str(path)!r} has no `{SECTION}:` section: add one with `objective`, "
                           "`direction` and `space` (docs/sweeps.md)."])
    values.update(parse_overrides(overrides or []))
    config = from_dict(values)
    return config, parse_spec(section, config)


def parse_spec(section: Any, config: Config) -> SweepSpec:
    """The `sweep:` mapping checked against the schema and the metrics `config`'s kind logs; every problem is one
    sentence of one `ConfigError`."""
    if not isinstance(section, dict):
        raise ConfigError([f"`{SECTION}` must be a mapping (objective, direction, trials, space, …), not "
                           f"{summary(section)}."])
    problems = [f"Unknown `{SECTION}` key `{key}`: it takes {', '.join(KEYS)}." for key in section if key not in KEYS]
    objective = _objective(section.get("objective"), config, problems)
    direction = section.get("direction")
    if direction not in DIRECTIONS:
        problems.append(f"`{SECTION}.direction` must be maximize or minimize (whether a larger {objective or 'value'}"
                        f" is better), not {summary(direction)}.")
    trials = _whole(section.get("trials", 10), "trials", 1, problems)
    startup = _whole(section.get("startup_trials", 2), "startup_trials", 0, problems)
    seed = _whole(section.get("seed", config.seed), "seed", 0, problems)
    sampler = section.get("sampler", "tpe")
    if sampler not in SAMPLERS:
        problems.append(f"`{SECTION}.sampler` must be tpe or grid, not {summary(sampler)}.")
    pruning = section.get("pruning", "median")
    if pruning not in ("median", "none"):
        problems.append(f"`{SECTION}.pruning` must be median or none, not {summary(pruning)}.")
    space = _space(section.get("space"), config, problems)
    if sampler == "grid" and any(p.choices is None for p in space):
        ranged = next(p.name for p in space if p.choices is None)
        problems.append(f"`{SECTION}.sampler: grid` tries every combination of listed values, but `{ranged}` is a "
                        "range: list its values ([1.0e-5, 1.0e-4]) or use sampler: tpe.")
    if problems:
        raise ConfigError(problems)
    return SweepSpec(objective=objective, direction=direction, trials=trials, sampler=sampler, space=space,
                     pruning=pruning, startup_trials=startup, seed=seed)


def logged_metrics(config: Config) -> tuple[str, ...]:
    """The metrics a run of `config` logs, by the names an objective may use: the evaluation's loss and its kind's
    metrics (each task's too, as `<task>/<metric>`, in a multi-task run), and the run's training figures."""
    evaluated = ("loss", *registry.entry(config.task).metrics)
    per_task = tuple(f"{t.name}/{m}" for t in config.tasks or () for m in evaluated)
    return (*evaluated, *per_task, *RUN_FIGURES)


def _objective(value: Any, config: Config, problems: list[str]) -> str:
    logged = logged_metrics(config)
    if not isinstance(value, str) or not value.strip():
        problems.append(f"`{SECTION}.objective` names the metric to optimise, one of {', '.join(logged)} (as the run "
                        "logs it; `eval/accuracy` also works).")
        return ""
    name = value.strip().removeprefix(EVAL_PREFIX)
    if name not in logged:
        problems.append(f"`{SECTION}.objective` {value!r} is not a metric a task={config.task} run logs: use one of "
                        f"{', '.join(logged)}.")
    elif name not in RUN_FIGURES and not _evaluates(config):
        problems.append(f"`{SECTION}.objective` {value!r} is an evaluation metric, but the config holds out no "
                        "evaluation data: set eval_dataset, eval_split or eval_fraction above 0.")
    return name


def _evaluates(config: Config) -> bool:
    """Whether the run evaluates (a multi-task run: its tasks say, each its own way)."""
    return bool(config.tasks or config.eval_dataset or config.eval_split or config.eval_fraction > 0)


def _whole(value: Any, key: str, least: int, problems: list[str]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        problems.append(f"`{SECTION}.{key}` must be a whole number of at least {least}, not {summary(value)}.")
        return least
    if key == "trials" and value > MAX_TRIALS:
        problems.append(f"`{SECTION}.trials` must be at most {MAX_TRIALS:,}, not {value}.")
    return value


def _space(space: Any, config: Config, problems: list[str]) -> tuple[Param, ...]:
    if not isinstance(space, dict) or not space:
        problems.append(f"`{SECTION}.space` is empty: name at least one option to search, with a range "
                        "(learning_rate: {low: 1.0e-5, high: 1.0e-3, log: true}) or a list of values (lora_r: "
                        "[8, 16, 32]).")
        return ()
    params = []
    for name, spec in space.items():
        where = f"`{SECTION}.space.{name}`"
        if name not in FIELDS:
            problems.append(f"{where}: {unknown_key_message(str(name))}")
        elif name in NOT_SWEPT or is_list_field(name):
            problems.append(f"{where}: `{name}` is not a single value a trial can take; search numbers or choices.")
        elif isinstance(spec, list):
            params += _choices(name, spec, config, where, problems)
        elif isinstance(spec, dict):
            params += _range(name, spec, config, where, problems)
        else:
            problems.append(f"{where} must be a list of values or a range {{low, high}}, not {summary(spec)}.")
    return tuple(params)


def _value(name: str, value: Any, config: Config, where: str, problems: list[str]) -> Any:
    """`value` as option `name` takes it in `config`, or None with the schema's sentence added to `problems`."""
    try:
        return getattr(config.replace(**{name: value}), name)
    except ConfigError as e:
        problems.append(f"{where}: {e.problems[0]}")
        return None


def _choices(name: str, spec: list, config: Config, where: str, problems: list[str]) -> list[Param]:
    if not spec:
        problems.append(f"{where} lists no value: give at least one.")
        return []
    before = len(problems)
    values = [_value(name, v, config, where, problems) for v in spec]
    if len(problems) > before:
        return []
    return [Param(name, choices=tuple(dict.fromkeys(values)))]


def _range(name: str, spec: dict, config: Config, where: str, problems: list[str]) -> list[Param]:
    base = field_type(name)[0]
    if base not in (int, float):
        problems.append(f"{where}: `{name}` is not a number, so it takes a list of values, not a range.")
        return []
    unknown = [k for k in spec if k not in RANGE_KEYS]
    if unknown or "low" not in spec or "high" not in spec:
        problems.append(f"{where} must be {{low, high}} with optional log and step, not {summary(spec)}.")
        return []
    before = len(problems)
    low, high = (_value(name, spec[k], config, where, problems) for k in ("low", "high"))
    log, step = spec.get("log", False), spec.get("step")
    if len(problems) > before:
        return []
    if not low < high:
        problems.append(f"{where}: low ({low:g}) must be below high ({high:g}).")
    elif not isinstance(log, bool):
        problems.append(f"{where}: log must be true or false, not {summary(log)}.")
    elif log and low <= 0:
        problems.append(f"{where}: a log range needs low above 0, not {low:g}.")
    elif step is not None and (isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0 or log
                               or (base is int and not float(step).is_integer())):
        problems.append(f"{where}: step must be a positive {'whole ' if base is int else ''}number, without log, "
                        f"not {summary(step)}.")
    else:
        return [Param(name, low=low, high=high, log=log, step=None if step is None else base(step))]
    return []
