"""The model the Export tab acts on: the run or checkpoint picked at its top (`app.picks`), for Download model, Push
to the Hub, Export model and Push the export alike.

The empty pick is the caller's current run, as before the picker (the API's `/push` without `run`). A picked value is
a visitor's input: `resolve_pick` confines it to the caller's runs folder, and the run's files pass the policy Try it
and Export model apply (`RequestPolicy.run_refusal`) before anything is zipped or uploaded.
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from app.downloads import zip_model
from app.picks import Picked, PickRefused, resolve_pick
from app.state import AppState
from finetune.errors import InputError

NOTHING_YET = "Nothing to push yet: train a run to the end first."


def picked_model(state: AppState, user: str | None, refusal: str, run: str | None) -> Picked:
    """The caller's current finished run (no `run`), or the run or checkpoint `run` among theirs; `PickRefused`
    (one sentence) for anything else."""
    status = state.jobs.status()
    if not run or not str(run).strip():
        if not state.policy.is_mine(status, user) or status.state != "done" or status.run_dir is None:
            raise PickRefused(NOTHING_YET)
        picked = Picked(run_dir=status.run_dir, target=status.run_dir)
    else:
        picked = resolve_pick(str(run), state.policy.runs_home(user, refusal), status)
    if refused := state.policy.run_refusal(picked.run_dir, user):
        raise PickRefused(refused)
    return picked


def download_name(picked: Picked) -> str:
    """What the browser saves the zip as: the run's name, and the checkpoint's step for a checkpoint."""
    return f"{picked.run_dir.name}-{picked.target.name}.zip" if picked.checkpoint else f"{picked.run_dir.name}.zip"


def download_update(state: AppState, picked: Picked) -> Any:
    """Download model for `picked`: its model folder zipped (once, beside it), named after the run (and step)."""
    model_dir = picked.model_dir  # a checkpoint's is written on first use
    if model_dir is None:
        return gr.update(value=None, interactive=False)
    zipped = zip_model(model_dir, picked.target / "model.zip")
    return gr.update(value=state.downloads.handout(zipped, download_name(picked)), interactive=True)


def model_buttons(state: AppState, user: str | None, refusal: str, run: str | None) -> dict[str, Any]:
    """Download model and Push to the Hub for the pick: enabled with its zip, or disabled with nothing to hand out
    (no pick, a refused one, a checkpoint whose model cannot be written)."""
    off = {"download": gr.update(value=None, interactive=False), "push": gr.update(interactive=False)}
    try:
        picked = picked_model(state, user, refusal, run)
        return {"download": download_update(state, picked), "push": gr.update(interactive=True)}
    except (PickRefused, InputError):
        return off
