"""A sweep whose trials run elsewhere, several at once: `finetune sweep cfg.yaml --backend hf-jobs|slurm
--parallel N`. Up to N trials are in flight, each an ordinary remote run started through a `Launcher` (the CLI
hands one in: this package imports no backend); Optuna is asked for a trial whenever one is free and told how each
ended as it ends.

Each in-flight trial is followed in a thread of its own (`Launcher.wait`, which mirrors the run's events into its
folder's events.jsonl); this thread reads those files, reports each evaluation's objective to its trial and, when
median pruning says so, cancels the trial's job. Only this thread talks to Optuna.

The study's journal still holds everything: a sweep killed outright resumes with `finetune sweep` again, re-attaching
to the trials still marked running whose run folder records a job (they went on remotely, or finished meanwhile)
and starting none of them again; a Stop (Ctrl-C) cancels the trials in flight, whose parameters run again as new
trials when it resumes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from finetune.config.schema import Config
from finetune.errors import FinetuneError, PlanError, describe
from finetune.run.events import read_events
from finetune.run.rundir import prune_checkpoints, write_json
from finetune.sweep.space import SweepSpec
from finetune.sweep.study import (
    LOCK_FILE,
    TRIAL_FILE,
    SweepResult,
    _distributions,
    _finished,
    _grid_size,
    _Lock,
    _study,
    _write_summary,
    optuna_module,
    trial_folder,
)
from finetune.sweep.summary import STATE_WORDS

POLL_S = 0.5  # how often the trials' events are read


class Launcher(Protocol):
    """Where the trials run (`finetune.remote.backend.Trials`: a backend with the options it was given)."""

    title: str  # in words: "Slurm", "Hugging Face Jobs"

    def launch(self, config: Config) -> None:
        """Start a run of `config` in its `output_dir` without following it; a `PlanError` when it cannot fit."""

    def launched(self, run_dir: Path) -> bool:
        """Whether `run_dir` records a job already started (to re-attach to)."""

    def wait(self, run_dir: Path) -> tuple[str, str]:
        """Follow the run to its end (its events landing in `run_dir`/events.jsonl): done, stopped or failed, and
        a sentence."""

    def cancel(self, run_dir: Path) -> None:
        """Cancel the run's job."""


@dataclass
class _Flight:
    """One trial in flight: its Optuna trial, run folder and sweep.json record, the thread following it, and what
    this sweep has read of it."""

    trial: Any
    run: Path
    record: dict[str, Any]
    end: list[Any] = field(default_factory=list)  # the thread's (status, sentence), or the error it met
    thread: threading.Thread | None = None
    reported: set[int] = field(default_factory=set)  # the steps already reported to the trial
    last: tuple[int, float] | None = None
    pruned: bool = False

    def follow(self, launcher: Launcher) -> _Flight:
        """Start the thread that waits for the run's end."""
        def wait() -> None:
            try:
                self.end.append(launcher.wait(self.run))
            except BaseException as e:  # handed to the sweep's thread, which raises it
                self.end.append(e)

        self.thread = threading.Thread(target=wait, name=f"trial-{self.trial.number}", daemon=True)
        self.thread.start()
        return self

    @property
    def ended(self) -> bool:
        """Whether the run's job ended (or following it failed)."""
        return bool(self.end)


