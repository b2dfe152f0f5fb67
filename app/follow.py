"""Following the current run: the one poll (a timer tick every second, and each page load) that refreshes every
tab's view of the caller's run — the Run panel and Results (Train), Try it's chat or text box, the Export tab's
Download and Push — and skips every update when nothing changed.

Someone else's run shows only that it is in progress, and at which step; the caller's own queued runs show their
positions (with Cancel), and nobody else's show at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from app import charts
from app.export import publish
from app.jobs.training import JobStatus
from app.picks import picker_update
from app.report import final_metrics, reproduce_command, shown_path, waits_for
from app.results import keep
from app.state import AppState
from app.train import run_report, scatter
from app.tryit.panel import TryPanel, panel

TERMINAL = ("stopped", "done", "failed")


@dataclass(frozen=True, kw_only=True)
class RunShown:
    """The run panel and results, refreshed by the poll; all left as they are when nothing changed."""

    signature: Any = keep()  # what the poll last showed, to tell whether anything changed
    status: Any = keep()
    progress: Any = keep()
    stats: Any = keep()
    loss_curve: Any = keep()
    log: Any = keep()
    metrics: Any = keep()
    run_dir: Any = keep()
    start_button: Any = keep()  # enabled: a Start while a run trains is queued
    stop_button: Any = keep()
    resume_button: Any = keep()
    cancel_button: Any = keep()  # shown while the caller has a run in the queue
    command: Any = keep()  # the Reproduce box: the run's command and its config (the YAML and a file emptied)
    config_yaml: Any = keep()
    config_file: Any = keep()
    form_note: Any = keep()  # "The form shows the settings of run X": emptied once a newer run is the current one
    trackers: Any = keep()  # how to open the run's TensorBoard / trackio dashboard
    hub_note: Any = keep()  # the last push, or (on a Space) the advice to push
    push_repo: Any = keep()  # the repository box, filled from the run's push_to_hub
    try_panel: TryPanel | None = None  # None: Try it stays as it is
    note: Any = keep()  # the last action's message (Start, Stop, Resume), cleared when the run ends
    scatter: Any = keep()  # a finished run whose kind plots it: predicted against true values (app.train.scatter)
    completions: Any = keep()  # a GRPO run's latest sample completions with their rewards (hidden for the others)
    # The run pickers of Try it and Export (`app.picks`): the newest picked once the current run changes.
    try_pick: Any = keep()
    export_pick: Any = keep()


class Follow:
    """The poll of one app."""

    def __init__(self, state: AppState):
        self.state = state

    def _seen_by(self, request: Any) -> tuple[JobStatus, str, bool]:
        """The status the caller may see (someone else's run: idle), its state line (with the caller's queued
        runs), and whether the caller has a run in the queue."""
        policy = self.state.policy
        user, refusal = policy.who(request)
        status = self.state.jobs.status()
        # A job whose launcher went away (the app restarted) is followed again once its owner is here to do so.
        if not refusal and self.state.remote.reattach(self.state.jobs.training, status, user, request):
            status = self.state.jobs.status()
        queued = self.queue_lines(user)
        if policy.is_mine(status, user):
            return status, "\n\n".join([run_report.status_markdown(status), *queued]), bool(queued)
        note = policy.in_progress(status) if status.active else ""
        idle = JobStatus(state="idle")
        said = "\n\n".join([*(f"**{line}**" for line in (note, refusal) if line), *queued])
        return idle, said or run_report.status_markdown(idle), bool(queued)

    def queue_lines(self, user: str | None) -> list[str]:
        """One line for each of `user`'s queued runs: "Queued, position N" and its folder."""
        state = self.state
        return [f"**Queued, position {n}** — `{shown_path(q.run_dir, state.runs_dir, state.access.shared)}`: it "
                f"starts by itself when {waits_for(n)}." for q, n in state.jobs.queued(user)]

    def _shown(self, run_dir: Any) -> str:
        """The run folder as the Run panel shows it: on a shared server by its place in the runs folder
        (`runs/<user>/<run>`), as every message does, never by where the server keeps it."""
        return shown_path(run_dir, self.state.runs_dir, self.state.access.shared) if run_dir else ""

    @staticmethod
    def _config_text(status: JobStatus) -> str:
        """The config the run's command runs, as the Reproduce box shows it."""
        try:
            return status.config_path.read_text(encoding="utf-8", errors="replace") if status.config_path else ""
        except OSError:  # deleted meanwhile: the command alone
            return ""

    def poll(self, seen: Any, *, request: Any = None) -> RunShown:
        """Refresh the run's progress, curve, log and results, Try it and Export; leave everything as it is when
        nothing changed."""
        status, text, queued = self._seen_by(request)
        command = reproduce_command(status)
        signature = (str(status.run_dir), len(status.events), status.state, status.message, status.output_tail,
                     text, command)
        if seen == signature:
            return RunShown()
        known = isinstance(seen, (list, tuple))  # what this page showed before (None: a new page)
        changed_run = not known or list(seen[:1]) + list(seen[2:3]) != [str(status.run_dir), status.state]
        newer_run = known and seen[0] != str(status.run_dir)
        new_model = not known or newer_run or status.state == "done"
        # The Reproduce box is rewritten only when the command changes (a new run, a resume): an import or an
        # export in between keeps its own YAML and command, and never shares the box with another config's.
        new_command = bool(command) and (not known or list(seen[6:7]) != [command])
        options = publish.run_options(status) if status.run_dir else {"report_to": [], "push_to_hub": None}
        return RunShown(signature=signature, status=text,
                        progress=run_report.progress_html(status), stats=run_report.stats_markdown(status),
                        loss_curve=charts.curves_html(status.events), log=run_report.log_text(status),
                        metrics=final_metrics(status) or None, run_dir=self._shown(status.run_dir),
                        start_button=gr.update(interactive=True),
                        stop_button=gr.update(interactive=status.active),
                        resume_button=gr.update(visible=status.resumable), cancel_button=gr.update(visible=queued),
                        command=command if new_command else gr.skip(),
                        config_yaml=self._config_text(status) if new_command else gr.skip(),
                        config_file=None if new_command else gr.skip(),
                        form_note="" if newer_run else gr.skip(),
                        trackers=run_report.trackers_markdown(options["report_to"], status.run_dir),
                        hub_note=publish.hub_markdown(status, on_space=bool(self.state.restart_notice)),
                        push_repo=options["push_to_hub"] or gr.skip(),
                        try_panel=panel(status, new_model=new_model) if changed_run else None,
                        # "Started…", "Stopping…" and the like answered an action on this run: its end replaces them.
                        note="" if changed_run and status.state in TERMINAL and known else gr.skip(),
                        scatter=scatter.scatter_update(status), completions=completions_update(status),
                        **self._picks(request, changed_run))

    def _picks(self, request: Any, changed_run: bool) -> dict[str, Any]:
        """After the current run changed, the pickers' runs and checkpoints, the newest picked (`app.picks`)."""
        if not changed_run:
            return {}
        user, refusal = self.state.policy.who(request)
        update = picker_update(self.state.policy.runs_home(user, refusal), self.state.jobs.status())
        return {"try_pick": update, "export_pick": update}


def completions_update(status: JobStatus) -> Any:
    """The sample completions table of the run's latest evaluation, shown only when the run wrote one."""
    table = run_report.samples_html(status.events)
    return gr.update(value=table, visible=bool(table))
