"""The Results' plot of a finished run whose kind names the "scatter" plot in its registry entry (regression): the
model's predictions against the true values of the run's evaluation rows."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pandas as pd

from finetune import registry as kinds
from finetune.config.schema import read_yaml

MAX_POINTS = 2000  # a scatter of more points tells no more, and is re-sent to the browser whole


def plot_of(run_dir: Path | None) -> str:
    """The plot the kind of the run in `run_dir` (its config.yaml says) names for its Results ("" for none)."""
    path = Path(run_dir or "") / "config.yaml"
    if run_dir is None or not path.is_file():
        return ""
    task = read_yaml(path).get("task", kinds.DEFAULT)
    return kinds.entry(task).eval_plot if task in kinds.names() else ""


def scatter_frame(run_dir: Path) -> pd.DataFrame | None:
    """The finished model's prediction and the true value of each of the run's evaluation rows (at most
    MAX_POINTS), or None when the run held none out; computed once per finished run."""
    model = Path(run_dir) / "model" / "model.safetensors"
    stamp = model.stat().st_mtime_ns if model.is_file() else None
    return _frame(str(run_dir), stamp)


@functools.lru_cache(maxsize=4)
def _frame(run_dir: str, stamp: int | None) -> pd.DataFrame | None:
    import torch

    from finetune.config.schema import from_dict
    from finetune.data.load import collate, load_data
    from finetune.models.pretrained import load_tokenizer, load_trained

    c = from_dict({**read_yaml(Path(run_dir) / "config.yaml"), "resume": False, "overwrite": False})
    tokenizer = load_tokenizer(c)
    data = load_data(c, tokenizer)[1]  # the run's own evaluation rows, from the data cache when it has them
    if data is None or len(data) == 0:
        return None
    model = load_trained(Path(run_dir) / "model", c.task).eval()
    kind, rows = kinds.kind(c.task), list(range(min(len(data), MAX_POINTS)))
    true, predicted = [], []
    with torch.inference_mode():
        for s in range(0, len(rows), 64):
            batch = collate(data, rows[s:s + 64], tokenizer.pad_token_id, kind)
            labels = batch.pop("labels")
            predicted += model(**batch).logits.float().reshape(-1).tolist()
            true += labels.tolist()
    return pd.DataFrame({"true": true, "predicted": predicted})


def scatter_update(status: Any) -> Any:
    """The scatter's widget update for a job status: shown for a finished run whose kind plots it, hidden
    otherwise."""
    import gradio as gr

    if status.state != "done" or status.model_dir is None or plot_of(status.run_dir) != "scatter":
        return gr.update(visible=False)
    frame = scatter_frame(status.run_dir)
    return gr.update(value=frame, visible=True) if frame is not None else gr.update(visible=False)
