"""Which run, which checkpoint: the picker of Try it and Export.

Its choices are the caller's own runs (their runs folder, `RequestPolicy.runs_home`) that hold a model: every
finished run, newest first, and each kept checkpoint of a stopped or failed one (`finetune.use.checkpoint`). A
choice's value is the run's folder name, or NAME/checkpoints/step-…; what the page sends back is a visitor's input,
so `resolve_pick` accepts only one of those, inside the caller's runs folder, through no link, and not the run that
is training now. The empty value is the current run, as before the picker.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gradio as gr

from app.door.access import AccessError, resolve_output_dir
from app.local.training import JobStatus
from app.runs.listing import headline, list_runs, run_info
from finetune.run.rundir import MARKER, checkpoints, is_finished

if TYPE_CHECKING:
    from app.follow import Seen


class PickRefused(ValueError):
    """A picked run the caller may not use: one sentence."""


@dataclass(frozen=True)
class Picked:
    """A model Try it or Export acts on: a finished run, or one checkpoint of a stopped run (`target`)."""

    run_dir: Path
    target: Path  # the run folder, or RUN/checkpoints/step-…
    state: str = "done"  # what `app.tryit.panel.try_view` asks of a status

    @property
    def checkpoint(self) -> bool:
        """Whether it is a checkpoint rather than the run's final model."""
        return self.target != self.run_dir

    @property
    def model_dir(self) -> Path | None:
        """The model folder (a checkpoint's is written on first use, `finetune.use.checkpoint`)."""
        if self.checkpoint:  # imported here: the app starts without transformers and datasets
            from finetune.use.checkpoint import checkpoint_model

            return checkpoint_model(self.target)
        return JobStatus(state="done", run_dir=self.run_dir).model_dir


def _short(model: str) -> str:
    return Path(model).name if "/" in model and Path(model).is_absolute() else model


def pick_choices(home: Path | None, current: JobStatus | None = None) -> list[tuple[str, str]]:
    """(label, value) of every run in `home` with a model, newest first: a finished run labelled with its task,
    model and main metric; a stopped or failed one by each of its checkpoints, newest first."""
    if home is None:
        return []
    out = []
    for run in list_runs(home, current):
        if run.active:
            continue
        about = " · ".join(p for p in (run.task, _short(run.model)) if p)
        if run.state == "done" and is_finished(run.path):
            metric = headline(run.metrics).split(", ")[0]
            out.append((f"{run.name} · {about}" + (f" · {metric}" if metric else ""), run.name))
        elif run.state in ("stopped", "failed"):
            for path in reversed(checkpoints(run.path)):
                out.append((f"{run.name} · step {int(path.name.removeprefix('step-'))} checkpoint · {about}",
                             f"{run.name}/checkpoints/{path.name}"))
    return out


def resolve_pick(value: str, home: Path | None, current: JobStatus | None = None) -> Picked:
    """The run or checkpoint `value` names inside `home` (see the module), or `PickRefused`."""
    if home is None:
        raise PickRefused("You have no runs here: train a run first.")
    nowhere = PickRefused(f"There is no finished run or checkpoint {str(value)[:80]!r} among your runs: pick one "
                          "from the list.")
    try:
        path = resolve_output_dir(str(value), home)
    except AccessError:
        raise nowhere from None
    inside = home.resolve()
    if path is None or not path.resolve().is_relative_to(inside) or path.resolve() == inside:
        raise nowhere
    parts = path.resolve().relative_to(inside).parts
    run_dir = inside / parts[0]
    if any(p.is_symlink() for p in (run_dir, *(run_dir / Path(*parts[1:i]) for i in range(2, len(parts) + 1)))):
        raise nowhere
    if not (run_dir / MARKER).is_file():
        raise nowhere
    if current is not None and current.active and current.run_dir is not None \
            and current.run_dir.resolve() == run_dir:
        raise PickRefused("That run is training now: try it once it has finished or stopped.")
    if len(parts) == 1 and is_finished(run_dir):
        return Picked(run_dir=run_dir, target=run_dir)
    if len(parts) == 3 and parts[1] == "checkpoints" and inside / Path(*parts) in checkpoints(run_dir):
        return Picked(run_dir=run_dir, target=inside / Path(*parts))
    raise nowhere


def final_metrics_of(run_dir: Path) -> dict[str, Any]:
    """The run's final metrics (its done event's), {} before it finished."""
    return run_info(run_dir).metrics


def picker_update(home: Path | None, current: JobStatus | None, value: Any = None) -> Any:
    """The picker's choices, keeping `value` when it is still one of them, else the newest."""
    choices = pick_choices(home, current)
    values = [v for _, v in choices]
    return gr.update(choices=choices, value=value if value in values else (values[0] if values else None))


def newest_pick(seen: Seen) -> Any:
    """After the current run changed, the run pickers' update for the poll's tick `seen` (Try it's and Export's):
    the caller's runs and checkpoints, the newest picked; worked out once for both."""
    def update() -> Any:
        return picker_update(seen.state.policy.runs_home(seen.user, seen.refusal), seen.state.jobs.status())
    return seen.once("picks", update)
