"""`finetune eval RUN --data EXTRA [--base]`: an encoder run's own held-out metrics (a classifier's accuracy and
macro-F1, a regressor's errors and correlations, a tagger's seqeval scores, an embedding model's retrieval or
correlation scores) on a named extra evaluation set, and with `--base` the same metrics of the model it started
from, kept in RUN/benchmarks.json beside each other as the harness's scores are (one "task" per evaluation set).

The metrics are the kind's own (`finetune.use.evaluate`), the data read with the run's column mapping. The base of a
classifier, a regressor or a tagger has no trained head: it gets a new, random one (the untrained baseline, the
number a fine-tune must beat); an embedding model's base is the encoder with its pooling, scored under the names of
sentence-transformers' evaluators as the run is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.config.schema import ConfigError, read_yaml
from finetune.errors import ModelError
from finetune.models.heads import read_tasks_file
from finetune.models.pretrained import resolve_model_dir, resolve_model_path, task_of
from finetune.registry import entry
from finetune.run.rundir import write_json
from finetune.use.benchmarks import RESULTS, merged
from finetune.use.evaluate import evaluate_base, evaluate_target

# What a record says scored it, in benchmarks.json's "harness" (lm-evaluation-harness's records say "lm-eval …").
HELD_OUT = "finetune held-out metrics"
NOT_METRICS = ("model", "task", "samples", "documents", "long_documents")  # what `evaluate_target` adds beside them


def check_target(target: str, model_dir: Path, run_dir: Path | None, *, base: bool) -> str:
    """The run's kind, when its model is scored by its own held-out metrics (a kind that does not generate); a
    language model, a multi-task model or a base without its run is one sentence."""
    if read_tasks_file(model_dir) is not None:
        raise ModelError(f"{target!r} is a multi-task model: evaluate one task on the extra data with "
                         "`finetune eval RUN task=<name> dataset=<file>`.")
    kind = task_of(model_dir)
    if entry(kind).generates:
        raise ConfigError([f"--data scores an encoder's own metrics (classification, regression, token "
                           f"classification, embedding), but {target!r} holds a {entry(kind).summary} model: score "
                           "it with --benchmarks TASK[,TASK…] (lm-evaluation-harness), or its loss on other data with "
                           "`finetune eval RUN dataset=<file>`."])
    if base and run_dir is None:
        raise ConfigError([f"--base scores the model a run started from, but {target!r} is a model folder without "
                           "its run: point at the run directory."])
    return kind


def evaluation_set(data: str) -> str:
    """The extra evaluation set's name (a file's stem, or the hub id); a file that is not there is one sentence."""
    path = Path(data).expanduser()
    if path.suffix and not path.exists():
        raise ConfigError([f"--data {data!r} does not exist: give a CSV, JSON Lines or Parquet file (or a hub "
                           "dataset id) with the run's columns."])
    return path.stem if path.suffix else data


def run_heldout(target: str, data: str, *, base: bool = False, overrides: list[str] | None = None,
                progress: Any = None) -> dict[str, Any]:
    """Score a run's model (and with `base` its base model) with the kind's own metrics on `data`; kept in
    RUN/benchmarks.json (merged with what was scored before) and returned."""
    model_dir, run_dir = resolve_model_dir(target)
    kind = check_target(target, model_dir, run_dir, base=base)
    name = evaluation_set(data)
    chosen = [*(overrides or []), f"dataset={data}"]
    # No word before the model's scores: a data set the run's columns cannot read is then said alone.
    record = {"harness": HELD_OUT, "model": _side(model_dir, evaluate_target(target, chosen), name, data)}
    if base:
        start = resolve_model_path(str(read_yaml(run_dir / "config.yaml")["model"]))
        head = "random (untrained)" if entry(kind).auto_model.startswith("AutoModelFor") else None
        if progress:
            progress(f"scoring the base model ({start})" + (f" with a {head} head" if head else ""))
        record["base"] = {**_side(Path(start), evaluate_base(run_dir, chosen), name, data),
                          **({"head": head} if head else {})}
    if run_dir is not None:
        write_json(run_dir / RESULTS, merged(run_dir / RESULTS, record))
    return record


def _side(model: Path, result: dict[str, Any], name: str, data: str) -> dict[str, Any]:
    """One model's scores in benchmarks.json's shape: per evaluation set, each metric's value (no standard error:
    the kind's metrics have none)."""
    metrics = {key: {"value": float(value), "stderr": None} for key, value in result.items()
               if key not in NOT_METRICS and isinstance(value, int | float)}
    return {"model_args": {"pretrained": str(model.resolve()) if model.is_dir() else str(model)},
            "tasks": {name: {"metrics": metrics, "samples": result["samples"], "data": data}}}