def run_sweep_in_flight(config: Config, spec: SweepSpec, folder: Path, *, launcher: Launcher, parallel: int,
                        stop: Any, say: Callable[[str], None]) -> SweepResult:
    """Run the trials of `spec` that are left, up to `parallel` at once through `launcher`; `stop` is the sweep's
    stop flag (Ctrl-C), `say` where progress sentences go."""
    optuna = optuna_module()
    folder.mkdir(parents=True, exist_ok=True)
    with _Lock(folder / LOCK_FILE):
        study = _study(optuna, config, spec, folder)
        flights = _reattach(optuna, study, folder, launcher, say)
        total = min(spec.trials, _grid_size(spec))
        if done := _finished(optuna, study):
            say(f"resuming: {done} of {total} trial(s) already finished")
        try:
            while not stop.requested:
                while len(flights) < parallel and _finished(optuna, study) + len(flights) < total \
                        and not stop.requested:
                    flight = _launch(optuna, study, config, spec, folder, launcher, say)
                    if flight is not None:
                        flights[flight.trial.number] = flight.follow(launcher)
                    _write_summary(optuna, study, spec, folder)
                if not flights:
                    break
                time.sleep(POLL_S)
                for number, flight in list(flights.items()):
                    _read_evaluations(flight, spec, launcher, say)
                    if flight.ended:
                        del flights[number]
                        _settle(optuna, study, spec, flight, say)
                        _write_summary(optuna, study, spec, folder)
            if flights:
                _cancel_all(optuna, study, spec, flights, launcher, say)
        except FinetuneError:
            if flights:  # left running, not cancelled: what they trained is kept, and a resumed sweep uses it
                say(f"{len(flights)} trial(s) still run on {launcher.title}: `finetune sweep` again re-attaches to "
                    "them (`finetune jobs cancel RUN` stops one)")
            raise
        finally:
            summary = _write_summary(optuna, study, spec, folder)
    return SweepResult(status="stopped" if stop.requested else "done", folder=folder, summary=summary)


def _reattach(optuna: Any, study: Any, folder: Path, launcher: Launcher,
              say: Callable[[str], None]) -> dict[int, _Flight]:
    """The trials a killed sweep left running: followed again where their run folder records a job; failed, their
    parameters queued again, where the sweep was killed before the job started."""
    flights = {}
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        run = trial_folder(folder, t.number)
        if launcher.launched(run):
            record = _record(folder, t.number, t.params, study)
            reported = t.intermediate_values
            flight = _Flight(optuna.trial.Trial(study, t._trial_id), run, record, reported=set(reported),
                             last=max(reported.items()) if reported else None)
            write_json(run / TRIAL_FILE, {**record, "state": "running"})
            flights[t.number] = flight.follow(launcher)
            say(f"trial {t.number}: re-attached to its job on {launcher.title} ({run})")
        else:
            study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            say(f"trial {t.number}: the sweep was stopped before its job started; its parameters are tried again")
    return flights


def _record(folder: Path, number: int, params: dict[str, Any], study: Any) -> dict[str, Any]:
    """What the trial's sweep.json says of it (as a local trial's)."""
    user = study.user_attrs.get("sweep", {})
    return {"sweep": folder.name, "sweep_dir": str(folder), "trial": number, "params": params,
            "objective": user.get("objective"), "direction": user.get("direction")}


def _launch(optuna: Any, study: Any, config: Config, spec: SweepSpec, folder: Path, launcher: Launcher,
            say: Callable[[str], None]) -> _Flight | None:
    """Ask for a trial and start its run; None when its plan cannot fit the backend's hardware (pruned, never
    started)."""
    states = optuna.trial.TrialState
    trial = study.ask(_distributions(optuna, spec))
    run = trial_folder(folder, trial.number)
    trial.set_user_attr("run", run.name)
    shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
    c = config.replace(**trial.params, output_dir=str(run), overwrite=False, resume=False)
    try:
        launcher.launch(c)
    except PlanError as e:  # the backend's plan for its hardware
        trial.set_user_attr("reason", describe(e))
        study.tell(trial, state=states.PRUNED)
        say(f"trial {trial.number} ({shown}): pruned before it started: {describe(e)}")
        return None
    except FinetuneError as e:  # bad input every trial would meet, or the backend out of reach: the sweep ends
        trial.set_user_attr("reason", describe(e))  # here, in its words, and these parameters run again on resuming
        study.tell(trial, state=states.FAIL)
        study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
        raise
    record = {**_record(folder, trial.number, trial.params, study), "objective": spec.objective,
              "direction": spec.direction}
    write_json(run / TRIAL_FILE, {**record, "state": "running"})
    say(f"trial {trial.number} ({shown}): started on {launcher.title}, run folder {run}")
    return _Flight(trial, run, record)


