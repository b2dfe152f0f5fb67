"""Running a sweep: an Optuna study kept in the sweep's folder, each trial planned into the memory budget and then
trained as an ordinary run beside it, pruned on its evaluation curve by the median of the trials before it.

    runs/my-sweep/             the sweep folder (`output_dir` of the config; default runs/sweep-<config name>)
      study.journal            Optuna's journal: every trial, its parameters, intermediate values and end
      summary.json             the trials and the best one (written after each trial)
      sweep.png                the objective against each searched option
    runs/my-sweep-trial-000/   trial 0: a run folder like any other, with sweep.json (its sweep and trial number)

One trial at a time, in this process. The study is the journal: `finetune sweep cfg.yaml` again after the process
was killed finds the trials that finished and runs only what is left; a trial the kill cut short (still marked
running) is marked failed and its parameters are tried again as a new trial.
"""

from __future__ import annotations

import gc
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.config.schema import Config
from finetune.config.versions import require
from finetune.data.load import load_data
from finetune.errors import InputError, PackageError, PlanError, RunDirError, TrainingError, describe
from finetune.models.pretrained import load_tokenizer
from finetune.plan.planner import plan_run
from finetune.run.events import Eval, Event
from finetune.run.rundir import prune_checkpoints, write_json
from finetune.sweep.space import SweepSpec
from finetune.sweep.summary import STATE_WORDS, plot_trials, summarize

STUDY_FILE = "study.journal"
LOCK_FILE = "sweep.pid"  # the process running the sweep: a second one on the same folder is refused
TRIAL_FILE = "sweep.json"  # in each trial's run folder (finetune.run.rundir.LAUNCH_FILES)
SUMMARY_FILE = "summary.json"
PLOT_FILE = "sweep.png"


def optuna_module() -> Any:
    """The `optuna` package, or one sentence on how to install it."""
    try:
        import optuna
    except ImportError:
        raise PackageError("`finetune sweep` searches with Optuna, which is not installed: pip install "
                           "'finetune[sweep]'.") from None
    require(("sweep",))
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep says what each trial did, in its own words
    return optuna


def sweep_folder(config: Config, config_path: str | Path) -> Path:
    """Where the sweep keeps its study: the config's `output_dir`, else runs/sweep-<the config file's name>."""
    return Path(config.output_dir or Path("runs") / f"sweep-{Path(config_path).stem}")


def trial_folder(folder: Path, number: int) -> Path:
    """The run folder of trial `number`, beside the sweep's folder (so the runs folder lists it as a run)."""
    return folder.parent / f"{folder.name}-trial-{number:03d}"


class TrialStop:
    """The stop a trial's run checks: the sweep's (Ctrl-C) or this trial's own (pruned)."""

    def __init__(self, sweep: Any) -> None:
        self.sweep, self.pruned = sweep, False

    @property
    def requested(self) -> bool:
        """Whether the run should stop after its optimizer step."""
        return self.pruned or bool(self.sweep.requested)


class Reporter:
    """Each evaluation's objective reported to the trial; median pruning may then stop the run."""

    def __init__(self, trial: Any, objective: str, stop: TrialStop) -> None:
        self.trial, self.objective, self.stop = trial, objective, stop
        self.last: tuple[int, float] | None = None

    def __call__(self, event: Event) -> None:
        if not isinstance(event, Eval) or not isinstance(event.metrics.get(self.objective), (int, float)):
            return
        self.last = (event.step, float(event.metrics[self.objective]))
        self.trial.report(self.last[1], self.last[0])
        if self.trial.should_prune():
            self.stop.pruned = True


@dataclass(frozen=True)
class SweepResult:
    """How the sweep ended (done, or stopped on request) and its summary (summary.json)."""

    status: str
    folder: Path
    summary: dict[str, Any]


def budget_refusal(c: Config) -> str | None:
    """Why trial config `c` cannot fit its memory budget (the planner's refusal, by its dry run), or None."""
    if c.memory_budget_gb is None or c.tasks:  # no budget to fit; a multi-task run plans in its loop
        return None
    train_data, _, label_names = load_data(c, load_tokenizer(c), num_processes=1)
    try:
        plan_run(c.replace(plan_probe="false"), train_data.widths, label_names, num_processes=1, device=None)
    except PlanError as e:
        return describe(e)
    return None


