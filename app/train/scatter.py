"""The GUI's regression widgets: the numbers a target column holds (under the preview), and after a run a scatter
of the model's predictions against the true values of its evaluation rows."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pandas as pd

MAX_POINTS = 2000  # a scatter of more points tells no more, and is re-sent to the browser whole


def target_summary(table: Any, column: str) -> dict[str, float]:
    """The smallest, mean and largest target of a column of numbers (checked by the kind before)."""
    import pyarrow.compute as pc

    values = pc.cast(table.with_format("arrow")[column], "float64")
    return {"min": pc.min(values).as_py(), "mean": pc.mean(values).as_py(), "max": pc.max(values).as_py()}


def summary_markdown(rows: str, summary: dict[str, float]) -> str:
    """The preview's line for a target column: how many rows, and the range of the numbers."""
    return f"{rows} · numbers from {summary['min']:g} to {summary['max']:g} (mean {summary['mean']:.4g})"


def is_regression_run(run_dir: Path | None) -> bool:
    """Whether the run in `run_dir` trained `task: regression` (its config.yaml says)."""
    from finetune.config.schema import read_yaml

    path = Path(run_dir or "") / "config.yaml"
    return run_dir is not None and path.is_file() and read_yaml(path).get("task") == "regression"


def scatter_frame(run_dir: Path) -> pd.DataFrame | None:
    """The finished model's prediction and the true value of each of the run's evaluation rows (at most
    MAX_POINTS), or None when the run held none out; computed once per finished run."""
    model = Path(run_dir) / "model" / "model.safetensors"
    stamp = model.stat().st_mtime_ns if model.is_file() else None
    return _frame(str(run_dir), stamp)


@functools.lru_cache(maxsize=4)
def _frame(run_dir: str, stamp: int | None) -> pd.DataFrame | None:
    import torch

    from finetune.config.schema import from_dict, read_yaml
    from finetune.data.load import collate, load_data
    from finetune.kinds.registry import kind
    from finetune.models.load import load_tokenizer, load_trained

    c = from_dict({**read_yaml(Path(run_dir) / "config.yaml"), "resume": False, "overwrite": False})
    tokenizer = load_tokenizer(c)
    data = load_data(c, tokenizer)[1]  # the run's own evaluation rows, from the data cache when it has them
    if data is None or len(data) == 0:
        return None
    model = load_trained(Path(run_dir) / "model", "regression").eval()
    regression, rows = kind("regression"), list(range(min(len(data), MAX_POINTS)))
    true, predicted = [], []
    with torch.inference_mode():
        for s in range(0, len(rows), 64):
            batch = collate(data, rows[s:s + 64], tokenizer.pad_token_id, regression)
            labels = batch.pop("labels")
            predicted += model(**batch).logits.float().reshape(-1).tolist()
            true += labels.tolist()
    return pd.DataFrame({"true": true, "predicted": predicted})


def scatter_update(status: Any) -> Any:
    """The scatter's widget update for a job status: shown for a finished regression run, hidden otherwise."""
    import gradio as gr

    if status.state != "done" or status.model_dir is None or not is_regression_run(status.run_dir):
        return gr.update(visible=False)
    frame = scatter_frame(status.run_dir)
    return gr.update(value=frame, visible=True) if frame is not None else gr.update(visible=False)
