"""The app's tabs and their handlers, over one shared state (`app.state.AppState`): the handlers are what the page
wires, what the scripting API calls, and what the tests call without a page.

Each tab's module (`app.<tab>.tab`) exports the same three things: `build(page)`, its widgets inside the open
`gr.Tab`; `wire(page, tab)`, its events; and, for the tabs that show the current run, `refresh(seen)`, its view of
that run for the poll (`app.follow`). `TABS` lists them in the page's order and `REFRESHES` the poll's; the page
(`app.page`) composes them, and adding a tab is one module and one line here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.door import limits
from app.door.access import Access
from app.export import tab as export_tab
from app.export.inference import InferenceExport
from app.export.publish import PushHandlers
from app.export.reproduce import ReproduceHandlers
from app.follow import Follow, Refresh
from app.local.training import JobManager
from app.runs import tab as runs_tab
from app.runs.tab import RunsHandlers
from app.state import AppState
from app.train import tab as train_tab
from app.train.dataset import DatasetHandlers
from app.train.form import FieldNotes, Form, FormHandlers
from app.train.plan import PlanHandlers
from app.train.run import RunHandlers
from app.train.sweep import SweepHandlers
from app.tryit import tab as tryit_tab
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
                    plan=plan, run=run, sweep=SweepHandlers(state, run), follow=Follow(state, REFRESHES),
                    tryit=TryItHandlers(state), runs=RunsHandlers(state), publish=publish,
                    inference=InferenceExport(state, publish), reproduce=ReproduceHandlers(state.downloads))


@dataclass
class Page:
    """What each tab's `build` and `wire` are handed: the door every event goes through (`RequestPolicy.on`), every
    tab's handlers, the page's load event and what the page places itself (the form, the note over it); and, as the
    page is built, each tab's components and its select event, by the tab's id (for the events that cross tabs)."""

    on: Callable[..., Any]
    h: Handlers
    load: Any  # the page's load event
    form: Form  # the config form, from the preset and this machine (the Train tab places it)
    form_note: Any  # the note over the form: which run or file its values came from
    run_on: list[tuple[str, str]] | None = None  # the places to run this app offers (the Train tab's Run on)
    built: dict[str, Any] = field(default_factory=dict)  # tab id → what its `build` returned
    selected: dict[str, Any] = field(default_factory=dict)  # tab id → its `gr.Tab`'s select event
    # The presses after which the caller's run may have started, resumed or left the queue, as each tab wires them:
    # the poll follows each at once (an idle page ticks every five seconds, `app.follow`).
    run_moves: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class Tab:
    """One tab of the page: its title, its id (`#tab-<id>` on the page), and its module's build and wiring."""

    title: str
    id: str
    build: Callable[[Page], Any]
    wire: Callable[[Page, Any], None]


# The page's tabs, in order: one step of the work each (train, try the model, look back, take it away).
TABS: tuple[Tab, ...] = (Tab("Train", "train", train_tab.build, train_tab.wire),
                         Tab("Try it", "try", tryit_tab.build, tryit_tab.wire),
                         Tab("Runs", "runs", runs_tab.build, runs_tab.wire),
                         Tab("Export", "export", export_tab.build, export_tab.wire))
# What the poll (`app.follow`) refreshes, tab by tab, in this order: each tab's `refresh` of the current run.
REFRESHES: tuple[Refresh, ...] = (train_tab.refresh, tryit_tab.refresh, export_tab.refresh)