def run_sweep(config: Config, spec: SweepSpec, folder: Path, *, train: Callable[..., Any], stop: Any,
              say: Callable[[str], None], callbacks: list[Callable[[Event], None]] | None = None) -> SweepResult:
    """Run the trials of `spec` that are left, one at a time; `train` is `finetune.train.loop.train` (it trains a
    config, with `stop` and `callbacks`), `stop` the sweep's stop flag, `say` where progress sentences go."""
    optuna = optuna_module()
    folder.mkdir(parents=True, exist_ok=True)
    with _Lock(folder / LOCK_FILE):
        study = _study(optuna, config, spec, folder)
        for retried in _recover(optuna, study, folder):
            say(f"trial {retried}: cut short when the sweep was stopped; its parameters are tried again")
        total = min(spec.trials, _grid_size(spec))
        done = _finished(optuna, study)
        if done:
            say(f"resuming: {done} of {total} trial(s) already finished")
        status = "done"
        while _finished(optuna, study) < total:
            if stop.requested:
                status = "stopped"
                break
            _one_trial(optuna, study, config, spec, folder, train=train, stop=stop, say=say,
                       callbacks=callbacks or [])
            _write_summary(optuna, study, spec, folder)
        summary = _write_summary(optuna, study, spec, folder)
    return SweepResult(status="stopped" if stop.requested else status, folder=folder, summary=summary)


def _study(optuna: Any, config: Config, spec: SweepSpec, folder: Path) -> Any:
    """The folder's study, created on the first run; a folder that holds another search is refused."""
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(folder / STUDY_FILE)))
    pruner = optuna.pruners.MedianPruner(n_startup_trials=spec.startup_trials) if spec.pruning == "median" \
        else optuna.pruners.NopPruner()
    study = optuna.create_study(storage=storage, study_name=folder.name, pruner=pruner, direction=spec.direction,
                                load_if_exists=True)
    # A resumed TPE search starts from the seed moved on by the trials the study holds: from the same seed it would
    # draw the first trials' values again (its first trials are random). The grid keeps its seed, which orders the
    # grid that its trials' numbers index.
    moved = spec.seed + len(study.get_trials(deepcopy=False))
    study.sampler = _grid(optuna)({p.name: list(p.choices) for p in spec.space}, seed=spec.seed) \
        if spec.sampler == "grid" else optuna.samplers.TPESampler(seed=moved)
    mine = json.loads(json.dumps({"sweep": spec.to_dict(), "config": config.to_dict()}))
    if not study.user_attrs:
        for key, value in mine.items():
            study.set_user_attr(key, value)
    elif {k: study.user_attrs.get(k) for k in mine} != mine:
        raise RunDirError(f"The sweep folder {str(folder)!r} holds a study of another search or config: choose "
                          "another output_dir for this one, or delete that folder to start it again.")
    return study


def _grid(optuna: Any) -> type:
    """Optuna's grid sampler for ask-and-tell: this loop stops at its own count of trials, and the sampler's
    `after_trial` would call `Study.stop` once the grid is visited, which only `Study.optimize`'s loop may."""

    class Grid(optuna.samplers.GridSampler):
        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            """Nothing: the sweep counts its trials itself."""

    return Grid


def _distributions(optuna: Any, spec: SweepSpec) -> dict[str, Any]:
    d = optuna.distributions
    out = {}
    for p in spec.space:
        if p.choices is not None:
            out[p.name] = d.CategoricalDistribution(p.choices)
        elif p.integer:
            out[p.name] = d.IntDistribution(int(p.low), int(p.high), log=p.log, step=int(p.step or 1))
        else:
            out[p.name] = d.FloatDistribution(p.low, p.high, log=p.log, step=p.step)
    return out


def _grid_size(spec: SweepSpec) -> int:
    """How many different trials the grid has (a TPE search: no limit)."""
    return math.prod(len(p.choices) for p in spec.space) if spec.sampler == "grid" else spec.trials


def _retried(study: Any) -> set[int]:
    return {t.user_attrs["retry_of"] for t in study.get_trials(deepcopy=False) if "retry_of" in t.user_attrs}


def _finished(optuna: Any, study: Any) -> int:
    """Trials that count: complete, pruned, or failed (but not those cut short, whose parameters run again)."""
    ended = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    retried = _retried(study)
    return sum(1 for t in study.get_trials(deepcopy=False, states=ended) if t.number not in retried)


def _recover(optuna: Any, study: Any, folder: Path) -> list[int]:
    """Trials a killed sweep left running: failed, their parameters queued again, their runs' sweep.json saying
    so. Returns their numbers."""
    stale = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    for t in stale:
        study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
        record = trial_folder(folder, t.number) / TRIAL_FILE
        if record.is_file():
            write_json(record, {**json.loads(record.read_text(encoding="utf-8")), "state": "retried"})
    return [t.number for t in stale]


