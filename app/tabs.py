"""The app's handlers, tab by tab, over one shared state (`app.state.AppState`): what the page wires, what the
scripting API calls, and what the tests call without a page."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app import limits
from app.access import Access
from app.export.inference import InferenceExport
from app.export.publish import PushHandlers
from app.export.reproduce import ReproduceHandlers
from app.follow import Follow
from app.jobs.training import JobManager
from app.runs.tab import RunsHandlers
from app.state import AppState
from app.train.dataset import DatasetHandlers
from app.train.form import FieldNotes, FormHandlers
from app.train.plan import PlanHandlers
from app.train.run import RunHandlers
from app.train.sweep import SweepHandlers
from app.tryit.panel import TryItHandlers


@dataclass(frozen=True)
class Handlers:
    """Every tab's handlers of one app."""

    state: AppState
    notes: FieldNotes  # each field's help, shared by the Train tab's panels
    form: FormHandlers  # Train: the model's task, only the fields that apply, a reload's config
    dataset: DatasetHandlers  # Train: the preview, the upload, the first example, the Tasks table
    plan: PlanHandlers  # Train: Plan and the model's fit
    run: RunHandlers  # Train: Start, Stop, Resume
    sweep: SweepHandlers  # Train: Start sweep (its choices follow the task)
    follow: Follow  # the poll: every tab's view of the current run
    tryit: TryItHandlers  # Try it
    runs: RunsHandlers  # Runs
    publish: PushHandlers  # Export: Push to the Hub
    inference: InferenceExport  # Export: for local inference
    reproduce: ReproduceHandlers  # Export: Export and Import config


def handlers(runs_dir: Path, jobs: JobManager, *, access: Access | None = None, samples: tuple[Path, ...] = (),
             server_limits: limits.Limits = limits.LOCAL) -> Handlers:
    """The handlers of an app serving `runs_dir` whose training runs `jobs` starts; `samples` are the app's own
    data files, readable by every user (the preset's sample data, the shipped chat template)."""
    state = AppState.create(runs_dir, jobs, access=access, samples=samples, server_limits=server_limits)
    notes = FieldNotes()
    dataset = DatasetHandlers(state, notes)
    plan = PlanHandlers(state, notes)
    publish = PushHandlers(state)
    run = RunHandlers(state, notes, plan)
    return Handlers(state=state, notes=notes, form=FormHandlers(state, dataset.refresh_dataset), dataset=dataset,
                    plan=plan, run=run, sweep=SweepHandlers(state, run), follow=Follow(state),
                    tryit=TryItHandlers(state), runs=RunsHandlers(state), publish=publish,
                    inference=InferenceExport(state, publish), reproduce=ReproduceHandlers())