def _read_evaluations(flight: _Flight, spec: SweepSpec, launcher: Launcher, say: Callable[[str], None]) -> None:
    """Report the run's new evaluations of the objective to its trial; cancel its job when the median pruner
    says the trial trails the others. Asked again at every look, not only after a new evaluation: trials run side
    by side, so the trials that the median is taken over often complete while this one waits for its next one."""
    for r in read_events(flight.run / "events.jsonl"):
        value = (r.get("metrics") or {}).get(spec.objective) if r.get("event") == "eval" else None
        if not isinstance(value, (int, float)) or r.get("step") in flight.reported:
            continue
        flight.reported.add(r["step"])
        flight.last = (int(r["step"]), float(value))
        flight.trial.report(float(value), int(r["step"]))
    if flight.last is None or flight.pruned or flight.ended or not flight.trial.should_prune():
        return
    flight.pruned = True
    step, value = flight.last
    say(f"trial {flight.trial.number}: {spec.objective} {value:.4g} at step {step} trails the median of the "
        "earlier trials there; cancelling its job")
    try:
        launcher.cancel(flight.run)
    except FinetuneError as e:
        say(f"trial {flight.trial.number}: could not cancel its job: {describe(e)}")


def _settle(optuna: Any, study: Any, spec: SweepSpec, flight: _Flight, say: Callable[[str], None]) -> None:
    """Tell the study how the trial's run ended, and write it into its sweep.json."""
    end = flight.end[0]
    if isinstance(end, BaseException):
        raise end  # the trial stays running in the journal: `finetune sweep` again re-attaches to it
    status, sentence = end
    states = optuna.trial.TrialState
    value, reason = None, None
    done = next((r for r in reversed(read_events(flight.run / "events.jsonl")) if r.get("event") == "done"), None)
    if status == "done":
        value = ((done or {}).get("metrics") or {}).get(spec.objective)
        state = states.COMPLETE if isinstance(value, (int, float)) and math.isfinite(value) else states.FAIL
        if state == states.FAIL:
            value, reason = None, f"the run logged no finite {spec.objective}"
    elif flight.pruned and flight.last is not None:
        prune_checkpoints(flight.run, keep=0)  # a pruned trial is never resumed (a shared folder holds them)
        step, last = flight.last
        state, reason = states.PRUNED, f"pruned at step {step}: {spec.objective} {last:.4g} trails the median of " \
                                       "the earlier trials there"
    else:  # failed, or stopped from outside the sweep (a cancel, its time limit)
        state, reason = states.FAIL, sentence
    if reason:
        flight.trial.set_user_attr("reason", reason)
    study.tell(flight.trial, value if state == states.COMPLETE else None, state=state, skip_if_finished=True)
    word = STATE_WORDS[state.name]
    write_json(flight.run / TRIAL_FILE, {**flight.record, "state": word, "value": value, "reason": reason})
    say(f"trial {flight.trial.number}: {word}" + (f", {spec.objective} {value:.4g}" if value is not None else "")
        + (f" ({reason})" if reason else ""))


def _cancel_all(optuna: Any, study: Any, spec: SweepSpec, flights: dict[int, _Flight], launcher: Launcher,
                say: Callable[[str], None]) -> None:
    """The sweep was stopped: cancel every trial in flight, wait for their jobs to end, and queue the parameters
    of those that did not finish to run again when the sweep resumes."""
    for flight in flights.values():
        if not flight.ended:
            say(f"trial {flight.trial.number}: cancelling its job on {launcher.title}")
            try:
                launcher.cancel(flight.run)
            except FinetuneError as e:
                say(f"trial {flight.trial.number}: could not cancel its job: {describe(e)}")
    for flight in flights.values():
        while not flight.ended:  # a second Ctrl-C leaves at once (the CLI's stop handler)
            time.sleep(POLL_S)
        end = flight.end[0]
        if flight.pruned or (isinstance(end, tuple) and end[0] == "done"):
            _settle(optuna, study, spec, flight, say)
            continue
        flight.trial.set_user_attr("reason", "stopped")
        study.tell(flight.trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        study.enqueue_trial(flight.trial.params, user_attrs={"retry_of": flight.trial.number})
        write_json(flight.run / TRIAL_FILE, {**flight.record, "state": "stopped"})
        say(f"trial {flight.trial.number}: stopped; `finetune sweep` again tries its parameters again")