def _one_trial(optuna: Any, study: Any, config: Config, spec: SweepSpec, folder: Path, *, train: Callable[..., Any],
               stop: Any, say: Callable[[str], None], callbacks: list[Callable[[Event], None]]) -> None:
    """Ask for a trial, plan it into the budget, train it as a run, and tell the study how it ended."""
    states = optuna.trial.TrialState
    trial = study.ask(_distributions(optuna, spec))
    run = trial_folder(folder, trial.number)
    trial.set_user_attr("run", run.name)
    shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
    c = config.replace(**trial.params, output_dir=str(run), overwrite=False, resume=False)
    if reason := budget_refusal(c):
        trial.set_user_attr("reason", reason)
        study.tell(trial, state=states.PRUNED)
        say(f"trial {trial.number} ({shown}): pruned before it started: {reason}")
        return
    say(f"trial {trial.number} ({shown}): training in {run}")
    record = {"sweep": folder.name, "sweep_dir": str(folder), "trial": trial.number, "params": trial.params,
              "objective": spec.objective, "direction": spec.direction}
    run.mkdir(parents=True, exist_ok=True)
    write_json(run / TRIAL_FILE, {**record, "state": "running"})
    trial_stop = TrialStop(stop)
    reporter = Reporter(trial, spec.objective, trial_stop)
    state, value, reason = states.FAIL, None, None
    try:
        result = train(c, stop=trial_stop, callbacks=[reporter, *callbacks])
    except PlanError as e:  # the probe's measure on the loaded model: still before the first step
        state, reason = states.PRUNED, describe(e)
    except TrainingError as e:  # this trial's settings cannot train (diverged, out of memory): the next may
        reason = describe(e)
    except InputError as e:  # bad input every trial would meet: the sweep ends here, in the error's words
        trial.set_user_attr("reason", describe(e))
        study.tell(trial, state=states.FAIL)
        write_json(run / TRIAL_FILE, {**record, "state": "failed", "reason": describe(e)})
        raise
    else:
        if result.status == "stopped" and trial_stop.pruned:
            prune_checkpoints(run, keep=0)  # a pruned trial is never resumed
            step, last = reporter.last
            state, reason = states.PRUNED, f"pruned at step {step}: {spec.objective} {last:.4g} trails the median " \
                                           "of the earlier trials there"
        elif result.status == "stopped":  # the sweep was stopped: these parameters run again on resuming
            trial.set_user_attr("reason", "stopped")
            study.tell(trial, state=states.FAIL)
            study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
            write_json(run / TRIAL_FILE, {**record, "state": "stopped"})
            say(f"trial {trial.number}: stopped; `finetune sweep` again tries its parameters again")
            return
        else:
            value = result.metrics.get(spec.objective)
            if isinstance(value, (int, float)) and math.isfinite(value):
                state = states.COMPLETE
            else:
                value, reason = None, f"the run logged no finite {spec.objective}"
    finally:
        _release_memory()
    if reason:
        trial.set_user_attr("reason", reason)
    study.tell(trial, value if state == states.COMPLETE else None, state=state)
    word = STATE_WORDS[state.name]
    write_json(run / TRIAL_FILE, {**record, "state": word, "value": value, "reason": reason})
    say(f"trial {trial.number}: {word}" + (f", {spec.objective} {value:.4g}" if value is not None else "")
        + (f" ({reason})" if reason else ""))


def _release_memory() -> None:
    """A fresh accelerate state and an empty device for the next trial, which starts in this same process."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _write_summary(optuna: Any, study: Any, spec: SweepSpec, folder: Path) -> dict[str, Any]:
    """summary.json and sweep.png, from the study as it stands."""
    summary = summarize(study.get_trials(deepcopy=False), spec, retried=_retried(study), name=folder.name)
    write_json(folder / SUMMARY_FILE, summary)
    if any(t["value"] is not None for t in summary["trials"]):
        plot_trials(summary, spec, folder / PLOT_FILE)
    return summary


class _Lock:
    """The sweep folder's pid file: one process runs a sweep at a time (a dead process's file is taken over)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> _Lock:
        try:
            pid = int(self.path.read_text(encoding="utf-8").strip())
        except (OSError, ValueError):
            pid = None
        if pid is not None and pid != os.getpid() and _alive(pid):
            raise RunDirError(f"Another process ({pid}) is running the sweep in {str(self.path.parent)!r}: wait "
                              "for it or stop it first.")
        self.path.write_text(str(os.getpid()), encoding="utf-8")
        return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
