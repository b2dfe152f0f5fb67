"""Following the current run: the one poll (a timer tick, each page load, and each press that may have started or
queued a run) that refreshes every tab's view of the caller's run, and skips every update when nothing changed.

The tick comes every second while the caller's run trains or waits in the queue, and every five seconds otherwise
(nothing to follow but someone else's run, or a run starting from another tab): an idle page costs its browser less
than half as much and the server two thirds (a page with no run, 30 s, measured twice: Chromium 6.9 and 7.4 CPU-s
→ 3.2 and 3.3, the app 2.9 and 3.0 → 1.9 and 1.9).

The poll imports no tab. It works out once per tick what the caller may see (`Seen`: the run's status, whether it
is theirs, their queued runs, what changed since the page last looked) and hands that to each tab's own `refresh`,
in the order `app.tabs.REFRESHES` declares them: the Train tab's Run panel and Results, Try it's chat or text box
and its picker, the Export tab's Download, Push and Reproduce. Each returns its views by name, which the page wires
to that tab's components.

Someone else's run shows only that it is in progress, and at which step; the caller's own queued runs show their
positions (with Cancel), and nobody else's show at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import gradio as gr

from app.local.training import JobStatus
from app.report import reproduce_command, run_options, shown_path, waits_for
from app.results import keep
from app.state import AppState

POLL_S = 1.0  # the tick while the caller's run trains or is queued: its progress, curve and log each second
IDLE_POLL_S = 5.0  # otherwise; a press that starts a run polls at once (`app.tabs.Page.run_moves`)


@dataclass(frozen=True)
class RunShown:
    """What one tick of the poll shows: its signature (what it looked at, to tell next time whether anything
    changed) and the views of every tab's refresh by name; `views` None when nothing changed. A view no refresh
    gave (all of them, when nothing changed) is left as it is: reading it answers Gradio's skip (`keep()`), which
    leaves a group of views (Try it's panel) alone too."""

    signature: Any = keep()
    views: Mapping[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return (self.views or {}).get(name, gr.skip())


@dataclass
class Seen:
    """What the poll knows of the caller's run at one tick, worked out once and read by every tab's refresh."""

    state: AppState
    request: Any
    user: str | None
    refusal: str  # why the caller may not train here ("" when they may)
    status: JobStatus  # the run the caller may see: someone else's reads as idle
    mine: bool  # the current run is the caller's
    lines: tuple[str, ...]  # the caller's queued runs, one line each; otherwise whose run is in progress, or refusal
    queued: bool  # the caller has a run in the queue
    command: str  # the command that reproduces the run ("" without one)
    known: bool = False  # the page showed a run before (False: a new page)
    changed_run: bool = True  # another run, or the run's state changed
    newer_run: bool = False  # the current run is not the one the page showed
    new_command: bool = True  # the Reproduce box's command changed (a new run, a resume)
    new_interval: bool = True  # the tick's interval changed (a run started or ended), or a new page
    answers: dict[str, Any] = field(default_factory=dict)  # what the tabs asked for once (`once`)

    @property
    def new_model(self) -> bool:
        """Try it and Download read the model again: a new page, a newer run, or a finished one."""
        return not self.known or self.newer_run or self.status.state == "done"

    @property
    def signature(self) -> tuple[Any, ...]:
        """What this tick looked at; the same next time means nothing changed (its places are read by `compared`)."""
        status = self.status
        return (str(status.run_dir), len(status.events), status.state, status.message, status.output_tail,
                self.lines, self.command, self.interval)

    @property
    def interval(self) -> float:
        """Seconds to the next tick: each second while there is a run of the caller's to follow."""
        return POLL_S if self.status.active or self.queued else IDLE_POLL_S

    def compared(self, seen: Any) -> Seen:
        """This tick against what the page showed (`seen`: the last signature, None on a new page)."""
        status = self.status
        known = isinstance(seen, (list, tuple))
        changed_run = not known or list(seen[:1]) + list(seen[2:3]) != [str(status.run_dir), status.state]
        # The Reproduce box is rewritten only when the command changes (a new run, a resume): an import or an
        # export in between keeps its own YAML and command, and never shares the box with another config's.
        new_command = bool(self.command) and (not known or list(seen[6:7]) != [self.command])
        self.known, self.changed_run, self.new_command = known, changed_run, new_command
        self.new_interval = not known or list(seen[7:8]) != [self.interval]
        self.newer_run = known and seen[0] != str(status.run_dir)
        return self

    def shown_path(self, path: Any) -> str:
        """A run folder as the page shows it: on a shared server by its place in the runs folder (`runs/<user>/
        <run>`), as every message does, never by where the server keeps it."""
        return shown_path(path, self.state.runs_dir, self.state.access.shared) if path else ""

    @cached_property
    def options(self) -> dict[str, Any]:
        """The run's own `report_to` and `push_to_hub` (`app.report.run_options`)."""
        return run_options(self.status) if self.status.run_dir else {"report_to": [], "push_to_hub": None}

    def once(self, name: str, compute: Callable[[], Any]) -> Any:
        """What `compute` answers, worked out once in this tick however many tabs ask for it by `name` (the run
        pickers of Try it and Export: `app.picks.newest_pick`)."""
        if name not in self.answers:
            self.answers[name] = compute()
        return self.answers[name]


# A tab's refresh: its views of the run by name (the names its components are wired under), from one tick's `Seen`.
Refresh = Callable[[Seen], Mapping[str, Any]]


class Follow:
    """The poll of one app, over the tabs' refreshes."""

    def __init__(self, state: AppState, refreshes: Sequence[Refresh] = ()):
        self.state = state
        self.refreshes = tuple(refreshes)

    def seen(self, request: Any, seen: Any = None) -> Seen:
        """What the caller may see now (someone else's run: idle, and only that it is in progress), compared with
        what the page showed (`seen`)."""
        state, policy = self.state, self.state.policy
        user, refusal = policy.who(request)
        status = state.jobs.status()
        # A job whose launcher went away (the app restarted) is followed again once its owner is here to do so.
        if not refusal and state.remote.reattach(state.jobs.training, status, user, request):
            status = state.jobs.status()
        queued = self.queue_lines(user)
        mine = policy.is_mine(status, user)
        if mine:
            lines = tuple(queued)
        else:
            note = policy.in_progress(status) if status.active else ""
            status = JobStatus(state="idle")
            lines = (*(f"**{line}**" for line in (note, refusal) if line), *queued)
        return Seen(state=state, request=request, user=user, refusal=refusal, status=status, mine=mine, lines=lines,
                    queued=bool(queued), command=reproduce_command(status)).compared(seen)

    def queue_lines(self, user: str | None) -> list[str]:
        """One line for each of `user`'s queued runs: "Queued, position N" and its folder."""
        state = self.state
        return [f"**Queued, position {n}** — `{shown_path(q.run_dir, state.runs_dir, state.access.shared)}`: it "
                f"starts by itself when {waits_for(n)}." for q, n in state.jobs.queued(user)]

    def poll(self, seen: Any, *, request: Any = None) -> RunShown:
        """Every tab's view of the run, refreshed; everything left as it is when nothing changed."""
        now = self.seen(request, seen)
        if seen == now.signature:
            return RunShown()
        views: dict[str, Any] = {"timer": gr.Timer(now.interval)} if now.new_interval else {}
        for refresh in self.refreshes:
            views.update(refresh(now))
        return RunShown(signature=now.signature, views=views)
